"""torchrun as the training image runs it: torch.distributed.run itself, with its etcd rendezvous' run directory fixed.
The image's `torchrun` is `python3 -m doeks.torchrun` (elasticjob/Dockerfile); doeks' local agent applies the same fix.

torch's etcd rendezvous makes the run's directory (/torchelastic/p2p/run_<id>) with a 2 h TTL and starts a thread that
renews it with `client.refresh`. etcd (3.4, 3.5: the v2 API the job's etcd serves) refuses to change a directory's TTL
(`Raft Internal Error ... Not a file`), so that thread dies at its first try with a traceback in every node's log, and
the directory is never renewed: 2 h after the job started it lapses with the rendezvous state in it, and a node that
fails after that cannot rendezvous again ("Unexpected state of EtcdRendezvousHandler, worker needs to die"). Here the
directory lives 7 days and nobody tries to renew it: each deploy makes a new run id, and the job's etcd goes with it.

Standard library and torch only: in the image it runs without the rest of doeks.
"""
from __future__ import annotations

import sys
import threading

RUN_DIR_TTL = 7 * 24 * 3600


def patch_run_dir() -> None:
    try:
        from torch.distributed.elastic.rendezvous import etcd_rendezvous
    except ImportError:  # no python-etcd: no etcd rendezvous to fix
        return
    rendezvous = etcd_rendezvous.EtcdRendezvous
    if getattr(rendezvous, "_doeks_run_dir", False):
        return
    etcd_rendezvous.CONST_RUNID_SUBROOT_TTL = RUN_DIR_TTL
    renew = rendezvous.setup_lease_renewal

    def lease(self, full_path, ttl):
        if full_path == self.get_path(""):  # the run's directory: its TTL cannot be renewed, see RUN_DIR_TTL
            return threading.Event()
        return renew(self, full_path, ttl)

    rendezvous.setup_lease_renewal = lease
    rendezvous._doeks_run_dir = True


def main() -> int:
    patch_run_dir()
    from torch.distributed.run import main as torchrun

    sys.argv[0] = "torchrun"
    torchrun()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""torchrun for a local node: `python -m doeks.local.agent [torchrun args]`.

Exactly torch.distributed.run (same arguments, same rendezvous protocol, same worker environment), with changes that
only make sense when every node is a process on this machine:

- workers are forks of a zygote that has imported torch and torchvision once (doeks.pod.zygote), so a start or a
  restart does not pay for those imports again;
- etcd rendezvous: an agent that leaves a round deletes its own keep-alive key instead of letting it lapse, so the
  others see at once that the round is over, and an agent whose round was replaced by a newer one joins it at its next
  health check instead of waiting for its own workers to fail; the keep-alive lease is 3 s instead of 10 s for an agent
  that died (these three are doeks.pod.torchrun's, which the training image runs too);
- etcd rendezvous: the join window ("last call") stays open until every node the local supervisor runs has joined
  (up to JOIN_WAIT s), then closes at once: torch closes it 1 s after the first node, so a node slower than that to
  start rendezvoused the others without it, and they re-rendezvoused when it came;
- as the training image's torchrun (doeks.pod.torchrun): a restart of the workers is said in the log, a worker that exits
  with 2 (the training script's code for a permanent error) is not restarted, and a stop or the end of the restarts is
  one line, not a traceback; the supervisor (doeks.local.jobs) fails the job with the reason it reads from the log;
- the run's etcd directory lives 7 days instead of 2 h, and nobody tries to renew it: torch renews it as if it were
  a file, which etcd refuses (a traceback in every log and no renewal at all); the same fix as the training image's
  torchrun (doeks.pod.torchrun). The local etcd and its run ids are the toolkit's own: a new deploy makes a new run id,
  and `down` stops the server.
"""
from __future__ import annotations

import json
import os
import sys
import time

from torch.distributed.elastic.rendezvous import etcd_rendezvous
from torch.distributed.run import main

from ..pod import zygote as zygote_module
from ..pod.torchrun import patch_rendezvous as patch_torchrun
from ..pod.torchrun import patch_restarts, patch_whole_lines, patch_worker_start, run_quietly

LAST_CALL_POLL = 0.2
JOIN_WAIT = 120  # longest the join window waits for a node the supervisor runs (its start: importing torch)


def expected_nodes() -> int | None:
    """How many nodes the local supervisor wants now (None when not run by it)."""
    home = os.environ.get("DOEKS_JOB_HOME")
    if not home:
        return None
    try:
        with open(os.path.join(home, "status.json")) as f:
            return int(json.load(f)["desired"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def patch_rendezvous() -> None:
    """The image's fixes (doeks.pod.torchrun: run directory, 3 s keep-alive, leaving a round at once, joining a newer
    round), then the local supervisor's join window."""
    patch_torchrun()
    rendezvous = etcd_rendezvous.EtcdRendezvous
    last_call = rendezvous.handle_join_last_call

    def close_when_all_joined(self, expected_version, deadline):
        """Keep the join window open until every node the supervisor wants has joined (up to JOIN_WAIT s: a node
        may still be starting, importing torch on a loaded machine), then close it at once. torch closes it
        `last_call_timeout` (1 s) after the first node when the minimum is 1: a node slower than that to join
        rendezvoused the others without it, and a second round followed when it arrived. Not run by the supervisor
        (no wanted count): torch's last call as it is."""
        patience = time.time() + JOIN_WAIT
        refreshed = 0.0
        while True:
            wanted = expected_nodes()
            limit = patience if wanted else deadline
            active_version, state = self.get_rdzv_state()
            if state["status"] != "joinable" or state["version"] != expected_version or time.time() >= limit:
                break
            if wanted and len(state["participants"]) >= min(wanted, self._num_max_workers):
                break
            if time.time() - refreshed > etcd_rendezvous.CONST_ETCD_JOINABLE_EPHEMERAL_TTL / 3:
                try:  # the joinable round lapses after its TTL (10 s) unless renewed, as torch's last call does
                    active_version = self.client.test_and_set(
                        key=self.get_path("/rdzv/active_version"), value=active_version.value,
                        prev_value=active_version.value, ttl=etcd_rendezvous.CONST_ETCD_JOINABLE_EPHEMERAL_TTL)
                    refreshed = time.time()
                except etcd_rendezvous.etcd.EtcdCompareFailed:
                    continue  # it changed meanwhile: read it again
            self.try_wait_for_state_change(etcd_index=active_version.etcd_index + 1,
                                           timeout=max(0.0, min(LAST_CALL_POLL, limit - time.time())))
        return last_call(self, expected_version, min(deadline, time.time()))

    rendezvous.handle_join_last_call = close_when_all_joined


if __name__ == "__main__":
    from ..pod.torchrun import check_torch

    if not check_torch():
        sys.exit(2)
    patch_whole_lines()  # a worker the zygote cannot start is started the usual way, its lines whole
    if os.environ.get("DOEKS_PRELOAD", "1") != "0":
        patch_worker_start(zygote_module.start())  # in a worker, start() runs the script and exits
    patch_rendezvous()
    patch_restarts()
    from ..pod import watchdog

    watchdog.patch_agent()  # after patch_restarts: it wraps the monitor loop that one changed
    sys.exit(run_quietly(main, end_wait_s=0))  # the supervisor reads why itself (the manifest's wait is a container's)

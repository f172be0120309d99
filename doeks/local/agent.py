"""torchrun for a local node: `python -m doeks.local.agent [torchrun args]`.

Exactly torch.distributed.run (same arguments, same rendezvous protocol, same worker environment), with changes that
only make sense when every node is a process on this machine:

- workers are forks of a zygote that has imported torch and torchvision once (doeks.local.zygote), so a start or a
  restart does not pay for those imports again;
- etcd rendezvous: an agent that leaves a round deletes its own keep-alive key instead of letting it lapse, so the
  others see at once that the round is over, and an agent whose round was replaced by a newer one joins it at its next
  health check instead of waiting for its own workers to fail; the keep-alive lease is 3 s instead of 10 s for an agent
  that died;
- etcd rendezvous: the join window ("last call") closes as soon as every node the local supervisor runs has joined
  (it still waits the full last call when fewer have: a restarted node may be on its way);
- a worker that exits with 2 (the training script's code for a permanent error: bad arguments, as argparse exits, missing
  data, an unusable checkpoint) is not restarted: running the same thing again cannot succeed, so the node fails at
  once and the supervisor (doeks.local.jobs) fails the job with the reason it reads from the log;
- the run's etcd directory lives 7 days instead of 2 h, and nobody tries to renew it: torch renews it as if it were
  a file, which etcd refuses (a traceback in every log and no renewal at all); the same fix as the training image's
  torchrun (doeks.torchrun). The local etcd and its run ids are the toolkit's own: a new deploy makes a new run id,
  and `down` stops the server.
"""
from __future__ import annotations

import json
import os
import sys
import time

from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
from torch.distributed.elastic.rendezvous import etcd_rendezvous
from torch.distributed.run import main

from ..torchrun import patch_run_dir
from . import zygote as zygote_module

KEEPALIVE_TTL = 3
LAST_CALL_POLL = 0.2


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
    patch_run_dir()
    rendezvous = etcd_rendezvous.EtcdRendezvous
    etcd_rendezvous.CONST_WORKER_KEEPALIVE_TTL = KEEPALIVE_TTL
    setup_lease_renewal, barrier, last_call = rendezvous.setup_lease_renewal, rendezvous.rendezvous_barrier, rendezvous.handle_join_last_call

    def lease(self, full_path, ttl):
        stop = setup_lease_renewal(self, full_path, ttl)
        if full_path != self.get_path(""):  # this rank's keep-alive key (the run's directory has no renewal)
            self._doeks_lease = (full_path, stop)
        return stop

    def leave_then_barrier(self):
        path, stop = getattr(self, "_doeks_lease", (None, None))
        if path is not None:
            stop.set()
            try:
                self.client.delete(path)
            except Exception:  # noqa: BLE001 - already lapsed or gone with its round
                pass
            self._doeks_lease = (None, None)
        version, rank, world_size = barrier(self)
        self._doeks_version = version
        return version, rank, world_size

    def close_when_all_joined(self, expected_version, deadline):
        while time.time() < deadline:
            wanted = expected_nodes()
            if not wanted:
                break
            active_version, state = self.get_rdzv_state()
            if state["status"] != "joinable" or state["version"] != expected_version:
                break
            if len(state["participants"]) >= min(wanted, self._num_max_workers):
                deadline = time.time()
                break
            self.try_wait_for_state_change(etcd_index=active_version.etcd_index + 1,
                                           timeout=max(0.0, min(LAST_CALL_POLL, deadline - time.time())))
        return last_call(self, expected_version, deadline)

    def nodes_waiting(self):
        """As torch's, and > 0 also when a newer round than ours is forming (a node left ours): go and join it."""
        try:
            _, state = self._rdzv_impl.get_rdzv_state()
        except etcd_rendezvous.etcd.EtcdKeyNotFound:
            return 0
        status, version = state.get("status"), state.get("version")
        mine = getattr(self._rdzv_impl, "_doeks_version", None)
        if status == "final" and (mine is None or version == mine):
            return state["num_workers_waiting"]
        if mine is not None and status in ("joinable", "frozen", "final") and version != mine:
            return 1
        return 0

    etcd_rendezvous.EtcdRendezvousHandler.num_nodes_waiting = nodes_waiting
    rendezvous.setup_lease_renewal = lease
    rendezvous.rendezvous_barrier = leave_then_barrier
    rendezvous.handle_join_last_call = close_when_all_joined


PERMANENT_EXIT = 2


def patch_permanent_exit() -> None:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers

    def monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        if result.is_failed():
            codes = sorted({f.exitcode for f in result.failures.values()})
            if PERMANENT_EXIT in codes:
                if self._remaining_restarts:
                    print(f"doeks: a worker exited with {PERMANENT_EXIT} (permanent error): not restarting the workers",
                          flush=True)
                self._remaining_restarts = 0
            elif self._remaining_restarts > 0:
                # torchrun's own line for this is INFO, which its logging setup does not show: doeks.local.jobs
                # counts these as the node's restarts
                print(f"doeks: worker group failed (exit codes {codes}): torchrun restarts it, "
                      f"{self._remaining_restarts}/{worker_group.spec.max_restarts} attempts left", flush=True)
        return result

    LocalElasticAgent._monitor_workers = monitor_workers


def patch_worker_start(zygote: zygote_module.Zygote) -> None:
    handler = subprocess_handler.SubprocessHandler
    popen = handler._popen

    def start_worker(self, args, env):
        if zygote_module.runnable(args):
            try:
                return zygote.spawn(list(args), env, self._stdout and self._stdout.name, self._stderr and self._stderr.name)
            except zygote_module.ZygoteGone:
                pass
        return popen(self, args, env)

    handler._popen = start_worker


if __name__ == "__main__":
    if os.environ.get("DOEKS_PRELOAD", "1") != "0":
        patch_worker_start(zygote_module.start())  # in a worker, start() runs the script and exits
    patch_rendezvous()
    patch_permanent_exit()
    sys.exit(main())

"""torchrun as the training image runs it: torch.distributed.run itself, with its etcd rendezvous fixed. The image's
`torchrun` is `python3 -m doeks.pod.torchrun` (elasticjob/Dockerfile); doeks' local agent applies the same fixes.

Recovery (measured by bench/cluster_target.py): an agent that leaves a round (its workers failed, or it is told to
restart) deletes its own keep-alive key instead of letting it lapse, so the others see at once that the round is over;
an agent whose round was replaced by a newer one joins it at its next health check instead of waiting for its own
workers to fail; and the keep-alive lease is 3 s instead of 10 s, the most a round waits for an agent that died
(torch waits for one keep-alive key to lapse before it starts the next round).

torch's etcd rendezvous makes the run's directory (/torchelastic/p2p/run_<id>) with a 2 h TTL and starts a thread that
renews it with `client.refresh`. etcd (3.4, 3.5: the v2 API the job's etcd serves) refuses to change a directory's TTL
(`Raft Internal Error ... Not a file`), so that thread dies at its first try with a traceback in every node's log, and
the directory is never renewed: 2 h after the job started it lapses with the rendezvous state in it, and a node that
fails after that cannot rendezvous again ("Unexpected state of EtcdRendezvousHandler, worker needs to die"). Here the
directory lives 7 days and nobody tries to renew it: each deploy makes a new run id, and the job's etcd goes with it.

Preloaded workers (doeks.pod.zygote): the agent forks, right after its own `import torch`, a process that imports
torchvision and the rest once; every worker (start and restart) is a fork of it instead of a new interpreter
importing them again: a replaced pod's first step and a restarted container's come seconds sooner. A fork runs the
script through doeks.pod.worker.run, as a new interpreter's `python -u -m doeks.pod.worker script.py` does. DOEKS_PRELOAD=0
in the pod's environment starts workers the usual way (that command).

The hang watchdog (doeks.pod.watchdog) runs in the agent's monitor loop when DOEKS_HANG_TIMEOUT is set.

Before it starts, it waits (at most RDZV_WAIT_S) for its etcd rendezvous server to take a connection: a job's pods and
its etcd are made together, and an agent that started before the etcd Service's name resolved ended at once, its
container restarted by the kubelet after 10 s, then 20 s (see wait_for_rendezvous).

Standard library and torch only, doeks.pod.reasons (standard library: how doeks reads a traceback), doeks.pod.worker
(how a worker runs the script), doeks.pod.zygote and doeks.pod.watchdog, staged beside it: in the image it runs without the
rest of doeks.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

RUN_DIR_TTL = 7 * 24 * 3600
KEEPALIVE_TTL = 3


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


def patch_closing() -> None:
    """The run's rendezvous closed only where this node's run ended: its workers succeeded, or failed with no restart
    left (how the other nodes learn the run is over). torch's launch_agent closes it whenever the agent ends other than
    by a signal, also on an error of the agent's own (its rendezvous timed out waiting for nodes not there yet, its
    etcd lost and made again): after that no node can join the run again, and every node that restarts meets
    RendezvousClosedError, for good. Such an agent ends with its error, the run left open: its container, restarted,
    joins again (tests/test_rendezvous_closing.py)."""
    try:
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
        from torch.distributed.elastic.multiprocessing.api import SignalException
    except ImportError:
        return
    if getattr(SimpleElasticAgent, "_doeks_closing", False):
        return
    run = SimpleElasticAgent.run

    def run_leaving_it_open_on_error(self, *args, **kwargs):
        try:
            return run(self, *args, **kwargs)
        except SignalException:  # (torch leaves it open itself)
            raise
        except Exception:
            handler = self._worker_group.spec.rdzv_handler
            handler.shutdown = lambda: False  # the call launch_agent makes on its way out: nothing closed
            raise

    SimpleElasticAgent.run = run_leaving_it_open_on_error
    SimpleElasticAgent._doeks_closing = True


def patch_rendezvous() -> None:
    """The run directory (patch_run_dir), an agent's error leaving the run open (patch_closing), then the keep-alive
    and round changes of the module's docstring."""
    patch_run_dir()
    patch_closing()
    try:
        from torch.distributed.elastic.rendezvous import etcd_rendezvous
    except ImportError:
        return
    rendezvous = etcd_rendezvous.EtcdRendezvous
    if getattr(rendezvous, "_doeks_recovery", False):
        return
    etcd_rendezvous.CONST_WORKER_KEEPALIVE_TTL = KEEPALIVE_TTL
    setup_lease_renewal, barrier = rendezvous.setup_lease_renewal, rendezvous.rendezvous_barrier

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
    rendezvous._doeks_recovery = True


def patch_worker_start(zygote) -> None:
    """torchrun's worker start (SubprocessHandler._popen) forks `python -u script.py ...` from the zygote; without
    files of its own its output goes through the agent's relays (patch_whole_lines), as a worker torchrun starts."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    from . import worker
    from . import zygote as zygote_module

    handler = subprocess_handler.SubprocessHandler
    popen, close = handler._popen, handler.close

    def start_worker(self, args, env):
        if worker.runnable(args):
            # no file of its own (no --redirects): its stdout and stderr are pipes the agent relays, one write per line,
            # and reads for the script's own exception (_script_error), as for a worker torchrun starts itself
            relayed = self._stdout is None and self._stderr is None
            pipes = [os.pipe(), os.pipe()] if relayed else []
            try:
                process = zygote.spawn(list(args), env, self._stdout and self._stdout.name,
                                       self._stderr and self._stderr.name,
                                       fds=tuple(w for _, w in pipes) if relayed else None)
            except zygote_module.ZygoteGone:
                for pair in pipes:
                    for fd in pair:
                        os.close(fd)
            else:
                for _, write in pipes:
                    os.close(write)
                if relayed:
                    _relay(process, [os.fdopen(read, "rb") for read, _ in pipes])
                return process
        return popen(self, args, env)

    def close_worker(self, death_sig=None):
        try:
            close(self, death_sig)
        except ProcessLookupError:
            if not isinstance(self.proc, zygote_module.ForkedWorker):
                raise
            # torch signals a worker's group when poll() said it runs; a forked worker is the zygote's child, reaped
            # there as it exits, its exit code reported a moment later: between the two its group is already gone
            # (torch's own children stay until torch reaps them). It has ended: close its files as torch would.
            for stream in (self._stdout, self._stderr):
                if stream:
                    stream.close()

    handler._popen = start_worker
    handler.close = close_worker


PERMANENT_EXIT = 2  # the training script's (and argparse's) exit code for an error no restart can fix
# What the agent says in its log (stderr, in order with the workers' tracebacks): a restart of the node's workers after
# a failure, once the failed workers are stopped and before the next rendezvous, and when they run again. doeks reads
# them (doeks.pod.reasons: RESTART_SAID, RESTARTED_SAID) to count restarts and to tell one attempt from the next.
RESTART_SAID = "doeks: worker group failed"
RESTARTED_SAID = "doeks: worker group restarted"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def patch_restarts() -> None:
    """torchrun's restarts of a node's workers, said in its log and bounded by what can help.

    torch logs a restart at INFO, which torchrun's logging does not print: a restart left no line, so nobody could
    count them or tell which attempt a traceback belonged to. Here the agent says it on stderr after the failed workers
    are stopped (every line of theirs is before it) and before the next rendezvous, then again when the workers run.
    A worker that exits 2 (the training script's code for a permanent error: bad arguments, as argparse exits, missing
    data, an unusable checkpoint) is not restarted: running the same thing again cannot succeed, so the node fails at
    once."""
    try:
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    except ImportError:
        return
    if getattr(SimpleElasticAgent, "_doeks_restarts", False):
        return
    monitor, initialize = LocalElasticAgent._monitor_workers, SimpleElasticAgent._initialize_workers

    def monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        if result.is_failed():
            end_orphans(result.failures.values())
            codes = sorted({f.exitcode for f in result.failures.values()})
            raised = _script_error() if PERMANENT_EXIT not in codes else None
            if PERMANENT_EXIT in codes or raised:
                if self._remaining_restarts:
                    _say(f"doeks: a worker exited with {PERMANENT_EXIT} (permanent error): not restarting the workers"
                         if raised is None else f"doeks: {raised}: the same code raises it again, not restarting the "
                                                 f"workers")
                self._remaining_restarts = 0
                _ENDED_FOR_GOOD.set()
            elif self._remaining_restarts > 0:
                self._doeks_failed = codes  # torchrun restarts the group next: said once the old workers are gone
        return result

    def initialize_workers(self, worker_group):
        failed = getattr(self, "_doeks_failed", None)
        if failed is not None:
            drain_relays()  # the stopped workers' last lines (their tracebacks) come before the restart is said
            spec = worker_group.spec
            _say(f"{RESTART_SAID} (exit codes {failed}): torchrun restarts it "
                 f"({spec.max_restarts - self._remaining_restarts} of {spec.max_restarts})")
        _SEEN.clear()  # a new attempt: what the stopped workers raised was read (drain_relays above)
        result = initialize(self, worker_group)
        if failed is not None:
            self._doeks_failed = None
            _say(RESTARTED_SAID)
        return result

    LocalElasticAgent._monitor_workers = monitor_workers
    SimpleElasticAgent._initialize_workers = initialize_workers
    SimpleElasticAgent._doeks_restarts = True


_RELAYS: list[threading.Thread] = []
_WRITE = threading.Lock()
# What the workers of this attempt raised: one reading per worker stream (doeks.pod.reasons.Tracebacks), so two
# workers' tracebacks written at once are read apart
_SEEN: list = []
# The agent stopped because no restart could help (a permanent exit code, the script's own exception)
_ENDED_FOR_GOOD = threading.Event()


def end_orphans(failures) -> None:
    """What a failed worker left in its process group (its DataLoader's worker processes), ended at once. torch
    signals the group only of a worker still running; a worker that died (the hang watchdog's SIGKILL, the kernel's
    OOM killer) left its loader's processes to notice at their next check of their parent, up to 5 s later, and until
    then they held its output pipes (the agent waited for them to read the worker's last lines: 4.1-4.5 s at every
    hang restart on doeks' cluster) and its sockets to its peers (who learnt of its end only then)."""
    for failure in failures:
        pid = getattr(failure, "pid", None)
        if isinstance(pid, int) and pid > 0:
            try:
                os.killpg(pid, signal.SIGKILL)  # its group: the worker's own (a new session, as torchrun starts it)
            except (ProcessLookupError, PermissionError):
                pass


def _script_error(wait: float = 5.0) -> str:
    """The script's own exception a failed worker of this attempt logged ("the script raised RuntimeError: ... (fit.py,
    line 60, in main)"), or "" when none did: its innermost frame is the job's code (a bug, its own `raise`, a
    checkpoint of another model), which a restart runs again to the same end. An error a library raised (a lost peer)
    or out of memory is not one: a restart may help. Waits up to `wait` seconds for the relays of the workers that have
    ended to read their last lines."""
    drain_relays(wait, ended_only=True)
    with _WRITE:
        seen = list(_SEEN)
    for reading in seen:
        found = reading.permanent()
        if found is not None:
            return found.text
    return ""


def _reader():
    """A reader of one worker stream's tracebacks for this attempt (None where doeks' reader is not staged)."""
    try:
        from .reasons import Tracebacks
    except ImportError:
        return None
    reading = Tracebacks()
    with _WRITE:
        _SEEN.append(reading)
    return reading


def drain_relays(timeout: float = 5.0, ended_only: bool = False) -> None:
    """Wait until what the workers that are gone wrote has reached the agent's output (`ended_only`: only the relays
    of workers whose process has ended, the others may run on; at most `timeout` seconds in all)."""
    import time

    deadline = time.monotonic() + timeout
    for relay in list(_RELAYS):
        process = getattr(relay, "doeks_process", None)
        if ended_only and (process is None or process.poll() is None):
            continue
        relay.join(max(0.0, deadline - time.monotonic()) if ended_only else timeout)
        if not relay.is_alive():
            _RELAYS.remove(relay)


def _worker_command(args):
    """`python -u script.py` as `python -u -m doeks.pod.worker script.py` (doeks.pod.worker: the script's process groups end
    without the hang at exit of gloo's DDP), where doeks.pod.worker is staged beside this module."""
    try:
        from .worker import command
    except ImportError:
        return args
    return command(args)


def _relay_lines(source, sink) -> None:
    reading = _reader()
    with source:
        for line in iter(source.readline, b""):
            with _WRITE:
                sink.write(line)
                sink.flush()
            if reading is not None:  # this stream's own reading: read outside the lock every relay writes under
                reading.feed(line.decode(errors="replace").rstrip("\n"))


def _relay(process, sources) -> None:
    """A thread per stream of a worker (its stdout, its stderr: pipes) that writes each line whole on the agent's own
    (one write per line) and reads it for the script's own exception; `process` (poll()) tells when it has ended."""
    for source, sink in zip(sources, (sys.stdout.buffer, sys.stderr.buffer)):
        thread = threading.Thread(target=_relay_lines, args=(source, sink), name="doeks-lines", daemon=True)
        thread.doeks_process = process
        thread.start()
        _RELAYS.append(thread)


def patch_whole_lines() -> None:
    """Each line a worker writes reaches the node's log whole. torchrun starts workers as `python -u script` (every
    write unbuffered, print's text and its newline two writes) on the agent's own stdout and stderr, so two ranks'
    lines ran together in a container's log (`cwd=/workspacehello rank=3`). Here a worker torchrun gives no file of
    its own (no --redirects) writes into pipes the agent reads line by line and writes on, one write per line."""
    import subprocess

    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
    except ImportError:
        return
    handler = subprocess_handler.SubprocessHandler
    if getattr(handler, "_doeks_lines", False):
        return
    popen = handler._popen

    def start(self, args, env):
        args = _worker_command(args)
        if self._stdout is not None or self._stderr is not None:
            return popen(self, args, env)
        process = subprocess.Popen(args=args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   start_new_session=True)
        _relay(process, [process.stdout, process.stderr])
        return process

    handler._popen = start
    handler._doeks_lines = True


# In a pod, an agent that finds its run's rendezvous closed waits this long before its container ends (see run_quietly)
CLOSED_WAIT_S = 30
# A container its supervisor restarts on failure (the kubelet, docker's on-failure policy: the job's manifest sets it,
# doeks.jobspec) waits this long before it ends after an error no restart cures (see run_quietly)
END_WAIT_ENV = "DOEKS_END_WAIT_S"


def _end_wait() -> float:
    """How long an agent that gave up for good waits before it ends: DOEKS_END_WAIT_S where the job's manifest sets it,
    else CLOSED_WAIT_S in a pod, else 0."""
    try:
        return max(0.0, float(os.environ[END_WAIT_ENV]))
    except (KeyError, ValueError):
        return _pod_wait()


def _pod_wait() -> float:
    """CLOSED_WAIT_S in a Kubernetes pod (its container restarted by the kubelet), else 0 (at once)."""
    return CLOSED_WAIT_S if os.environ.get("KUBERNETES_SERVICE_HOST") else 0


def run_quietly(entry, closed_wait_s: float | None = None, end_wait_s: float | None = None) -> int:
    """Run torchrun's main, ending in one line where torch ends in a traceback of its own: stopped by a signal (a
    delete, a scale down, the supervisor: its workers are already stopped; SignalException, ~20 lines per node at every
    delete), or out of restarts (ChildFailedError's banner, ~25 lines, after the workers' own tracebacks)."""
    import time

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

    if closed_wait_s is None:
        closed_wait_s = _pod_wait()
    if end_wait_s is None:
        end_wait_s = _end_wait()
    try:
        entry()
    except RendezvousClosedError:
        # a node of this run spent its restarts and closed the rendezvous: no node can join it again, so a restart of
        # this container cannot help. In a pod it ends only after a while: the kubelet keeps one ended container per
        # container, so this one's end removes the previous one's log, which holds the error that ended the run (a
        # missing data folder ended a run in three lives of its pods and 13 s, and no log said why any more)
        _say("doeks: RendezvousClosedError: a node of this run gave up and closed its rendezvous: nothing to rejoin"
             + (f"; this container ends in {closed_wait_s:.0f} s" if closed_wait_s else ""))
        sys.stdout.flush()
        time.sleep(closed_wait_s)
        return 1
    except RendezvousTimeoutError:
        # fewer nodes than the run's minimum joined within the rendezvous' timeout (the others' pods pending, their
        # node gone): torch's traceback (~40 lines) said only that. The run is left open (patch_closing), so this node,
        # restarted, joins it again
        _say("doeks: RendezvousTimeoutError: fewer nodes than the run's minimum joined its rendezvous in time (the "
             "others not started, or gone); the rendezvous is left open for this node's restart and the others")
        sys.stdout.flush()
        return 1
    except SignalException as stopped:
        _say(f"doeks: torchrun stopped by {stopped.sigval.name}: its workers are stopped")
        sys.stdout.flush()
        # at once: the interpreter's exit runs weakref finalizers while the rendezvous' keep-alive threads still run
        # ("Exception ignored in atexit callback ... dictionary changed size during iteration", a traceback per node)
        os._exit(128 + int(stopped.sigval))
    except ChildFailedError as failed:  # the workers' own tracebacks are above it in the log
        rank, failure = failed.get_first_failure()
        wait = end_wait_s if _ENDED_FOR_GOOD.is_set() else 0
        # an error no restart cures: a container its supervisor restarts (a pod's, docker's) stays a while, with the
        # log that says why, so that what follows the job ends it before the container is restarted into a closed
        # rendezvous (on docker that restart was counted: "Failed after 1 restarts" for the script's own error)
        _say(f"doeks: torchrun gives up: rank {rank} exited with {failure.exitcode} and no restart is left"
             + (f"; this container ends in {wait:.0f} s" if wait else ""))
        sys.stdout.flush()
        time.sleep(wait)
        return 1
    return 0


# How long the image's torchrun waits for its etcd rendezvous server before it starts (see wait_for_rendezvous)
RDZV_WAIT_S = 180


def rendezvous_server(argv: list[str]) -> tuple[str, int] | None:
    """The etcd rendezvous server (host, port) this torchrun will use, read by torchrun's own parser (its options,
    else the PET_ variables the operators set) and torch's endpoint rule (etcd's port 2379 by default), or None for any
    other backend (c10d's store is an agent's own)."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv)
    if not args.rdzv_backend.startswith("etcd") or not args.rdzv_endpoint:
        return None
    return parse_rendezvous_endpoint(args.rdzv_endpoint, 2379)


def wait_for_rendezvous(argv: list[str], limit_s: float = RDZV_WAIT_S, say=_say) -> bool:
    """Wait, at most `limit_s`, until the etcd rendezvous server's name resolves and it takes a connection; True when
    it did (at once or after a wait, said in one line), False when it did not in time (said; torchrun then fails with
    its own error) or there is no etcd server to wait for.

    A job's pods and its etcd Service and pod are made together: a worker pod can start before the Service's name
    resolves (the cluster's DNS answers "not found" until it knows the Service, and caches that answer up to 30 s) or
    before etcd listens. torchrun then ends at once (EtcdException: could not get the list of servers) and the kubelet
    restarts the container after 10 s, then 20 s: a job of the script's own exception ended "after 4 restarts" that
    were all this (seen on doeks' cluster in 2 of 12 runs). Where the name resolved before etcd was ready, torch's
    etcd client sent its first connection to the Service while nothing answered and waited 60 s (its timeout) on it:
    in 8 of 12 runs a job's first step came a minute late. Each try here is a new connection with a 2 s limit: the
    pods of 12 runs waited 5 to 15 s, and every job ended in 21 to 36 s after its deploy (68 to 87 s before)."""
    import socket
    import time

    server = rendezvous_server(argv)
    if server is None:
        return False
    started = time.monotonic()
    waited, last = False, ""
    while True:
        try:
            socket.create_connection(server, timeout=2).close()
            if waited:
                say(f"doeks: rendezvous server {server[0]}:{server[1]} answered after "
                    f"{time.monotonic() - started:.0f} s")
            return True
        except OSError as error:  # socket.gaierror (the name), refused, unreachable, timed out
            last = str(error) or type(error).__name__
        if not waited:
            say(f"doeks: waiting for the rendezvous server {server[0]}:{server[1]} ({last}), at most {limit_s:.0f} s")
            waited = True
        if time.monotonic() - started >= limit_s:
            say(f"doeks: the rendezvous server {server[0]}:{server[1]} did not answer in {limit_s:.0f} s: {last}")
            return False
        time.sleep(min(0.5, max(0.0, limit_s - (time.monotonic() - started))))


def check_torch() -> bool:
    """True where the running torch has every private name doeks' patches use (doeks.pod.torchcompat); else says why in
    one line, before anything is patched (a traceback inside a patch in every pod, otherwise)."""
    from . import torchcompat

    try:
        torchcompat.check(("agent", "rendezvous"))
    except torchcompat.TorchMismatch as error:
        _say(f"doeks: {error}")
        return False
    return True


def main() -> int:
    from torch.distributed.run import main as torchrun  # torch imported once, before the fork: the zygote shares it

    if not check_torch():
        return 2
    patch_whole_lines()  # a worker the zygote cannot start is started the usual way, its lines whole
    if os.environ.get("DOEKS_PRELOAD", "1") != "0":
        from . import zygote

        patch_worker_start(zygote.start())  # in a worker, start() runs the script and exits
    patch_rendezvous()
    patch_restarts()
    from . import watchdog

    watchdog.patch_agent()  # the hang watchdog (DOEKS_HANG_TIMEOUT > 0), around the monitor loop patch_restarts changed
    wait_for_rendezvous(sys.argv[1:])
    sys.argv[0] = "torchrun"
    return run_quietly(torchrun)


if __name__ == "__main__":
    sys.exit(main())

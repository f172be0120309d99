"""The hang watchdog: one per replica, in its torchrun agent (the training image's `doeks.pod.torchrun`, the local target's
`doeks.local.agent`), on every target that runs torchrun (local, docker, kubernetes, eks).

It knows when each of its ranks last made progress: a rank writes `<step> <time>` to DOEKS_PROGRESS_DIR/<rank>
(the built-in workload at every step and validation batch, `doeks.report()` for a user's script; at most once a
second), and from those reports the job's pace (the median step time). When the newest progress of this replica's
ranks is HANG_PACE x that pace old (at least PACE_FLOOR s), a rank that is certainly the one (stopped, or outside every
collective while a peer waits inside one) is acted on at once; anything less certain waits for HANG_TIMEOUT seconds,
when the job is stuck, and the watchdog looks for the rank that holds it:
- a rank in the stopped state (SIGSTOP, a debugger): it is the one;
- else each rank's Python stack (py-spy, when the image has it): a rank outside any collective (all_reduce, barrier,
  backward's gradient hooks...) holds the others, which wait inside one;
- else, when nothing here holds the job, a rank elsewhere does, and its own watchdog acts; if the job is still stuck
  at twice HANG_TIMEOUT, this replica's ranks are taken as the suspects (a peer's watchdog may be gone with it).
It names the rank (one `doeks: watchdog:` line), dumps its stacks (py-spy, else SIGUSR1, which the workload and
`doeks.report` register with faulthandler; a stopped process cannot run its handler), and climbs the ladder, each rung
bounded by its .env key (HANG_RESTARTS, HANG_REPLACEMENTS, HANG_MOVES, HANG_JOB_RESTARTS: how many times the rung is
tried before the next):
1. restart the process: the suspects are killed, torchrun restarts the worker group (re-rendezvous, resume from the
   checkpoint);
2. replace the pod: on Kubernetes the agent deletes its own pod (the operator makes a new one), elsewhere it exits with
   REPLACE_EXIT and the supervisor (local) or docker restarts the replica;
3. cordon the node and replace the pod elsewhere (Kubernetes, with another schedulable node);
4. restart the job from its checkpoint: on Kubernetes every pod of the job is deleted; on local the agent exits with
   JOB_EXIT and the supervisor restarts every replica.
A rung that does not apply where the job runs is passed over. The ladder's state is kept per replica next to the
checkpoints (DOEKS_CHECKPOINT_DIR/.doeks-watchdog/), so a replaced pod goes on from the rung its predecessor reached;
it starts over once the job has made progress for 10 x HANG_TIMEOUT. Every step is one line in the log, and on
Kubernetes an Event of the pod (reason DoeksWatchdog), which `status` and `history` show.

Standard library only (the API calls are urllib with the pod's service account): the training image carries it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

REPLACE_EXIT = 75  # EX_TEMPFAIL: this replica's agent asks to be replaced (rung 2 where there is no API)
JOB_EXIT = 76      # restart the whole job (rung 4, the local supervisor)
RUNGS = ("restart the process", "replace the pod", "cordon the node and replace the pod elsewhere",
         "restart the job from its checkpoint")
LIMIT_KEYS = ("DOEKS_HANG_RESTARTS", "DOEKS_HANG_REPLACEMENTS", "DOEKS_HANG_MOVES", "DOEKS_HANG_JOB_RESTARTS")
# what a rank waiting on its peers is inside (py-spy's frames): torch.distributed's collectives, DDP's reducer in
# backward, a barrier
COLLECTIVE = ("all_reduce", "allreduce", "barrier", "broadcast", "all_gather", "reduce_scatter", "all_to_all",
              "distributed_c10d", "backward", "_wait", "monitored_barrier", "recv", "send")
STARTUP_GRACE = 120.0  # a restarted group's first progress may take this long (imports, data, checkpoint) on top
CHECK_EVERY = 1.0
PACE_FLOOR = 10.0      # seconds: the pace's limit is never shorter (a checkpoint's stall, an epoch's end)
PACE_SAMPLES = 5       # step times seen before the pace is trusted (the first steps warm up)
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def say(line: str) -> None:
    print(f"doeks: watchdog: {line}", flush=True)


def process_state(pid: int) -> str:
    """One letter of /proc/<pid>/stat (R, S, D, T stopped, t traced, Z), '' when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def py_spy_dump(pid: int, timeout: float = 20) -> str:
    """py-spy's dump of a process's Python stacks (without pausing it), '' when py-spy is not there or cannot."""
    tool = shutil.which("py-spy")
    if not tool:
        return ""
    try:
        out = subprocess.run([tool, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                             timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout if out.returncode == 0 else ""


def main_thread(stack: str) -> str:
    """The main thread's frames of a py-spy dump ("Process N: ...", "Python v...", a blank line, then one "Thread N
    (state): "name"" header per thread, each followed by its frames): the block of the thread named MainThread, else
    the first thread's."""
    blocks = re.split(r"\n(?=Thread (?:0x)?[0-9A-Fa-f]+ )", "\n" + stack)[1:]
    return next((b for b in blocks if '"MainThread"' in b.split("\n", 1)[0]), blocks[0] if blocks else "")


def waits_on_peers(stack: str) -> bool:
    """The main thread's stack is inside a collective (or backward, where DDP all-reduces the gradients)."""
    return any(marker in main_thread(stack) for marker in COLLECTIVE)


# -- where the job runs: what the rungs can do there ---------------------------------------------------------------
class Platform:
    """The replica's surroundings, found from its environment (not asked of doeks' settings)."""

    def __init__(self, env=os.environ):
        self.env = env
        self.pod = env.get("SM_CURRENT_HOST", "")
        self.node = env.get("DOEKS_NODE_NAME", "")
        self.job = env.get("DOEKS_JOB_NAME", "")
        self.kubernetes = bool(env.get("KUBERNETES_SERVICE_HOST")) and (SERVICE_ACCOUNT / "token").exists()
        self.supervised = bool(env.get("DOEKS_JOB_HOME"))  # the local target's supervisor
        try:
            self.namespace = (SERVICE_ACCOUNT / "namespace").read_text().strip() if self.kubernetes else ""
        except OSError:
            self.namespace = ""

    def api(self, method: str, path: str, body: dict | None = None, content: str = "application/json") -> dict:
        import ssl
        import urllib.request

        host, port = self.env["KUBERNETES_SERVICE_HOST"], self.env.get("KUBERNETES_SERVICE_PORT", "443")
        token = (SERVICE_ACCOUNT / "token").read_text().strip()
        context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
        request = urllib.request.Request(f"https://{host}:{port}{path}", method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Authorization": f"Bearer {token}", "Content-Type": content})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                             urllib.request.HTTPSHandler(context=context))
        with opener.open(request, timeout=10) as response:
            data = response.read()
        return json.loads(data) if data else {}

    def event(self, line: str) -> None:
        """The line as an Event of this pod (what `status` and `describe` read); best effort."""
        if not (self.kubernetes and self.pod):
            return
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            self.api("POST", f"/api/v1/namespaces/{self.namespace}/events", {
                "metadata": {"generateName": f"{self.pod}.", "namespace": self.namespace},
                "involvedObject": {"kind": "Pod", "name": self.pod, "namespace": self.namespace},
                "reason": "DoeksWatchdog", "message": line[:1000], "type": "Warning", "count": 1,
                "firstTimestamp": now, "lastTimestamp": now, "source": {"component": "doeks-watchdog"}})
        except Exception as error:  # noqa: BLE001 - the log line stands
            say(f"(no Event: {type(error).__name__}: {str(error)[:120]})")

    def applies(self, rung: int) -> bool:
        if rung == 1:
            return True
        if rung == 2:
            return True  # the API, else an exit the supervisor or the container runtime restarts
        if rung == 3:
            return self.kubernetes and bool(self.node) and self._other_nodes()
        return (self.kubernetes and bool(self.job)) or self.supervised

    def _other_nodes(self) -> bool:
        try:
            nodes = self.api("GET", "/api/v1/nodes").get("items", [])
        except Exception:  # noqa: BLE001 - no permission or no API: the rung is passed over
            return False
        ready = [n for n in nodes if not n.get("spec", {}).get("unschedulable")
                 and any(c.get("type") == "Ready" and c.get("status") == "True"
                         for c in n.get("status", {}).get("conditions", []))]
        return any(n["metadata"]["name"] != self.node for n in ready)

    def delete_pod(self, name: str) -> None:
        self.api("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{name}", {"gracePeriodSeconds": 0})

    def cordon(self) -> None:
        self.api("PATCH", f"/api/v1/nodes/{self.node}", {"spec": {"unschedulable": True}},
                 content="application/merge-patch+json")

    def job_pods(self) -> list[str]:
        selector = f"training.kubeflow.org/job-name={self.job}"
        items = self.api("GET", f"/api/v1/namespaces/{self.namespace}/pods?labelSelector={selector}").get("items", [])
        return sorted(p["metadata"]["name"] for p in items)


# -- the ladder, kept next to the checkpoints ------------------------------------------------------------------------
class Ladder:
    def __init__(self, path: Path | None, run: str):
        self.path, self.run = path, run
        self.rung, self.count, self.at = 1, 0, 0.0
        try:
            saved = json.loads(path.read_text()) if path else {}
        except (OSError, ValueError):
            saved = {}
        if saved.get("run") == run:
            self.rung, self.count, self.at = int(saved["rung"]), int(saved["count"]), float(saved["at"])

    def save(self) -> None:
        if not self.path:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text(json.dumps({"run": self.run, "rung": self.rung, "count": self.count, "at": self.at}))
            os.replace(tmp, self.path)
        except OSError:
            pass

    def reset(self) -> None:
        if (self.rung, self.count) != (1, 0):
            self.rung, self.count, self.at = 1, 0, 0.0
            self.save()


class StepTimes:
    """The job's pace as this replica sees it: seconds per step from its ranks' progress files (a step's time is the
    time between two reports over the steps between them); the newest 50."""

    def __init__(self):
        self.last: dict[int, tuple[int, float]] = {}
        self.times: list[float] = []

    def new_group(self) -> None:
        self.last = {}  # a restarted group's first report follows its start, not a step

    def see(self, progress: dict[int, tuple[int, float]]) -> None:
        for rank, (step, at) in progress.items():
            before = self.last.get(rank)
            if before and step > before[0] and at > before[1]:
                self.times = (self.times + [(at - before[1]) / (step - before[0])])[-50:]
            if not before or step != before[0]:
                self.last[rank] = (step, at)

    def median(self) -> float | None:
        if len(self.times) < PACE_SAMPLES:
            return None
        ordered = sorted(self.times)
        return ordered[len(ordered) // 2]


class Watchdog:
    def __init__(self, env=os.environ):
        self.timeout = float(env.get("DOEKS_HANG_TIMEOUT") or 0)
        self.pace = float(env.get("DOEKS_HANG_PACE") or 0)
        self.steps = StepTimes()
        self.limits = [int(env.get(key) or 1) for key in LIMIT_KEYS]
        self.platform = Platform(env)
        self.replica = self.platform.pod or f"node-{env.get('DOEKS_REPLICA', '0')}"
        checkpoints = env.get("DOEKS_CHECKPOINT_DIR")
        path = Path(checkpoints) / ".doeks-watchdog" / f"{self.replica}.json" if checkpoints else None
        self.ladder = Ladder(path, env.get("DOEKS_RUN_ID", ""))
        # the ranks' progress files: in torchrun's log folder where there is one (the local target's run folder), else
        # the container's /tmp; removed when the agent exits
        parent = env.get("PET_LOG_DIR") or None
        if parent:
            os.makedirs(parent, exist_ok=True)
        self.folder = tempfile.mkdtemp(prefix="doeks-progress-", dir=parent)
        env["DOEKS_PROGRESS_DIR"] = self.folder  # the workers inherit it
        import atexit

        atexit.register(shutil.rmtree, self.folder, True)
        self.pids: tuple[int, ...] = ()
        self.group_started = time.time()
        self.checked = 0.0
        self.acted = 0.0        # when this agent last acted on a hang
        self.named = False      # the current hang was named (at named_at)
        self.named_at = 0.0
        self.gave_up = False

    @property
    def enabled(self) -> bool:
        return self.timeout > 0

    def _progress(self, ranks) -> dict[int, tuple[int, float]]:
        found = {}
        for rank in ranks:
            try:
                step, at = (Path(self.folder) / str(rank)).read_text().split()[:2]
                found[rank] = (int(step), float(at))
            except (OSError, ValueError):
                continue
        return {r: p for r, p in found.items() if p[1] >= self.group_started}

    def check(self, agent, group) -> None:
        """Called by the agent's monitor loop while its workers run."""
        now = time.time()
        if not self.enabled or now - self.checked < CHECK_EVERY:
            return
        self.checked = now
        workers = [w for w in group.workers if w.id]
        pids = tuple(sorted(w.id for w in workers))
        if pids != self.pids:  # a new worker group: its progress starts over
            self.pids, self.group_started, self.named = pids, now, False
            self.named_at = now
            for stale in Path(self.folder).iterdir():
                stale.unlink(missing_ok=True)
            self.steps.new_group()
            return
        progress = self._progress(w.global_rank for w in workers)
        self.steps.see(progress)
        newest = max((at for _, at in progress.values()), default=None)
        if newest is None:
            # nothing reported since this group started: only after an action, when the restart itself stalls
            if not self.acted or now - self.acted < self.timeout + STARTUP_GRACE:
                return
            stale, since = now - self.acted, "its restart"
        else:
            if self.ladder.at and newest - self.ladder.at > 10 * self.timeout:
                self.ladder.reset()  # healthy again for a good while: a later hang starts from the first rung
            stale, since = now - newest, f"step {max(s for s, _ in progress.values())}"
            if newest > self.named_at:  # progress since the hang was last named: a later one is named again
                self.named = False
        limit = self.limit()
        if stale < limit:
            return
        if self.acted and now - self.acted < self.timeout:
            return  # the last action is still taking effect
        suspects = self._suspects(workers, stale, since, certain_only=stale < self.timeout)
        if suspects:
            self._act(agent, suspects, stale)

    def limit(self) -> float:
        """Seconds without progress before a hang is looked for: HANG_PACE x the median step time (at least
        PACE_FLOOR) once the pace is known, never more than HANG_TIMEOUT."""
        median = self.steps.median() if self.pace > 0 else None
        if median is None:
            return self.timeout
        return min(self.timeout, max(PACE_FLOOR, self.pace * median))

    def _suspects(self, workers, stale: float, since: str, certain_only: bool = False) -> list:
        """The ranks that hold the job. Before HANG_TIMEOUT (the pace's limit passed) only a certain one counts: a
        stopped rank, or one outside every collective while another rank here waits inside one; a replica whose ranks
        are all busy elsewhere (validation, saving) may be slow, not hung."""
        found, why, stacks = [], {}, {}
        for w in workers:
            stack = py_spy_dump(w.id)  # a stopped process too: py-spy reads its memory without running it
            stacks[w.global_rank] = stack
            if process_state(w.id) in ("T", "t"):
                found.append(w)
                why[w.global_rank] = "stopped (SIGSTOP or a debugger)"
            elif stack and not waits_on_peers(stack):
                found.append(w)
                why[w.global_rank] = "outside any collective (its stack below)"
        if certain_only:
            waiting = [w for w in workers if w not in found and stacks.get(w.global_rank)]
            found = [w for w in found if process_state(w.id) in ("T", "t") or waiting]
            if not found:
                return []
        if not found and stale >= 2 * self.timeout:
            found = list(workers)
            for w in workers:
                why[w.global_rank] = "waiting, and no other replica's watchdog ended the hang"
        if not found:
            if not self.named:
                ranks = ", ".join(str(w.global_rank) for w in workers)
                say(f"replica {self.replica}: no progress for {stale:.0f} s since {since}; its ranks {ranks} wait "
                    "on a peer (held elsewhere)")
                self.named, self.named_at = True, time.time()
            return []
        for w in found:
            line = (f"hang: rank {w.global_rank} (replica {self.replica}, local rank {w.local_rank}, pid {w.id}) made "
                    f"no progress for {stale:.0f} s since {since}: {why[w.global_rank]}")
            say(line)
            self.platform.event(line)
            self._dump(w, stacks.get(w.global_rank, ""))
        self.named, self.named_at = True, time.time()
        return found

    def _dump(self, worker, stack: str) -> None:
        if stack:
            print(f"doeks: watchdog: stacks of rank {worker.global_rank} (py-spy):\n{stack.rstrip()}", flush=True)
        elif process_state(worker.id) not in ("T", "t"):
            try:  # faulthandler (the workload, doeks.report) writes them to the rank's stderr
                os.kill(worker.id, signal.SIGUSR1)
                say(f"stacks of rank {worker.global_rank}: asked with SIGUSR1 (faulthandler, in its log)")
            except ProcessLookupError:
                pass
        else:
            say(f"stacks of rank {worker.global_rank}: not dumped (a stopped process cannot run its faulthandler, and "
                "py-spy is not installed here)")

    def _act(self, agent, suspects, stale: float) -> None:
        ladder = self.ladder
        while ladder.rung <= len(RUNGS):
            if ladder.count < self.limits[ladder.rung - 1] and self.platform.applies(ladder.rung):
                break
            ladder.rung, ladder.count = ladder.rung + 1, 0
        if ladder.rung > len(RUNGS):
            if not self.gave_up:
                say("every rung tried (HANG_RESTARTS, HANG_REPLACEMENTS, HANG_MOVES, HANG_JOB_RESTARTS): giving up; "
                    "torch's own timeouts end the job")
                self.gave_up = True
            return
        ladder.count += 1
        ladder.at = time.time()
        ladder.save()
        self.acted = time.time()
        rung = ladder.rung
        line = (f"replica {self.replica}: {RUNGS[rung - 1]} (rung {rung} of {len(RUNGS)}, "
                f"{ladder.count} of {self.limits[rung - 1]})")
        say(line)
        self.platform.event(line)
        getattr(self, f"_rung{rung}")(agent, suspects)

    def _rung1(self, agent, suspects) -> None:
        for w in suspects:
            try:
                os.kill(w.id, signal.SIGKILL)  # torchrun sees the failure and restarts the worker group
            except ProcessLookupError:
                pass

    def _rung2(self, agent, suspects) -> None:
        p = self.platform
        if p.kubernetes and p.pod:
            try:
                p.delete_pod(p.pod)
                return  # the kubelet stops this pod; the operator makes a new one
            except Exception as error:  # noqa: BLE001
                say(f"cannot delete pod {p.pod} ({type(error).__name__}: {str(error)[:120]}): the container restarts")
        self._leave(agent, REPLACE_EXIT)

    def _rung3(self, agent, suspects) -> None:
        p = self.platform
        try:
            p.cordon()
            say(f"node {p.node} cordoned (`kubectl uncordon {p.node}` once it is sound)")
            p.delete_pod(p.pod)
        except Exception as error:  # noqa: BLE001
            say(f"cannot cordon {p.node} or delete {p.pod} ({type(error).__name__}: {str(error)[:120]})")
            self._leave(agent, REPLACE_EXIT)

    def _rung4(self, agent, suspects) -> None:
        p = self.platform
        if p.kubernetes and p.job:
            try:
                others = [name for name in p.job_pods() if name != p.pod]
                for name in others + [p.pod]:  # this pod last: its agent goes with it
                    p.delete_pod(name)
                return
            except Exception as error:  # noqa: BLE001
                say(f"cannot delete the job's pods ({type(error).__name__}: {str(error)[:120]})")
        self._leave(agent, JOB_EXIT)

    def _leave(self, agent, code: int) -> None:
        """Stop the workers, leave the rendezvous at once (the keep-alive key deleted: the others re-rendezvous
        without waiting for it to lapse) and exit with `code`."""
        try:
            agent._shutdown(signal.SIGKILL)
        except Exception:  # noqa: BLE001
            pass
        try:
            impl = getattr(agent._worker_group.spec.rdzv_handler, "_rdzv_impl", None)
            path, stop = getattr(impl, "_doeks_lease", (None, None))
            if path is not None:
                stop.set()
                impl.client.delete(path)
        except Exception:  # noqa: BLE001 - it lapses in 3 s anyway
            pass
        shutil.rmtree(self.folder, ignore_errors=True)
        os._exit(code)


def patch_agent() -> None:
    """torchrun's LocalElasticAgent runs the watchdog in its monitor loop (when DOEKS_HANG_TIMEOUT > 0)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    if getattr(LocalElasticAgent, "_doeks_watchdog", False):
        return
    watchdog = Watchdog()
    if not watchdog.enabled:
        return
    monitor = LocalElasticAgent._monitor_workers

    def monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        if result.state == WorkerState.HEALTHY:
            try:
                watchdog.check(self, worker_group)
            except Exception as error:  # noqa: BLE001 - the watchdog never takes the agent down
                say(f"check failed: {type(error).__name__}: {error}")
        return result

    LocalElasticAgent._monitor_workers = monitor_workers
    LocalElasticAgent._doeks_watchdog = True

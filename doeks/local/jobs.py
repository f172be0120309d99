"""The local runtime for an elastic PyTorchJob: one torchrun agent per replica ("node") on this machine.

`launch` writes the job (the PyTorchJob manifest and one command per replica) under STATE_DIR/jobs/<name>/ and
starts a supervisor process in the background. The supervisor does what Kubernetes and the training operator do for
the job's pods: starts each replica's agent with the PET_* environment, restarts a replica that died
(restartPolicy OnFailure, up to runPolicy.backoffLimit), follows `scale` requests within min:max, and stops
everything on `delete`. It is a child subreaper, so workers orphaned by a killed agent are found and stopped too.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ..pod import watchdog
from ..errors import DoeksError
from ..services import kill_group, pid_alive, reap_exited

PROJECT_ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = PROJECT_ROOT / "doeks" / "workload"
# A training step in a log: the built-in workload's own line, or the line any script prints (doeks.report, the format
# docs/your-own-script.md documents): "doeks: step=<int> [loss=<float>] [samples/s=<float>] [world=<int>] [total=<int>]"
STEP_LINE = re.compile(r"step=(?P<step>\d+) epoch=(?P<epoch>\d+) loss=(?P<loss>[\d.]+) acc=[\d.]+ samples/s=(?P<rate>[\d.]+) "
                       r"world=(?P<world>\d+)"
                       r"|doeks: step=(?P<rstep>\d+)(?: loss=(?P<rloss>[-+\w.]+))?(?: samples/s=(?P<rrate>[\d.]+))?"
                       r"(?: world=(?P<rworld>\d+))?(?: total=(?P<total>\d+))?")
LATER_STEP = re.compile(r"\[rank \d+\] (?:epoch=\d+ val_acc=.* |checkpoint |done .*|training already finished at |resumed from checkpoint )steps?=(\d+)")
PRODUCTIVE = re.compile(r"\bproductive=([\d.]+)s\b")
RESTART_DELAY = 1.0
SCAN_EVERY = 0.5
FINISH_GRACE = 30.0


def new_lines(path: Path, offsets: dict[Path, int]) -> list[str]:
    """The complete lines appended to `path` since the offset kept in `offsets` (a partial last line waits for the
    next call); advances the offset. OSError (a file not there yet) is the caller's to handle."""
    with open(path, "rb") as f:
        f.seek(offsets.get(path, 0))
        chunk = f.read()
    complete = chunk.rfind(b"\n") + 1
    offsets[path] = offsets.get(path, 0) + complete
    return chunk[:complete].decode(errors="replace").splitlines()

def job_home(state_dir: Path, name: str) -> Path:
    return state_dir / "jobs" / name


def current_run(home: Path) -> str:
    try:
        return (home / "run").read_text().strip()
    except OSError:
        return ""


def run_dir(home: Path, run: str | None = None) -> Path:
    """One folder per run (deploy): its replicas' logs and the supervisor's; the next deploy starts a new one."""
    return home / "runs" / (run or current_run(home) or "none")


def runs(home: Path) -> list[str]:
    """The runs this job home holds logs of, oldest first (run ids start with their date and time)."""
    folder = home / "runs"
    return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


def volume_map(job: dict[str, Any], volumes_dir: Path, source: Path = WORKLOAD) -> dict[str, Path]:
    """Container mount path -> local folder, from the pod's volumes and mounts; the code's folder in the image
    (doeks.code.CODE_DIR) is the job's source folder here: doeks/workload, or the user's TRAIN_SOURCE."""
    from ..code import CODE_DIR
    from ..jobspec import worker_pod

    pod = worker_pod(job)
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
    mapping = {CODE_DIR: Path(source)}
    for mount in pod["containers"][0].get("volumeMounts", []):
        if mount["name"] in claims:
            mapping[mount["mountPath"]] = volumes_dir / claims[mount["name"]]
    return mapping


def _rewrite(arg: str, mapping: dict[str, Path]) -> str:
    for prefix in sorted(mapping, key=len, reverse=True):
        if arg == prefix or arg.startswith(prefix + "/"):
            return str(mapping[prefix]) + arg[len(prefix):]
    return arg


def replica_command(job: dict[str, Any], volumes_dir: Path, rdzv_endpoint: str,
                    preload: bool = True, source: Path = WORKLOAD) -> tuple[list[str], dict[str, str]]:
    """The argv and extra environment of one replica's torchrun agent, interpreted from the PyTorchJob: paths in the
    container (the code's folder, the shared volume) become this machine's folders, in the arguments and the
    environment alike.

    `preload`: workers are forks of a process that has imported torch and torchvision (doeks.pod.zygote)."""
    from ..jobspec import pet_env, worker_pod

    container = worker_pod(job)["containers"][0]
    mapping = volume_map(job, volumes_dir, source)
    command = [_rewrite(a, mapping) for a in container["command"] + container.get("args", [])]
    if command[0] == "torchrun":
        command = [sys.executable, "-m", "doeks.local.agent", "--local-addr", "127.0.0.1"] + command[1:]
    env = {e["name"]: _rewrite(e["value"], mapping) for e in container.get("env", []) if "value" in e}
    env.pop("NCCL_DEBUG", None)
    env["SM_NUM_GPUS"] = "0"  # processes on this machine's CPU
    env.update(pet_env(job, rdzv_endpoint))
    env["OMP_NUM_THREADS"] = "1"
    env["DOEKS_PRELOAD"] = "1" if preload else "0"
    return command, env


def launch(home: Path, job: dict[str, Any], volumes_dir: Path, rdzv_endpoint: str, preload: bool = True,
           run: str = "", source: Path = WORKLOAD, extra_env: dict[str, str] | None = None) -> int:
    """Write the job and start its supervisor; returns the supervisor's pid. The agents run in `source` (the
    container's working directory, the code's folder), as the pods do."""
    import subprocess

    if is_active(home):
        raise DoeksError(f"job {job['metadata']['name']} is already running: see `invoke elasticjob.status`, or `invoke elasticjob.delete` first")
    argv, env = replica_command(job, volumes_dir, rdzv_endpoint, preload, source)
    env.update(extra_env or {})  # what the target adds on this machine (the S3 endpoint of CHECKPOINT_URI)
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    elastic = job["spec"]["elasticPolicy"]
    home.mkdir(parents=True, exist_ok=True)
    for stale in ("status.json", "desired.json", "supervisor.json"):
        (home / stale).unlink(missing_ok=True)
    spec = {"name": job["metadata"]["name"], "argv": argv, "env": env, "replicas": worker["replicas"],
            "min": elastic["minReplicas"], "max": elastic["maxReplicas"],
            "backoff_limit": job["spec"].get("runPolicy", {}).get("backoffLimit", 10), "created": time.time(),
            "max_restarts": int(elastic.get("maxRestarts", 3)),
            "run": run, "cwd": str(source), "hosts": [f"{job['metadata']['name']}-worker-{i}" for i in range(elastic["maxReplicas"])]}
    (home / "job.json").write_text(json.dumps(spec, indent=2))
    (home / "pytorchjob.json").write_text(json.dumps(job, indent=2))
    (home / "run").write_text(run)
    folder = run_dir(home, run)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "supervisor.log", "ab") as log:
        process = subprocess.Popen([sys.executable, "-m", "doeks.local.jobs", str(home)], stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                   cwd=PROJECT_ROOT, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    (home / "supervisor.json").write_text(json.dumps({"pid": process.pid}))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (home / "status.json").exists():
        if process.poll() is not None:
            raise DoeksError(f"the job supervisor exited at start; see {folder / 'supervisor.log'}")
        time.sleep(0.05)
    return process.pid


def supervisor_pid(home: Path) -> int | None:
    try:
        pid = json.loads((home / "supervisor.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None
    return pid if pid_alive(pid) else None


def is_active(home: Path) -> bool:
    return supervisor_pid(home) is not None


def read_status(home: Path) -> dict[str, Any] | None:
    try:
        return json.loads((home / "status.json").read_text())
    except (OSError, ValueError):
        return None


def request_scale(home: Path, replicas: int) -> None:
    tmp = home / ".desired.json.tmp"
    tmp.write_text(json.dumps({"replicas": replicas}))
    os.replace(tmp, home / "desired.json")


def stop(home: Path, timeout: float = 30.0) -> bool:
    """Stop the supervisor and every process it started; True if something was running."""
    pid = supervisor_pid(home)
    if pid is None:
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.1)
    if pid_alive(pid):
        kill_group(pid, grace=1)
    return True


def parse_progress(text: str) -> dict[str, Any] | None:
    """The last `step=...` line of a log text, parsed (the training script's own format); the step is the latest the
    script named after it: its validation, checkpoint, `done ... steps=N` and `training already finished at step=N`
    lines (a step line is written every --log-every steps only, so a 3-step job showed step 1 when it had ended)."""
    matches = list(STEP_LINE.finditer(text))
    progress: dict[str, Any] | None = None
    if matches:
        g = matches[-1].groupdict()
        if g["step"] is not None:
            progress = {"step": int(g["step"]), "epoch": int(g["epoch"]), "loss": float(g["loss"]),
                        "samples_per_s": float(g["rate"]), "world": int(g["world"])}
        else:  # a script's own line: what it reported, nothing made up
            progress = {"step": int(g["rstep"]), "loss": _number(g["rloss"]), "samples_per_s": _number(g["rrate"]),
                        "world": int(g["rworld"]) if g["rworld"] else None,
                        "total": int(g["total"]) if g["total"] else None}
    after = text[matches[-1].end():] if matches else text
    later = [int(n) for n in LATER_STEP.findall(after)]
    if later:
        progress = progress or {}
        progress["step"] = max(later + ([progress["step"]] if "step" in progress else []))
    if progress is not None:  # productive step time: on the step line, or the `done` line after it
        line_end = text.find("\n", matches[-1].end()) if matches else -1
        said = PRODUCTIVE.findall(text[matches[-1].start():line_end if line_end >= 0 else None] if matches else "")
        said += PRODUCTIVE.findall(after)
        if said:
            progress["productive"] = max(float(x) for x in said)
    return progress


def _number(raw: str | None) -> float | None:
    try:
        return None if raw is None else float(raw)
    except ValueError:
        return None


def last_progress(log: Path) -> dict[str, Any] | None:
    """The last `step=...` line of a replica's log file, parsed."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    return parse_progress(tail)


# -- process helpers ----------------------------------------------------------------------------------------------
def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def descendants(pid: int) -> list[int]:
    result, frontier = [], [pid]
    while frontier:
        kids = [c for p in frontier for c in children_of(p)]
        result.extend(kids)
        frontier = kids
    return result


def kill_tree(pid: int, grace: float = 5.0) -> None:
    """SIGTERM a process and all its descendants (torchrun's workers run in sessions of their own), then SIGKILL."""
    tree = [pid] + descendants(pid)
    for p in tree:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(pid_alive(p) for p in tree):
        time.sleep(0.05)
    for p in tree + descendants(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- reading what the replicas log -------------------------------------------------------------------------------
# Restarts of a node's workers by torchrun (doeks.pod.torchrun says each one), and of the node by the supervisor: the
# taxonomy's markers (doeks.pod.reasons). torch/distributed/elastic/multiprocessing/api.py (PContext wait, torch 2.13)
# logs, at ERROR, one line per failed worker group: "failed (exitcode: -9) local_rank: 0 (pid: 123) of binary: ..."
from ..pod import reasons  # noqa: E402
from ..pod.reasons import NODE_RESTART, WORKER_RESTART, WORKER_RESTARTED  # noqa: E402

GROUP_FAILED = re.compile(r"\] failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: \d+\)")
# the hang watchdog's steps (doeks.pod.watchdog.say): what `status` and `history` show; its stack dumps and notes are not
WATCHDOG_LINE = re.compile(r"^doeks: watchdog: (hang: |replica \S+: (?!no progress)|node \S+ cordoned|every rung)")


def restarting(lines: list[str]) -> bool:
    """A node's log says torchrun is restarting its workers: a restart said, and neither "restarted" nor a training
    step after it."""
    for line in reversed(lines):
        text = reasons.split_prefix(line)[2]
        if WORKER_RESTART.search(text):
            return True
        if WORKER_RESTARTED.search(text) or STEP_LINE.search(line):
            return False
    return False


class LogScanner:
    """Reads each replica's log as it grows: worker-group restarts (torchrun's own, inside a node) and whether one is
    under way, the lines since the last training step (what a transient reason is read from), and every traceback
    (`reasons.Tracebacks`: an error of the script's own code ends the job, whichever step it came at)."""

    def __init__(self, roots=()):
        self.offsets: dict[Path, int] = {}
        self.worker_restarts: dict[str, int] = {}
        self.restarting: dict[str, bool] = {}
        self.since_step: dict[str, list[str]] = {}
        self.roots = tuple(roots)
        self.tracebacks = reasons.Tracebacks()
        self.permanent = None
        self.watchdog: list[str] = []  # the hang watchdog's lines (doeks.pod.watchdog): what it named and did

    def scan(self, key: str, log: Path) -> None:
        try:
            lines = new_lines(log, self.offsets)
        except OSError:
            return
        recent = self.since_step.setdefault(key, [])
        raised = False
        for line in lines:
            if WORKER_RESTART.search(line):
                self.worker_restarts[key] = self.worker_restarts.get(key, 0) + 1
                self.restarting[key] = True
            elif WORKER_RESTARTED.search(line) or NODE_RESTART.search(line):
                self.restarting[key] = False
            if WATCHDOG_LINE.match(line) and line.split("doeks: watchdog: ", 1)[1] not in self.watchdog:
                self.watchdog.append(line.split("doeks: watchdog: ", 1)[1])
            raised = self.tracebacks.feed(f"[node-{key}] {line}") is not None or raised
            if STEP_LINE.search(line):
                self.restarting[key] = False
                recent.clear()
                continue
            recent.append(line)
            if self.permanent is None and ("error" in line or "Error" in line):
                found = reasons.from_lines(recent[-80:], self.roots)
                if found is not None and found.permanent:
                    self.permanent = found
        if raised and self.permanent is None:
            self.permanent = self.tracebacks.permanent(self.roots)
        del recent[:-400]

    def reason(self, exit_codes=(), failed: bool = False, total: int | None = None):
        """Why the job is not training: an error of the script's code, else what the lines since each replica's last
        step show (an error that training went on after is no reason), with the restarts among them (torchrun's and
        the supervisor's); `total` is the job's restarts, the number the reason says."""
        if self.permanent is not None:
            return self.permanent
        lines = [f"[node-{key}] {line}" for key in sorted(self.since_step) for line in self.since_step[key]]
        restarts = sum(1 for line in lines if WORKER_RESTART.search(reasons.split_prefix(line)[2])
                       or NODE_RESTART.search(reasons.split_prefix(line)[2]))
        return reasons.classify(lines, exit_codes, restarts=restarts, failed=failed, total=total, roots=self.roots)


def reason_record(reason) -> dict[str, Any] | None:
    if reason is None:
        return None
    return {"code": reason.code, "text": reason.text, "fix": reason.fix, "permanent": reason.permanent}


# -- the supervisor -----------------------------------------------------------------------------------------------
class Supervisor:
    """Kubernetes and the training operator for the job's "pods": start each replica's agent, restart one that failed
    (restartPolicy OnFailure, up to runPolicy.backoffLimit for the job), follow `scale` requests, end the job when a
    reason is permanent (doeks.pod.reasons) or a node has used its MAX_RESTARTS (elasticPolicy.maxRestarts: the
    node's restarts, torchrun's of its workers and the supervisor's of its agent together: each agent gets what is left
    as its --max-restarts)."""

    def __init__(self, home: Path):
        self.home = home
        self.spec = json.loads((home / "job.json").read_text())
        self.desired = self.spec["replicas"]
        self.max_restarts = int(self.spec.get("max_restarts", self.spec["env"].get("PET_MAX_RESTARTS", 3)))
        self.agents: dict[int, int] = {}  # replica -> pid
        self.replicas: dict[int, dict[str, Any]] = {}
        self.restarts_total = 0  # the supervisor's restarts of agents, for the job's backoff limit
        self.state = "Running"
        self.finished_at: float | None = None
        self.stopping = False
        self.run_dir = run_dir(home, self.spec.get("run", ""))
        self.scanner = LogScanner([self.spec["cwd"]] if self.spec.get("cwd") else [])
        self.reason = None
        self.final_reason = None  # decided by the supervisor itself (a restart limit): no later scan replaces it
        self.scanned_at = 0.0

    def _log(self, message: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)

    def node_restarts(self, index: int) -> int:
        """A node's restarts: the supervisor's of its agent after a failure, and torchrun's of its workers."""
        record = self.replicas.get(index, {})
        return record.get("restarts", 0) + self.scanner.worker_restarts.get(str(index), 0)

    def total_restarts(self) -> int:
        return sum(self.node_restarts(index) for index in self.replicas)

    def start_replica(self, index: int, restart: bool = False) -> None:
        import subprocess

        record = self.replicas.setdefault(index, {"restarts": 0, "starts": 0, "state": "Pending", "exit_code": None})
        record["restarts"] += 1 if restart else 0
        folder = self.run_dir / "replicas" / str(index)
        folder.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec["env"], "DOEKS_REPLICA": str(index), "DOEKS_JOB_HOME": str(self.home),
               "SM_CURRENT_HOST": self.spec.get("hosts", [])[index] if index < len(self.spec.get("hosts", [])) else f"node-{index}",
               # torchrun's --log-dir (its error files): unset, every node start left a /tmp/torchelastic_* folder
               # (torch/distributed/elastic/multiprocessing/api.py DefaultLogsSpecs: tempfile.mkdtemp when empty)
               "PET_LOG_DIR": str(folder / "torchelastic"),
               # what is left of the node's MAX_RESTARTS: torchrun restarts its workers at most that often
               "PET_MAX_RESTARTS": str(max(0, self.max_restarts - self.node_restarts(index)))}
        log = open(folder / "agent.log", "ab")
        log.write(f"==== doeks: replica {index} start #{record['starts']} at {time.strftime('%H:%M:%S')}\n".encode())
        log.flush()
        record["starts"] += 1
        process = subprocess.Popen(self.spec["argv"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, cwd=self.spec.get("cwd") or PROJECT_ROOT, start_new_session=True)
        log.close()
        self.agents[index] = process.pid
        record.update(state="Running", pid=process.pid, started=time.time(), exit_code=None)
        self._log(f"replica {index} started pid={process.pid}")

    def stop_replica(self, index: int, state: str) -> None:
        pid = self.agents.pop(index, None)
        if pid is not None:
            kill_tree(pid)
            reap_exited()
        self.replicas[index].update(state=state, pid=None)
        self._log(f"replica {index} {state}")

    def _kill_orphans(self) -> None:
        """Workers whose agent died are re-parented to us (subreaper): stop them, as a lost pod's processes are gone."""
        live = set(self.agents.values())
        for pid in children_of(os.getpid()):
            if pid not in live:
                kill_tree(pid, grace=0.5)

    def write_status(self) -> None:
        replicas = []
        for index in sorted(self.replicas):
            record = dict(self.replicas[index])
            record["replica"] = index
            record["progress"] = last_progress(self.run_dir / "replicas" / str(index) / "agent.log")
            record["worker_restarts"] = self.scanner.worker_restarts.get(str(index), 0)
            if record["state"] == "Running" and self.scanner.restarting.get(str(index)):
                record["state"] = "Restarting"  # torchrun restarts its workers: stopped, not yet running again
            replicas.append(record)
        status = {"name": self.spec["name"], "state": self.state, "desired": self.desired, "min": self.spec["min"],
                  "max": self.spec["max"], "restarts": self.total_restarts(), "max_restarts": self.max_restarts,
                  "node_restarts": self.restarts_total, "replicas": replicas, "run": self.spec.get("run", ""),
                  "reason": reason_record(self.reason), "watchdog": self.scanner.watchdog[-20:], "updated": time.time()}
        tmp = self.home / ".status.json.tmp"
        tmp.write_text(json.dumps(status, indent=2))
        os.replace(tmp, self.home / "status.json")

    def _scan(self) -> None:
        """Read the replicas' new log lines: a permanent reason (an error of the script's code, bad arguments, missing
        data, an import error, a closed rendezvous) fails the job now, without the restarts that cannot help;
        otherwise the reason, if the job is not training."""
        self.scanned_at = time.time()
        for index in sorted(self.replicas):
            before = self.scanner.worker_restarts.get(str(index), 0)
            self.scanner.scan(str(index), self.run_dir / "replicas" / str(index) / "agent.log")
            after = self.scanner.worker_restarts.get(str(index), 0)
            if after > before:  # an event for `describe`, as the node's own restarts are: status counts them both
                self._log(f"replica {index} workers restarted by torchrun ({after} so far)")
        codes = [r.get("exit_code") for r in self.replicas.values()]
        self.reason = self.final_reason or self.scanner.reason(codes, failed=self.state == "Failed",
                                                               total=self.total_restarts())
        if self.reason is not None and self.reason.permanent and self.state == "Running" and self.finished_at is None:
            self.state = "Failed"
            self._log(f"permanent error, no restarts: {self.reason.text}")
            for index in list(self.agents):
                self.stop_replica(index, "Failed")

    def _read_desired(self) -> None:
        try:
            wanted = json.loads((self.home / "desired.json").read_text())["replicas"]
        except (OSError, ValueError, KeyError):
            return
        if wanted != self.desired:
            self._log(f"scale {self.desired} -> {wanted}")
            self.desired = wanted

    def _failed(self, index: int, code: int, pending_restart: dict[int, float]) -> None:
        """A replica's agent exited non-zero while the job runs: restart it like a pod, unless the reason is
        permanent, its node has no restarts left, or the job's backoff limit is reached."""
        record = self.replicas[index]
        self._scan()  # what it logged before it died: a permanent error fails the job, no restart
        if self.state == "Failed":
            record["state"] = "Failed"
            return
        used = self.node_restarts(index)
        if used >= self.max_restarts:
            record["state"] = "Failed"
            self.state = "Failed"
            last = reasons.last_error([f"[node-{index}] {line}" for line in self.scanner.since_step.get(str(index), [])],
                                      self.scanner.roots) or self.scanner.tracebacks.last(self.scanner.roots)
            cause = self.scanner.reason([code], failed=True, total=self.total_restarts())
            # a known cause (the rendezvous server gone, out of memory) is the reason, with its own fix; else the limit
            self.final_reason = self.reason = cause if cause is not None and cause.code not in reasons.GENERIC else \
                reasons.restart_limit(f"node-{index}", used, self.max_restarts, last)
            self._log(f"replica {index} failed (exit {code}): {self.reason.text}")
            return
        self.restarts_total += 1
        if self.restarts_total > self.spec["backoff_limit"]:
            record["state"] = "Failed"
            self.state = "Failed"
            self._log(f"replica {index} failed (exit {code}); backoff limit reached")
            return
        record["state"] = "Restarting"
        pending_restart[index] = time.time() + RESTART_DELAY
        self._log(f"replica {index} exited with {code}: restarting like a pod (OnFailure)")

    def run(self) -> int:
        try:  # PR_SET_CHILD_SUBREAPER
            ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
        except (OSError, AttributeError):
            pass
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        for index in range(self.desired):
            self.start_replica(index)
        self.write_status()
        pending_restart: dict[int, float] = {}
        while True:
            if self.stopping:
                for index in list(self.agents):
                    self.stop_replica(index, "Stopped")
                self.state = "Stopped" if self.state == "Running" else self.state
                break
            self._read_desired()
            for pid, code in reap_exited():
                index = next((i for i, p in self.agents.items() if p == pid), None)
                if index is None:
                    continue
                del self.agents[index]
                record = self.replicas[index]
                record.update(exit_code=code, pid=None, ended=time.time())
                if code == 0:
                    record["state"] = "Succeeded"
                    self.finished_at = self.finished_at or time.time()
                    self._log(f"replica {index} succeeded")
                elif code == watchdog.JOB_EXIT and index < self.desired and self.finished_at is None:
                    # its hang watchdog's last rung but one: the whole job again, from its checkpoint
                    self.restarts_total += 1
                    self._log(f"replica {index} exited {code}: its watchdog restarts the job from its checkpoint")
                    for other in list(self.agents):
                        self.stop_replica(other, "Restarting")
                    for other in range(self.desired):
                        self.replicas.setdefault(other, {"restarts": -1})["state"] = "Restarting"
                        pending_restart[other] = time.time() + RESTART_DELAY
                elif index < self.desired and self.finished_at is None:
                    self._failed(index, code, pending_restart)
                else:
                    record["state"] = "Failed" if code else "Stopped"
            self._kill_orphans()
            if time.time() - self.scanned_at > SCAN_EVERY or self.state == "Failed":
                self._scan()
            if self.state == "Failed":
                for index in list(self.agents):
                    self.stop_replica(index, "Stopped")
                break
            if self.finished_at is None:
                for index in range(self.desired):  # scale up / restart lost replicas
                    if index not in self.agents and self.replicas.get(index, {}).get("state") != "Succeeded":
                        due = pending_restart.get(index)
                        if due is None or time.time() >= due:
                            pending_restart.pop(index, None)
                            self.start_replica(index, restart=due is not None)
                for index in [i for i in self.agents if i >= self.desired]:  # scale down
                    self.stop_replica(index, "Removed")
            elif not self.agents or time.time() - self.finished_at > FINISH_GRACE:
                for index in list(self.agents):
                    self.stop_replica(index, "Stopped")
                self.state = "Succeeded"
                break
            self.write_status()
            time.sleep(0.1)
        self._kill_orphans()
        self._scan()
        self.write_status()
        self._log(f"job {self.state}" + (f": {self.reason.text}" if self.reason and self.state == "Failed" else ""))
        return 0 if self.state in ("Succeeded", "Stopped") else 1


if __name__ == "__main__":
    sys.exit(Supervisor(Path(sys.argv[1])).run())

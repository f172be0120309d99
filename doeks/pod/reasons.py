"""Why a job is not training, and what to do about it: an error taxonomy that decides behaviour.

Each rule reads what every target has (log lines, exit codes, Kubernetes events or docker states) and names one
`Reason`: a short text, the fix, and whether it is *permanent* (running the same thing again cannot succeed: bad
arguments, missing data or file, an import error) or *transient* (a restart may help: the rendezvous server was
unreachable, out of memory, a crash loop). Permanent errors end the job at once, without restarts: the local
supervisor stops every node when a log shows one, the follow loop cancels a job on the other targets, and bad
training arguments are refused before anything starts (doeks.targets.base.check_train_args).

The split follows kopf's `PermanentError` / `TemporaryError` (nolar/kopf, kopf/_core/actions/execution.py, main 07cab46):
a handler's error is either retried after a delay or ends the handling for good, decided by its type, not by how
often it happened.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

# Kubernetes' own words (kubernetes/kubernetes, v1.33): "CrashLoopBackOff" pkg/kubelet/container/sync_result.go,
# "ImagePullBackOff"/"ErrImagePull" pkg/kubelet/images/types.go, event reason "BackOff" pkg/kubelet/events/event.go;
# "OOMKilled" is the container runtime's terminated reason (containerd's CRI plugin).
CRASH_LOOP_RESTARTS = 3
OOM_EXIT = 137  # SIGKILL, what the kernel's OOM killer sends (128 + 9)
OOM_FIX = "lower BATCH_SIZE or DATA_WORKERS, or use a larger instance type"
IMAGE_FIX = "`invoke elasticjob.push`, or set TRAIN_IMAGE to an image the nodes can pull"
# JobSet's event when the API server refuses a Job it makes from the TrainJob's pod template (sigs.k8s.io/jobset
# pkg/constants JobCreationFailedReason; the event's message is the API server's refusal). Permanent: the same
# template is refused again.
JOB_CREATION_FAILED = "JobCreationFailed"
# torch.nn.Module.load_state_dict's message when a state dict has other keys or shapes (torch/nn/modules/module.py)
STATE_DICT_MISFIT = "Error(s) in loading state_dict"
CHECKPOINTS = "{checkpoints}"  # the job's checkpoint folder: the target fills it in where it shows the fix
CHECKPOINT_FIX = (f"{CHECKPOINTS} holds a checkpoint of another model: `invoke elasticjob.deploy --fresh` starts "
                  "over (or move that folder away, or give this job its own --job-name)")
IMPORT_FIX = ("the training image lacks a module: add it to TRAIN_REQUIREMENTS (or elasticjob/Dockerfile) and "
              "`invoke elasticjob.build`")
MISSING_FIX = "check the paths in --train-args and the shared volume (SHARED_PVC, SHARED_MOUNT)"
REFUSED_FIX = ("the TrainJob's pod template is invalid (doeks.trainjob: its runtimePatches); `kubectl describe jobset "
               "<name>` shows the refusal")


@dataclass(frozen=True)
class Reason:
    code: str          # bad-arguments, data-missing, missing-file, import-error, rendezvous, oom, crash-loop, failed
    text: str          # one line: what happened
    fix: str           # one line: what to do
    permanent: bool    # True: a restart cannot help; end the job now

    def line(self) -> str:
        return f"{self.text} (fix: {self.fix})"


# (code, permanent, pattern, text template, fix); the first rule that matches a line wins, in this order.
# The argparse form is "<prog>: error: <message>" (cpython Lib/argparse.py ArgumentParser.error, 3.12).
_LINE_RULES = [
    ("bad-arguments", True, re.compile(r"(?:^|[\s\]/])[\w.-]+\.py: error: (?P<m>.+)"),
     "bad arguments to the training script: {m}", "fix --train-args or TRAIN_ARGS (the script's --help lists them; "
     "the built-in one's: `python doeks/workload/train.py --help`)"),
    ("data-missing", True, re.compile(r"error: (?P<m>data folder \S+ is missing or empty)"),
     "data missing: {m}", "make or stage the data: `invoke elasticjob.data` here, `invoke csi.data.stage` on a cluster"),
    ("data-missing", True, re.compile(r"error: (?P<m>\S+ holds files, not class folders)"),
     "data laid out wrong: {m}", "`invoke csi.data.stage --relayout-val`"),
    ("bad-checkpoint", True, re.compile(r"error: (?P<m>checkpoint .+)"),
     "unusable checkpoint: {m}", "move the checkpoint folder away or deploy with --fresh"),
    ("import-error", True, re.compile(r"(?P<m>(ModuleNotFoundError|ImportError): .+)"), "import error: {m}", IMPORT_FIX),
    ("missing-file", True, re.compile(r"(?P<m>FileNotFoundError: .+|can't open file .+No such file or directory.*)"),
     "missing file: {m}", MISSING_FIX),
    ("oom", False, re.compile(r"(?P<m>(torch\.)?(cuda\.)?OutOfMemoryError.*|CUDA out of memory.*|CUDA error: out of memory.*|Cannot allocate memory.*)"),
     "out of memory: {m}", OOM_FIX),
    # torch.distributed.elastic.rendezvous.etcd_rendezvous / python-etcd when the etcd server is gone
    # (python-etcd 0.4.5 etcd/client.py: "No more machines in the cluster", "Could not get the list of servers")
    ("rendezvous", False, re.compile(r"(?P<m>.*(EtcdConnectionFailed|RendezvousConnectionError|Could not get the list of "
                                     r"servers|/v2/(keys|machines).*(Connection refused|Failed to establish)).*)"),
     "rendezvous server unreachable", "etcd is down: `invoke eks.create` restarts the local one (TARGET=local/docker); "
     "on a cluster the job's etcd Deployment and Service <JOB_NAME>-etcd (`kubectl get deployment,pods -l app=etcd`): "
     "the workers rejoin once it answers"),
]

# torch's etcd rendezvous after a node gave up (its restarts spent) and closed the run's rendezvous: no node of this run
# can join again (torch/distributed/elastic/rendezvous/etcd_rendezvous.py init_phase, RendezvousClosedError), so a
# restart cannot help. The first error (the one that spent the restarts) is the reason; this only ends the job.
RENDEZVOUS_CLOSED = re.compile(r"RendezvousClosedError")

# Kubernetes event / container waiting reasons
_EVENT_RULES = {
    "OOMKilled": ("oom", False, "out of memory: a container was OOM-killed", OOM_FIX),
    "ErrImagePull": ("image", False, "the training image cannot be pulled", IMAGE_FIX),
    "ImagePullBackOff": ("image", False, "the training image cannot be pulled", IMAGE_FIX),
    "FailedScheduling": ("unschedulable", False, "pods cannot be scheduled", "check node capacity: `invoke eks.status`, `invoke eks.scale`"),
    "FailedMount": ("volume", False, "the shared volume cannot be mounted", "`invoke csi.fsx.deploy` (or csi.efs.deploy) and check SHARED_PVC"),
}


LOGS_FIX = "`invoke elasticjob.logs --errors` shows its traceback"
# What doeks' torchrun (doeks.pod.torchrun, in the image and on the local agent) says when it restarts a node's workers, and
# when they run again; torch's own INFO line for the first, where its logging shows INFO; the local supervisor's line
# when it starts a node again (doeks.local.jobs). Each restart starts a new attempt: a traceback after it is a new one.
WORKER_RESTART = re.compile(r"Worker group (FAILED|UNHEALTHY)\. \d+/\d+ attempts left|^doeks: worker group failed ")
WORKER_RESTARTED = re.compile(r"^doeks: worker group restarted")
NODE_RESTART = re.compile(r"^==== doeks: replica \d+ start #[1-9]")
# "[node-0] " (a target's log prefix: a replica, a pod, a SageMaker host), then torch's "[rank3]: " (its excepthook
# prefixes every line of a worker's traceback with the worker's rank, torch/distributed/distributed_c10d.py)
_PREFIX = re.compile(r"^(?:\[(?P<outer>[^\]]+)\] )?(?:\[(?P<rank>rank\d+)\]: ?)?")
_TRACEBACK = "Traceback (most recent call last):"
_FRAME_LINE = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+)(?:, in (?P<func>.+))?$')
_EXCEPTION_LINE = re.compile(r"^(?P<kind>[A-Za-z_][\w.]*)(?::\s?(?P<message>.*))?$")
# how a process was stopped, not what went wrong in it
_NOT_ERRORS = {"KeyboardInterrupt", "SystemExit", "GeneratorExit",
               "torch.distributed.elastic.multiprocessing.api.SignalException"}
_DOEKS = str(Path(__file__).resolve().parents[1]) + "/"
CODE_ROOTS = ("/workspace/", "/opt/ml/code/")  # where the job's code is in the image and in SageMaker's container


def split_prefix(line: str) -> tuple[str, str, str]:
    """(the target's prefix, torch's rank prefix, the text) of a log line."""
    match = _PREFIX.match(line)
    return match.group("outer") or "", match.group("rank") or "", line[match.end():]


def user_code(path: str) -> bool:
    """A frame of the job's own code: not the interpreter's (frozen modules, the standard library), an installed
    package's, or doeks' own runtime (its agent, zygote and torchrun: doeks/workload, the built-in script, is a job's
    code like any other)."""
    if path.startswith("<") or "/site-packages/" in path or "/dist-packages/" in path or path.startswith("/opt/doeks-stage/"):
        return False
    if re.search(r"/lib/python\d[\d.]*/", path):
        return False
    return not (path.startswith(_DOEKS) and not path.startswith(_DOEKS + "workload/"))


@dataclass(frozen=True)
class Raised:
    """An exception a traceback in a log ended with: its type and message, its frames, which stream wrote it (the
    target's prefix and torch's rank) and in which attempt (restarts seen before it in that stream)."""

    kind: str
    message: str
    frames: tuple[tuple[str, int, str], ...]   # (path, line, function), outermost first
    stream: str = ""
    attempt: int = 0
    lines: tuple[str, ...] = ()                # the traceback as logged, prefixes and all

    @property
    def frame(self) -> tuple[str, int, str] | None:
        """The innermost frame in the job's own code."""
        return next((f for f in reversed(self.frames) if user_code(f[0])), None)

    @property
    def by_script(self) -> bool:
        """The job's code raised it (its innermost frame is the script's), rather than a library it called."""
        return bool(self.frames) and user_code(self.frames[-1][0])

    @property
    def out_of_memory(self) -> bool:
        """Memory ran out (MemoryError, torch's OutOfMemoryError, ENOMEM): a smaller batch or a larger node cures it,
        not a change of the script, so the line rule's transient "out of memory" stands, wherever it was raised."""
        return self.kind.rsplit(".", 1)[-1] in ("MemoryError", "OutOfMemoryError") or \
            "Cannot allocate memory" in self.message or "out of memory" in self.message

    @property
    def identity(self) -> tuple:
        return (self.kind, self.message, self.frame)

    def where(self, roots: Iterable[str] = ()) -> str:
        """`fit.py, line 57, in main`: the file (relative to the code's folder) and line in the job's code."""
        if self.frame is None:
            return ""
        path, line, function = self.frame
        for root in sorted([*CODE_ROOTS, *(str(r).rstrip("/") + "/" for r in roots)], key=len, reverse=True):
            if path.startswith(root):
                path = path[len(root):]
                break
        return f"{path}, line {line}" + (f", in {function}" if function else "")

    def said(self, roots: Iterable[str] = ()) -> str:
        text = f"{self.kind}: {self.message}" if self.message else self.kind
        where = self.where(roots)
        return f"{text[:200]} ({where})" if where else text[:200]


class Tracebacks:
    """Python tracebacks in log lines as they come, several streams interleaved (replicas, ranks): each exception a
    traceback ended with, in order, with the attempt it belongs to. Restarts (`WORKER_RESTART`, `NODE_RESTART`) start
    a new attempt of their stream."""

    def __init__(self):
        self.raised: list[Raised] = []
        self._open: dict[tuple[str, str], list] = {}
        self._attempts: dict[str, int] = {}

    def feed(self, line: str) -> Raised | None:
        outer, rank, text = split_prefix(line)
        if WORKER_RESTART.search(text) or NODE_RESTART.search(text):
            self._attempts[outer] = self._attempts.get(outer, 0) + 1
            return None
        key = (outer, rank)
        if text.startswith(_TRACEBACK):
            self._open[key] = [[], [line]]
            return None
        if key not in self._open:
            return None
        frames, logged = self._open[key]
        logged.append(line)
        frame = _FRAME_LINE.match(text)
        if frame:
            frames.append((frame.group("path"), int(frame.group("line")), frame.group("func") or ""))
            return None
        if not text.strip() or text[0].isspace():  # the code of a frame, its carets
            return None
        del self._open[key]
        match = _EXCEPTION_LINE.match(text)
        if match is None or not frames or match.group("kind") in _NOT_ERRORS:
            return None
        raised = Raised(match.group("kind"), (match.group("message") or "").strip(), tuple(frames),
                        f"{outer}/{rank}".strip("/"), self._attempts.get(outer, 0), tuple(logged))
        self.raised.append(raised)
        return raised

    def of_script(self) -> list[Raised]:
        """The exceptions that went through the job's own code (raised by it, or by a library it called)."""
        return [r for r in self.raised if r.frame is not None]

    def permanent(self, roots: Iterable[str] = ()) -> Reason | None:
        """A script error no restart can cure: the first exception the job's own code raised (a bug, a bad value,
        its own `raise`: the same code raises it again), a checkpoint that does not fit the model, or one a library
        raised in a call from the job's code that came back the same (type, message, place) after a restart of that
        stream."""
        mine = [r for r in self.of_script() if not r.out_of_memory]
        raised = next((r for r in mine if r.by_script), None)
        if raised is not None:
            return script_reason(raised, roots)
        misfit = next((r for r in mine if r.message.startswith(STATE_DICT_MISFIT)), None)
        if misfit is not None:  # torch's load_state_dict: the folder holds another model's checkpoint
            return Reason("bad-checkpoint", f"a checkpoint that does not fit the model: {misfit.said(roots)}",
                          CHECKPOINT_FIX, True)
        first: dict[tuple, dict[str, int]] = {}
        for r in mine:
            attempts = first.setdefault(r.identity, {})
            stream = r.stream.split("/", 1)[0]
            if stream in attempts and attempts[stream] != r.attempt:
                return Reason("exception", f"the script failed with {r.said(roots)}, the same after a restart",
                              f"{LOGS_FIX}; fix what it names, then `invoke elasticjob.deploy`", True)
            attempts.setdefault(stream, r.attempt)
        return None

    def last(self, roots: Iterable[str] = ()) -> str:
        """The last exception that went through the job's code, with its place there; "" when none did."""
        mine = self.of_script()
        return mine[-1].said(roots) if mine else ""


def script_reason(raised: Raised, roots: Iterable[str] = ()) -> Reason:
    """The reason an exception the job's code raised gives: its type, message, file and line; permanent."""
    said = raised.said(roots)
    if raised.kind in ("ModuleNotFoundError", "ImportError"):
        return Reason("import-error", f"import error: {said}", IMPORT_FIX, True)
    if raised.kind == "FileNotFoundError":
        return Reason("missing-file", f"missing file: {said}", MISSING_FIX, True)
    return Reason("exception", f"the script raised {said}",
                  f"{LOGS_FIX}; fix the script, then `invoke elasticjob.deploy`", True)


def tracebacks(lines: Iterable[str]) -> Tracebacks:
    found = Tracebacks()
    for line in lines:
        found.feed(line)
    return found


def from_lines(lines: Iterable[str], roots: Iterable[str] = ()) -> Reason | None:
    """The reason the log lines show: an error of the script's own code first (`Tracebacks.permanent`), then the
    first permanent line, else the last transient one."""
    transient = None
    lines = list(lines)
    script = tracebacks(lines).permanent(roots)
    if script is not None:
        return script
    for line in lines:
        for code, permanent, pattern, text, fix in _LINE_RULES:
            match = pattern.search(line)
            if match:
                found = match.groupdict().get("m", "").strip().rstrip('"').strip()[:200]
                reason = Reason(code, text.format(m=found), fix, permanent)
                if permanent:
                    return reason
                transient = reason
                break
    return transient


GENERIC = ("crash-loop", "failed")  # reasons that name no cause of their own


def restart_limit(replica: str, restarts: int, limit: int, last: str = "") -> Reason:
    """A node restarted more often than MAX_RESTARTS allows: the job ends."""
    return Reason("restart-limit", f"restart limit: {replica} restarted {restarts} times (MAX_RESTARTS={limit})"
                  + (f", last error: {last}" if last else ""),
                  f"{LOGS_FIX}; fix the cause (or raise MAX_RESTARTS), then `invoke elasticjob.deploy`", True)


def from_events(reasons: Iterable[str]) -> Reason | None:
    """The reason Kubernetes events or container states show (their `reason` fields, oldest first): a permanent one
    first, else the newest (a pod first FailedScheduling while its claim was binding, then FailedMount, is stuck on
    the mount: seen on doeks' own cluster)."""
    found = [(_EVENT_RULES[r], r) for r in reasons if r in _EVENT_RULES]
    if not found:
        return None
    permanent = [pair for pair in found if pair[0][1]]
    (code, permanent, text, fix), which = permanent[0] if permanent else found[-1]
    return Reason(code, f"{text} ({which})", fix, permanent)


def classify(lines: Iterable[str] = (), exit_codes: Iterable[int | None] = (), events: Iterable[str] = (),
             restarts: int = 0, failed: bool = False, total: int | None = None, roots: Iterable[str] = ()) -> Reason | None:
    """One reason from everything a target knows; None when nothing is wrong. Permanent beats transient; a log
    line beats an exit code; `restarts` (since the last step) without a known cause is a crash loop. `total`: the job's
    restarts as its status counts them (the number the reason says; `restarts` when not given). `roots`: the code's
    folders, for the file the script's error names."""
    lines = list(lines)
    roots = tuple(roots)
    by_line = from_lines(lines, roots)
    by_event = from_events(events)
    for reason in (by_line, by_event):
        if reason and reason.permanent:
            return reason
    if by_line or by_event:
        return by_line or by_event
    codes = [c for c in exit_codes if c is not None]
    if OOM_EXIT in codes or -9 in codes:
        return Reason("oom", "a process was killed (exit 137, SIGKILL: out of memory, or killed by hand)",
                      "if nobody killed it: " + OOM_FIX, False)
    said = total if total is not None else restarts
    if any(RENDEZVOUS_CLOSED.search(line) for line in lines):  # no node of this run can join again
        last = last_error(lines, roots)
        return Reason("rendezvous-closed", f"a node gave up after its restarts ({said} in all) and closed the run's "
                      "rendezvous" + (f", last error: {last}" if last else ""),
                      f"{LOGS_FIX}; fix the cause, then `invoke elasticjob.deploy`", True)
    if "CrashLoopBackOff" in set(events) or restarts >= CRASH_LOOP_RESTARTS:
        last = last_error(lines, roots)
        return Reason("crash-loop", f"crash loop: {said} restarts" + (f", last error: {last}" if last else ""),
                      f"{LOGS_FIX}; fix the cause, then `invoke elasticjob.deploy`", False)
    if failed:
        last = last_error(lines, roots)
        code = next((c for c in reversed(codes) if c), None)
        return Reason("failed", "failed" + (f" (exit {code})" if code is not None else "") + (f": {last}" if last else ""),
                      f"{LOGS_FIX} (`invoke elasticjob.logs --tail 50`: the end of each node's log)", False)
    return None


EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(Error|Exception|Interrupt|Exit)(: .*)?$")


def last_error(lines: list[str], roots: Iterable[str] = ()) -> str:
    """The last exception that went through the job's code, with its file and line; else the last exception a
    traceback ended with (`ValueError: ...`), else the last line that names an error; never torchrun's own summary
    around it (ChildFailedError, the `error_file:` / `traceback:` lines of its table)."""
    mine = tracebacks(lines).last(roots)
    if mine:
        return mine
    texts = [split_prefix(line)[2].strip() for line in lines]
    for text in reversed(texts):  # the script's own, before torchrun's (a closed rendezvous, a signal) that follow it
        if EXCEPTION_LINE.match(text) and not text.startswith("torch.distributed.elastic."):
            return text[:200]
    for text in reversed(texts):
        if EXCEPTION_LINE.match(text) and "ChildFailedError" not in text:
            return text[:200]
    for text in reversed(texts):
        if (re.search(r"(error|Error|Exception)\b", text) and "ChildFailedError" not in text
                and not re.match(r"(error_file|traceback|exitcode)\s*:", text)):
            return text[:200]
    return ""


def error_blocks(lines: Iterable[str]) -> list[tuple[Raised, int, list[str]]]:
    """Each distinct exception of the logs (type, message, place), in the order first seen: its first traceback as
    logged, how often it was seen, and which streams (replicas, ranks) wrote it. What `elasticjob.logs --errors`
    shows."""
    found: dict[tuple, tuple[Raised, list]] = {}
    for raised in tracebacks(lines).raised:
        key = (raised.kind, raised.message, raised.frames[-1] if raised.frames else None)
        first, streams = found.setdefault(key, (raised, []))
        streams.append(raised.stream)
    return [(first, len(streams), sorted(set(streams))) for first, streams in found.values()]

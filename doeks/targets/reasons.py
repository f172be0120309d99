"""Why a job is not training, and what to do about it: an error taxonomy that decides behaviour.

Each rule reads what every target has (log lines, exit codes, Kubernetes events or docker states) and names one
`Reason`: a short text, the fix, and whether it is *permanent* (running the same thing again cannot succeed: bad
arguments, missing data or file, an import error) or *transient* (a restart may help: the rendezvous server was
unreachable, out of memory, a crash loop). Permanent errors end the job at once, without restarts: the local
supervisor stops every node when a log shows one, the follow loop cancels a job on the other targets, and bad
training arguments are refused before anything starts (`check_train_args`, against the script's own parser).

The split follows kopf's `PermanentError` / `TemporaryError` (nolar/kopf, kopf/_core/actions/execution.py, main 07cab46):
a handler's error is either retried after a delay or ends the handling for good, decided by its type, not by how
often it happened.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
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
    ("import-error", True, re.compile(r"(?P<m>(ModuleNotFoundError|ImportError): .+)"),
     "import error: {m}", "the training image lacks a module: add it to elasticjob/Dockerfile and `invoke elasticjob.build`"),
    # an exception a script raised that running the same code again cannot cure (a bug, a bad value); others
    # (RuntimeError: NCCL, a lost peer, OSError) may pass with a restart and end in the crash-loop or failed reason
    ("exception", True, re.compile(r"^(?:\[[^\]]*\]:?\s*)?(?P<m>(?:NameError|TypeError|AttributeError|ValueError|KeyError|"
                                   r"IndexError|AssertionError|ZeroDivisionError|NotImplementedError|UnboundLocalError|"
                                   r"SyntaxError|IndentationError)(?::.*)?)$"),
     "the script raised {m}", "fix the script (`invoke elasticjob.logs --tail 50` shows the traceback), then deploy again"),
    ("missing-file", True, re.compile(r"(?P<m>FileNotFoundError: .+|can't open file .+No such file or directory.*)"),
     "missing file: {m}", "check the paths in --train-args and the shared volume (SHARED_PVC, SHARED_MOUNT)"),
    ("oom", False, re.compile(r"(?P<m>(torch\.)?(cuda\.)?OutOfMemoryError.*|CUDA out of memory.*|Cannot allocate memory.*)"),
     "out of memory: {m}", OOM_FIX),
    # torch.distributed.elastic.rendezvous.etcd_rendezvous / python-etcd when the etcd server is gone
    # (python-etcd 0.4.5 etcd/client.py: "No more machines in the cluster", "Could not get the list of servers")
    ("rendezvous", False, re.compile(r"(?P<m>.*(EtcdConnectionFailed|RendezvousConnectionError|Could not get the list of "
                                     r"servers|/v2/(keys|machines).*(Connection refused|Failed to establish)).*)"),
     "rendezvous server unreachable", "etcd is down: `invoke eks.create` restarts the local one (TARGET=local/docker); "
     "on a cluster the etcd Deployment and its Service etcd-service (`kubectl get deployment etcd`): the workers rejoin "
     "once it answers"),
]

# Kubernetes event / container waiting reasons
_EVENT_RULES = {
    "OOMKilled": ("oom", False, "out of memory: a container was OOM-killed", OOM_FIX),
    "ErrImagePull": ("image", False, "the training image cannot be pulled", IMAGE_FIX),
    "ImagePullBackOff": ("image", False, "the training image cannot be pulled", IMAGE_FIX),
    "FailedScheduling": ("unschedulable", False, "pods cannot be scheduled", "check node capacity: `invoke eks.status`, `invoke eks.scale`"),
    "FailedMount": ("volume", False, "the shared volume cannot be mounted", "`invoke csi.fsx.deploy` (or csi.efs.deploy) and check SHARED_PVC"),
}


def from_lines(lines: Iterable[str]) -> Reason | None:
    """The reason the log lines show: the first permanent one, else the last transient one."""
    transient = None
    lines = list(lines)
    for index, line in enumerate(lines):
        for code, permanent, pattern, text, fix in _LINE_RULES:
            match = pattern.search(line)
            if match and code == "exception" and not _raised_by_script(lines[max(0, index - 80):index]):
                continue  # raised inside a library (torch, etcd): not the script's bug
            if match:
                found = match.groupdict().get("m", "").strip().rstrip('"').strip()[:200]
                reason = Reason(code, text.format(m=found), fix, permanent)
                if permanent:
                    return reason
                transient = reason
                break
    return transient


_FRAME = re.compile(r'File "(?P<path>[^"]+)", line \d+')


def _raised_by_script(before: list[str]) -> bool:
    """The traceback before an exception line ends in a frame of the script's own code, not of the standard library,
    an installed package or the interpreter's frozen modules."""
    for line in reversed(before):
        frame = _FRAME.search(line)
        if frame:
            path = frame.group("path")
            return not ("site-packages" in path or "dist-packages" in path or "/lib/python" in path
                        or path.startswith("<"))
    return False


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
             restarts: int = 0, failed: bool = False) -> Reason | None:
    """One reason from everything a target knows; None when nothing is wrong. Permanent beats transient; a log
    line beats an exit code; many restarts without a known cause is a crash loop."""
    lines = list(lines)
    by_line = from_lines(lines)
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
    if "CrashLoopBackOff" in set(events) or restarts >= CRASH_LOOP_RESTARTS:
        last = last_error(lines)
        return Reason("crash-loop", f"crash loop: {restarts} restarts" + (f", last error: {last}" if last else ""),
                      "read `invoke elasticjob.logs --tail 50`; fix the cause, then `invoke elasticjob.deploy`", False)
    if failed:
        last = last_error(lines)
        code = next((c for c in reversed(codes) if c), None)
        return Reason("failed", "failed" + (f" (exit {code})" if code is not None else "") + (f": {last}" if last else ""),
                      "read `invoke elasticjob.logs --tail 50`", False)
    return None


EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(Error|Exception|Interrupt|Exit)(: .*)?$")


def last_error(lines: list[str]) -> str:
    """The last exception a traceback ended with (`ValueError: ...`), else the last line that names an error; never
    torchrun's own summary around it (ChildFailedError, the `error_file:` / `traceback:` lines of its table)."""
    texts = [(line.split("] ", 1)[-1] if line.startswith("[") else line).strip() for line in lines]
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


class TrainArgsError(Exception):
    pass


def check_train_args(train_args: list[str]) -> None:
    """Refuse arguments the training script would refuse, before anything starts: parse them with the script's own
    parser (doeks/workload/train.py is the file every target runs). Raises DoeksError with argparse's message."""
    from ..errors import DoeksError
    from ..workload import train

    if not train_args:
        return
    parser = train.build_parser()

    def refuse(message):
        raise TrainArgsError(message)

    parser.error = refuse  # argparse would print usage and exit 2
    try:
        train.parse_args(list(train_args), parser)
    except TrainArgsError as error:
        raise DoeksError(f"--train-args {' '.join(train_args)!r}: train.py: error: {error} "
                         "(`python doeks/workload/train.py --help` lists its arguments)") from None
    except SystemExit:  # --help / --version
        raise DoeksError(f"--train-args {' '.join(train_args)!r}: not a training run (--help exits)") from None

"""Following a job: log cursors (each call returns the complete lines written since the last call, prefixed with the
replica) and the wait loop with a progress bar that every target shares."""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable, Iterator

from .. import ui
from ..errors import DoeksError
from ..local.jobs import new_lines


class FileCursor:
    """New complete lines of log files matching `pattern` under `root` (replica = the file's parent folder name)."""

    def __init__(self, root: Path, pattern: str, replica: int | None = None):
        self.root, self.pattern, self.replica = root, pattern, replica
        self.offsets: dict[Path, int] = {}

    def __call__(self) -> list[str]:
        lines = []
        for log in sorted(self.root.glob(self.pattern)):
            node = log.parent.name
            if self.replica is not None and node != str(self.replica):
                continue
            lines += [f"[node-{node}] {line}" for line in new_lines(log, self.offsets)]
        return lines


class ContainerCursor:
    """New complete lines of docker containers' logs (all restarts of a container, in order), each prefixed with
    `[<prefix>]`; `containers` lists them at every call (one may be gone by the time its logs are read)."""

    def __init__(self, containers: Callable[[], list], prefix: Callable[[object], str], only: str | None = None):
        self.containers, self.prefix, self.only = containers, prefix, only
        self.offsets: dict[str, int] = {}

    def __call__(self) -> list[str]:
        lines = []
        for c in self.containers():
            prefix = self.prefix(c)
            if self.only is not None and prefix != self.only:
                continue
            try:
                data = c.logs(stdout=True, stderr=True)
            except Exception:  # noqa: BLE001 - removed meanwhile
                continue
            start, complete = self.offsets.get(c.id, 0), data.rfind(b"\n") + 1
            if complete > start:
                self.offsets[c.id] = complete
                lines += [f"[{prefix}] {line}" for line in data[start:complete].decode(errors="replace").splitlines()]
        return lines


def check_replica(target, replica: int | None) -> None:
    """`--replica N` must name a replica the job has (or had)."""
    if replica is None:
        return
    names = [r.name for r in target.describe().replicas]
    if f"node-{replica}" not in names:
        raise DoeksError(f"--replica {replica}: job {target.settings.job_name} has replicas "
                         f"{', '.join(n.removeprefix('node-') for n in names) or 'none'}")


def check_run(target, run: str | None) -> str:
    """`--run ID` must name a run whose logs the target still has; None = the current run."""
    current = target.describe().run
    if run is None or run == current:
        return current
    known = target.runs()
    if run not in known:
        raise DoeksError(f"--run {run}: job {target.settings.job_name} has logs of runs "
                         f"{', '.join(known) or 'none'} (`invoke elasticjob.history` lists them all)")
    return run


_CLOCK = re.compile(r"(?<!\d)(\d\d):(\d\d):(\d\d)(?!\d)")


def line_time(line: str, now: float | None = None) -> float | None:
    """When a log line was written, from the clock time it carries (the training script's `HH:MM:SS.mmm`, torch's
    `I1122 21:18:34`, the supervisor's), as a time.time() value within the last day; None when it has none."""
    text = line.split("] ", 1)[1] if line.startswith("[node-") and "] " in line else line
    match = _CLOCK.search(text[:60])
    if not match:
        return None
    now = time.time() if now is None else now
    local = time.localtime(now)
    hour, minute, second = (int(x) for x in match.groups())
    stamp = time.mktime((local.tm_year, local.tm_mon, local.tm_mday, hour, minute, second, 0, 0, -1))
    return stamp - 86400 if stamp > now + 60 else stamp


def window(lines: list[str], tail: int | None = None, since: float | None = None) -> list[str]:
    """`--since` (lines without a time of their own take the time of the line before) then `--tail`: the last N
    lines of each replica (its `[prefix]`), as `kubectl logs --tail` is per container on eks. The cursors list one
    replica's lines after another's, so N of all lines were the last replica's alone (node-0's failure hidden)."""
    if since is not None:
        kept, stamp = [], None
        for line in lines:
            stamp = line_time(line) or stamp
            if stamp is not None and stamp >= since:
                kept.append(line)
        lines = kept
    if tail is not None:
        kept, seen = [], {}
        for line in reversed(lines):
            replica = line.split("] ", 1)[0] if line.startswith("[") else ""
            if seen.get(replica, 0) < tail:
                seen[replica] = seen.get(replica, 0) + 1
                kept.append(line)
        lines = kept[::-1]
    return lines


def parse_since(value: str) -> float:
    """`--since 90s / 5m / 2h / 1d` -> a time.time() value."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", str(value).strip())
    if not match:
        raise DoeksError(f"--since {value!r}: expected a duration such as 30s, 5m, 2h or 1d")
    amount = float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
    return time.time() - amount


def end_if_stuck(status, clock) -> None:
    """A job none of whose replicas has trained a step, with a pod that cannot start (doeks.kube.stuck: an image it
    cannot pull, a config it cannot make, a volume it cannot mount) for `clock`'s patience: the wait ends, in one line
    with the kubelet's words and the fix (waiting does not cure it; the job is left as it is)."""
    if status.finished or any(r.step for r in status.replicas):
        return
    held = clock.over(status.stuck)
    if held:
        raise DoeksError(f"job {status.name} cannot start: {held}" + (f" (fix: {status.fix})" if status.fix else ""))


def follow_until_done(target, cursor: Callable[[], list[str]], follow: bool, poll: float = 0.5,
                      tail: int | None = None, since: float | None = None) -> Iterator[str]:
    from ..kube import StuckClock

    clock = StuckClock()
    yield from window(cursor(), tail, since)  # what is there already, cut to --tail / --since
    while True:
        status = target.describe() if follow else None
        if status is None or status.finished:
            yield from cursor()
            return
        end_if_stuck(status, clock)
        time.sleep(poll)
        yield from cursor()


def expected_steps(settings) -> int:
    images = settings.data_classes * settings.data_train_per_class
    per_epoch = max(1, images // (settings.batch_size * settings.replicas * settings.nproc_per_node))
    return per_epoch * settings.epochs


LEAVING = 60  # seconds a succeeded job's replicas are given to end before its end is said without theirs


_RANK = re.compile(r"\[rank (\d+)\] ")
_CHATTER = re.compile(r"^\[[^\]]+\] (INFO|DEBUG) ")  # torchelastic's own logging (rendezvous, stores)
_ROUTINE = ("process started", " start host=", " checkpoint step=")
_FIRST_START = re.compile(r"==== doeks: replica \d+ start #0 ")


def brief(line: str) -> bool:
    """Whether a log line is shown when following briefly (`invoke demo` without -v): the training script's own
    lines from rank 0 (steps, validation, the model), restarts, and whatever else is not torchelastic's INFO or a
    routine line (warnings and tracebacks stay); every line is still in the logs (`invoke elasticjob.logs`)."""
    if _CHATTER.match(line) or _FIRST_START.search(line):
        return False
    rank = _RANK.search(line)
    if rank:
        return rank.group(1) == "0" and not any(word in line for word in _ROUTINE)
    return True


def wait_with_progress(target, cursor: Callable[[], list[str]], timeout: float | None = None, quiet: bool = False,
                       poll: float = 0.25, stuck_s: float | None = None):
    """Stream new log lines (unless quiet; only those `target.shown_lines` keeps, where the caller set it: `brief`)
    and a progress bar of steps until the job reaches a final state."""
    from ..code import resolve

    settings = target.settings
    shown = getattr(target, "shown_lines", None) or (lambda line: True)
    # the built-in workload's steps follow from the data and the settings; a user's script says its own (total=) or
    # the bar counts steps without an end (never a made-up total)
    job = getattr(target, "submitted", None)  # the job this process submitted: its code is resolved already
    builtin = (job.code if job is not None else resolve(settings)).builtin
    total = expected_steps(settings) if builtin else None
    deadline = time.monotonic() + timeout if timeout else None
    ended = None  # when the job was first seen Succeeded with a replica still running
    from ..kube import STUCK_S, StuckClock

    clock = StuckClock(STUCK_S if stuck_s is None else stuck_s)
    with ui.progress() as bar:
        task_id = bar.add_task(f"{settings.job_name}: steps", total=total)
        while True:
            lines = cursor()
            if not quiet:
                for line in filter(shown, lines):
                    bar.console.print(line, markup=False, highlight=False)
            status = target.describe()
            steps = [r.step for r in status.replicas if r.step is not None]
            totals = [r.total for r in status.replicas if r.total]
            if not builtin and totals:
                total = max(totals)
                bar.update(task_id, total=total)
            if steps:
                bar.update(task_id, completed=min(max(steps), total) if total else max(steps))
            if status.permanent and not status.finished:
                # a restart cannot help (bad arguments, missing data, an import error): end the job now
                from ..runner import Runner

                target.end_failed(Runner(echo=False), status)
                status.state = "Failed"
            if status.state == "Succeeded" and any(r.state == "Running" for r in status.replicas):
                # an elastic job succeeds when its first replica does; the others are still leaving (their last
                # lines, their end): what is said next is the whole job's end, not the first replica's
                ended = ended or time.monotonic()
                if time.monotonic() - ended < LEAVING:
                    time.sleep(poll)
                    continue
            if status.finished:
                from .runs import settle

                settle(settings, status)
                if not quiet:
                    for line in filter(shown, cursor()):
                        bar.console.print(line, markup=False, highlight=False)
                if status.state == "Succeeded" and builtin:
                    bar.update(task_id, completed=total)
                return status
            end_if_stuck(status, clock)
            if deadline and time.monotonic() > deadline:
                raise DoeksError(f"job {settings.job_name} still running after {timeout:.0f}s")
            time.sleep(poll)

"""Following a job: log cursors (each call returns the complete lines written since the last call, prefixed with the
replica) and the wait loop with a progress bar that every target shares."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterator

from .. import ui
from ..errors import DoeksError


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
            with open(log, "rb") as f:
                f.seek(self.offsets.get(log, 0))
                chunk = f.read()
            complete = chunk.rfind(b"\n") + 1
            self.offsets[log] = self.offsets.get(log, 0) + complete
            lines += [f"[node-{node}] {line}" for line in chunk[:complete].decode(errors="replace").splitlines()]
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


def follow_until_done(target, cursor: Callable[[], list[str]], follow: bool, poll: float = 0.5) -> Iterator[str]:
    while True:
        yield from cursor()
        if not follow or target.describe().finished:
            yield from cursor()
            return
        time.sleep(poll)


def expected_steps(settings) -> int:
    images = settings.data_classes * settings.data_train_per_class
    per_epoch = max(1, images // (settings.batch_size * settings.replicas * settings.nproc_per_node))
    return per_epoch * settings.epochs


def wait_with_progress(target, cursor: Callable[[], list[str]], timeout: float | None = None, quiet: bool = False,
                       poll: float = 0.25):
    """Stream new log lines (unless quiet) and a progress bar of steps until the job reaches a final state."""
    settings = target.settings
    total = expected_steps(settings)
    deadline = time.monotonic() + timeout if timeout else None
    with ui.progress() as bar:
        task_id = bar.add_task(f"{settings.job_name}: steps", total=total)
        while True:
            lines = cursor()
            if not quiet:
                for line in lines:
                    bar.console.print(line, markup=False, highlight=False)
            status = target.describe()
            steps = [r.step for r in status.replicas if r.step is not None]
            if steps:
                bar.update(task_id, completed=min(max(steps), total))
            if status.finished:
                if not quiet:
                    for line in cursor():
                        bar.console.print(line, markup=False, highlight=False)
                if status.state == "Succeeded":
                    bar.update(task_id, completed=total)
                return status
            if deadline and time.monotonic() > deadline:
                raise DoeksError(f"job {settings.job_name} still running after {timeout:.0f}s")
            time.sleep(poll)

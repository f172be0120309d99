"""Work `invoke setup` runs in a thread beside its foreground (the Go builds, which keep both cores busy for minutes):
network waits, and builds in their own root or in a container (never the host's dpkg, which the foreground's apt may
hold). Each step's commands write to the work's log file, each with a time limit. The foreground waits for a step
where it needs it (`wait`): a line of progress every 30 s, a limit, and the step's failure as one DoeksError line
naming the step and the log. `cancel` stops what still runs when the foreground fails."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

from . import ui
from .errors import DoeksError

PROGRESS_EVERY = 30.0


class Background:
    def __init__(self, what: str, log: Path, stop_on_failure: bool = False):
        self.what = what
        self.log = log
        self.stop_on_failure = stop_on_failure  # a chain: a step that failed leaves the next without what it needs
        self.steps: list[tuple[str, Callable[[Background], str | None]]] = []
        self.done: dict[str, threading.Event] = {}
        self.failed: dict[str, str] = {}   # step -> its one line
        self.said: dict[str, str] = {}     # step -> what it did, for the foreground to say at the wait
        self.took: dict[str, float] = {}
        self._process: subprocess.Popen | None = None
        self._cancelled = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, name: str, fn: Callable[[Background], str | None]) -> None:
        self.steps.append((name, fn))
        self.done[name] = threading.Event()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Start the steps, one after another (once: later calls do nothing)."""
        if self._thread is not None or not self.steps:
            return
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as out:
            out.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} {self.what}: {', '.join(n for n, _ in self.steps)}\n")
        self._thread = threading.Thread(target=self._work, name=f"doeks-background-{self.what}", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        for name, fn in self.steps:
            if self._cancelled.is_set():
                self.failed.setdefault(name, "cancelled")
            elif self.stop_on_failure and self.failed:
                self.failed[name] = f"not run: {next(iter(self.failed))} failed"
            else:
                began = time.monotonic()
                try:
                    said = fn(self)
                    if said:
                        self.said[name] = said
                except Exception as error:  # noqa: BLE001 - said at the wait, in one line; the whole of it in the log
                    lines = str(error).strip().splitlines()
                    self.failed[name] = lines[0] if lines else type(error).__name__
                    with open(self.log, "a") as out:
                        out.write(f"==== {name} failed:\n{traceback.format_exc()}")
                self.took[name] = time.monotonic() - began
            self.done[name].set()

    def run(self, argv: list[str], timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
        """One command of a step, its output appended to the log; past `timeout` s it is stopped (its whole process
        group) and the step fails with one line."""
        if self._cancelled.is_set():
            raise DoeksError("cancelled")
        argv = [str(a) for a in argv]
        shown = shlex.join([Path(argv[0]).name] + argv[1:3])
        with open(self.log, "a") as out:
            out.write(f"$ {shlex.join(argv)}" + (f"  (in {cwd})" if cwd else "") + "\n")
            out.flush()
            try:
                process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           cwd=cwd, env=env, start_new_session=True)
            except OSError as error:
                raise DoeksError(f"could not start {argv[0]}: {error.strerror}") from None
            self._process = process
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _stop(process)
                raise DoeksError(f"'{shown}' did not end in {timeout:.0f} s") from None
            finally:
                self._process = None
        if code != 0:
            raise DoeksError(f"'{shown}' failed with exit code {code}: {last_line(self.log)}")

    def wait(self, name: str | None = None, limit: float = 1800) -> None:
        """Wait for step `name` (every step: None), at most `limit` s, saying every 30 s that it still waits; a failed
        step is one DoeksError line naming it and the log."""
        names = [name] if name is not None else [n for n, _ in self.steps]
        began = time.monotonic()
        said_at = began
        for each in names:
            event = self.done[each]
            while not event.wait(1.0):
                now = time.monotonic()
                if now - began > limit:
                    self.cancel()
                    raise DoeksError(f"{each} ({self.what}) did not finish in {limit:.0f} s: see {self.log}")
                if now - said_at >= PROGRESS_EVERY:
                    ui.say(f"  waiting for {each} ({self.what}), {now - began:.0f}s; log: {self.log}", style="dim")
                    said_at = now
            if each in self.failed:
                raise DoeksError(f"{each} ({self.what}) failed: {self.failed[each]}: see {self.log}")

    def cancel(self, grace: float = 30) -> None:
        """Stop what runs (the foreground failed or gave up): the current command's process group, then the steps
        not started yet; waits up to `grace` s for the step to clean up."""
        self._cancelled.set()
        process = self._process
        if process is not None:
            _stop(process)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(grace)


def _stop(process: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            process.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def last_line(log: Path) -> str:
    """The log's last non-empty line (what a failed command said last), cut to 300 characters."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "?"
    return (lines[-1] if lines else "no output")[:300]

"""Start a node's workers as forks of a process that has already imported torch and torchvision (a "zygote").

torchrun starts every worker as a new interpreter, which spends seconds importing torch and torchvision before its
first step, at every start and every restart (a pod that recovers pays it twice: the agent's import, then each
worker's). The agent forks a zygote right after its own `import torch` (before any thread exists); the zygote imports
the rest once and then forks one process per worker, which takes the argv, environment, new session and output files
torchrun asked for and runs the script (doeks.pod.worker.run, as `python -u -m doeks.pod.worker script.py` would). Anything
else (`--no-python`, `-m`, a wrapped command) is started by torchrun the usual way. Nothing CUDA is touched before
the fork: a worker initialises its GPU itself, as a fresh interpreter would. The local agent (doeks.local.agent) and the training image's torchrun (doeks.pod.torchrun) both use it.

If the agent dies the zygote sees its socket close, kills its workers and exits: like a pod's containers, nothing
outlives the node. Standard library only (and what it preloads) and doeks.pod.worker, so the training image carries it
with doeks.pod.worker beside it.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

from . import worker

PRELOAD = ("torchvision", "torchvision.datasets", "torchvision.models", "torchvision.transforms", "torch.nn.parallel",
           "torch.utils.data", "PIL.Image")


class ZygoteGone(RuntimeError):
    """The zygote is not there any more: start the worker the usual way."""


def _title(text: str) -> None:
    try:
        import setproctitle
    except ImportError:  # the title is cosmetic (ps shows the agent's command instead)
        return
    setproctitle.setproctitle(text)


def reap_exited() -> list[tuple[int, int]]:
    """(pid, exit code) of every child that has exited, without blocking; a signal shows as minus its number."""
    exited = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        exited.append((pid, os.waitstatus_to_exitcode(status)))
    return exited


# -- the agent's side ---------------------------------------------------------------------------------------------
class ForkedWorker:
    """What torchrun's SubprocessHandler needs of a Popen: pid, poll, wait; the zygote reports the exit code."""

    def __init__(self, zygote: "Zygote", pid: int, args: list[str]):
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self.zygote.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The agent's handle on its zygote: `spawn` a worker, and exit codes as the zygote reaps them."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid = sock, pid
        self._cond = threading.Condition()
        self._replies: dict[int, int] = {}   # request id -> worker pid
        self._exits: dict[int, int] = {}     # worker pid -> exit code
        self._workers: set[int] = set()
        self._next_id = 0
        self._gone = False
        self._reader: threading.Thread | None = None
        self._send = threading.Lock()

    def _read(self) -> None:
        stream = self.sock.makefile("rb")
        for line in stream:
            message = json.loads(line)
            with self._cond:
                if "exit" in message:
                    self._exits[message["exit"]] = message["code"]
                else:
                    self._replies[message["id"]] = message["pid"]
                self._cond.notify_all()
        with self._cond:  # EOF: the zygote died; its workers cannot be waited for any more
            self._gone = True
            for pid in self._workers - set(self._exits):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
                self._exits[pid] = -signal.SIGKILL
            self._cond.notify_all()

    def spawn(self, args: list[str], env: dict[str, str], stdout: str | None = None, stderr: str | None = None,
              fds: tuple[int, int] | None = None) -> ForkedWorker:
        """Fork a worker of `args`; its output to the files `stdout`/`stderr` (appended), or to the pipes `fds` (the
        write ends of its stdout's and its stderr's, which the caller then closes and reads), else the agent's own."""
        with self._cond:
            if self._gone:
                raise ZygoteGone("the zygote exited")
            if self._reader is None:
                self._reader = threading.Thread(target=self._read, name="doeks-zygote-reader", daemon=True)
                self._reader.start()
            self._next_id += 1
            request_id = self._next_id
        request = {"id": request_id, "args": list(args), "env": env, "cwd": os.getcwd(), "stdout": stdout, "stderr": stderr,
                   "fds": len(fds) if fds else 0}
        data = json.dumps(request).encode() + b"\n"
        try:
            with self._send:  # one request's bytes and its descriptors together
                sent = socket.send_fds(self.sock, [data], list(fds)) if fds else 0
                self.sock.sendall(data[sent:])
        except OSError as exc:
            raise ZygoteGone(f"the zygote is unreachable: {exc}") from exc
        with self._cond:
            if not self._cond.wait_for(lambda: request_id in self._replies or self._gone, timeout=60):
                raise ZygoteGone("the zygote did not answer within 60 s")
            if request_id not in self._replies:
                raise ZygoteGone("the zygote exited")
            pid = self._replies.pop(request_id)
            self._workers.add(pid)
        return ForkedWorker(self, pid, list(args))

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits, timeout=timeout)
            return self._exits.get(pid)


def start() -> Zygote:
    """Fork the zygote (call before any thread starts). Returns in the agent; in a worker it runs the script and exits."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid:
        theirs.close()
        return Zygote(ours, pid)
    ours.close()
    try:
        request = _serve(theirs)
    except BaseException:  # noqa: BLE001 - never fall back into the agent's code
        import traceback

        traceback.print_exc()
        os._exit(1)
    _become_worker(request)  # raises SystemExit (or the script's exception) like `python script.py` would
    raise AssertionError("unreachable")


# -- the zygote's side --------------------------------------------------------------------------------------------
def _serve(sock: socket.socket) -> dict[str, Any]:
    """Preload, then fork a worker per request and report exits. Returns only in a forked worker, with its request."""
    import importlib

    _title(f"doeks-zygote for agent {os.getppid()} {os.environ.get('DOEKS_JOB_HOME', '')}".rstrip())
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    children: set[int] = set()
    pending = b""
    passed: list[int] = []  # descriptors the agent sent (a request's pipes), in the order of its requests

    def send(message: dict) -> None:
        try:
            sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            pass

    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        if readable:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 16)
            passed += fds
            if not data:  # the agent is gone: so are its workers
                for pid in children:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        pass
                os._exit(0)
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                own, passed = passed[:request.get("fds", 0)], passed[request.get("fds", 0):]
                pid = os.fork()
                if pid == 0:
                    sock.close()
                    for fd in passed:  # another request's pipes: its reader must see their end when that worker ends
                        os.close(fd)
                    request["fds"] = own
                    return request
                for fd in own:
                    os.close(fd)
                children.add(pid)
                send({"id": request["id"], "pid": pid})
        for pid, code in reap_exited():
            children.discard(pid)
            send({"exit": pid, "code": code})


def _redirect(path: str | None, fd: int) -> None:
    if path:
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)


def _become_worker(request: dict[str, Any]) -> None:
    """Turn this fresh fork into `python -u script args...` as torchrun asked, then run the script."""
    import io

    os.setsid()  # torchrun starts workers in a session of their own and signals the group
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for fd, target in zip(request.get("fds") or [], (1, 2)):  # the agent's pipes, which it reads line by line
        os.dup2(fd, target)
        os.close(fd)
    _redirect(request["stdout"], 1)
    _redirect(request["stderr"], 2)
    # as `python -u`, every line out at once, but each line in one write: unbuffered, print's text and its newline are
    # two writes, and two ranks' lines ran together in the node's log
    sys.stdout, sys.stderr = (io.TextIOWrapper(io.BufferedWriter(io.FileIO(fd, "w", closefd=False)), encoding=stream.encoding,
                                               errors=stream.errors, line_buffering=True)
                              for fd, stream in ((1, sys.stdout), (2, sys.stderr)))
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # a fresh interpreter seeds numpy's global generator from the OS; forks would all share one
        numpy.random.seed()
    args = request["args"]
    _title(" ".join(args))
    worker.run(args[2], args[3:])  # the script as `python -u script args`, its process groups' end made safe

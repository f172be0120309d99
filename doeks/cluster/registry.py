"""A container registry on this machine, for the EKS rehearsal: upstream's `distribution` (the CNCF registry server)
built from the Go module proxy at a pinned version with only its filesystem storage driver
(doeks/cluster/go/registry/main.go), listening on loopback only.

The training image reaches doeks' node the way it reaches an EKS node from ECR: `docker push` to the registry, and
the node's containerd pulls it (the kubelet asks; nothing is imported). The manifests keep the ECR name
`<account>.dkr.ecr.<region>.amazonaws.com/doeks-train:<tag>`: containerd's registry host configuration
(`hosts.toml`, containerd 1.6's `config_path`) maps that host to this registry, and to nothing else, so no name is
looked up or fetched outside this machine.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from .. import ui
from ..errors import DoeksError, MissingTool
from . import build, versions

VERSION = "v3.1.2"  # the newest github.com/distribution/distribution/v3 the Go module proxy serves (2026-11)
MODULE = "github.com/distribution/distribution/v3"
SOURCE = Path(__file__).resolve().parent / "go" / "registry" / "main.go"
HOST = "127.0.0.1"


def home() -> Path:
    return versions.cache_dir() / f"registry-{VERSION}"


def binary() -> Path:
    return home() / "registry"


def state_dir() -> Path:
    """The running registry's config, log, pid and port: beside the cluster's state (one per machine)."""
    return versions.cluster_dir() / "registry"


def storage_dir() -> Path:
    """The registry's blobs and repositories: kept between clusters, as the node's images are (a cache)."""
    return versions.cache_dir() / "registry" / "storage"


def hosts_dir() -> Path:
    """containerd's registry host configuration (`config_path`): one folder per registry host with its hosts.toml."""
    return versions.cluster_dir() / "registry-hosts"


def built() -> bool:
    return binary().exists()


def build_binary(runner=None) -> Path:
    """`distribution` at VERSION as a dependency of a small module (doeks' main.go), static, into the cache."""
    out = binary()
    if out.exists():
        return out
    if runner is not None and runner.dry_run:
        runner.step(f"build the registry ({MODULE} {VERSION}, filesystem storage only) from the Go module proxy "
                    f"into {out}", lambda: None)
        return out
    where = home() / "src"
    where.mkdir(parents=True, exist_ok=True)
    shutil.copy(SOURCE, where / "main.go")
    (where / "go.mod").write_text(f"module doeks.local/registry\n\ngo 1.26.0\n\nrequire {MODULE} {VERSION}\n")
    started = time.monotonic()
    ui.say(f"building the registry ({MODULE} {VERSION}) from the Go module proxy (a few minutes on 2 cores)")
    log_path = home() / "build.log"
    with open(log_path, "a") as log:
        build._go(["mod", "tidy"], where, "registry: go mod tidy", log)
        partial = out.with_suffix(".partial")
        build._compile(["build", "-trimpath", "-ldflags=-s -w", "-o", str(partial), "."], where, "registry: go build", log)
        partial.replace(out)
    ui.say(f"  registry: built in {time.monotonic() - started:.0f}s")
    return out


def config(port: int) -> dict:
    """distribution's configuration: loopback, filesystem storage, deletes allowed (a repository deleted in the
    rehearsal's ECR goes here too), no auth (ECR's token is checked by the rehearsal's ECR API, not here)."""
    return {"version": 0.1, "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(storage_dir())}, "delete": {"enabled": True},
                        "cache": {"blobdescriptor": "inmemory"},
                        "maintenance": {"uploadpurging": {"enabled": False}}},
            "http": {"addr": f"{HOST}:{port}", "headers": {"X-Content-Type-Options": ["nosniff"]}},
            "health": {"storagedriver": {"enabled": False}}}


def _info() -> dict | None:
    try:
        info = json.loads((state_dir() / "registry.json").read_text())
        cmdline = Path(f"/proc/{info['pid']}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, KeyError):
        return None
    return info if cmdline and cmdline[0].endswith(b"registry") else None


def endpoint() -> str | None:
    """`127.0.0.1:PORT` of the running registry, or None."""
    info = _info()
    return f"{HOST}:{info['port']}" if info else None


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/v2/", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start(runner=None, timeout: float = 30) -> str:
    """Start the registry (once: a running one is kept); returns its `127.0.0.1:PORT`."""
    running = endpoint()
    if running:
        return running
    if runner is not None and runner.dry_run:
        runner.step(f"start the registry ({MODULE} {VERSION}) on {HOST}, storage {storage_dir()}", lambda: None)
        return f"{HOST}:<port>"
    if not built():
        raise MissingTool(f"the registry is not built: run `invoke setup --kubernetes` (builds {MODULE} {VERSION} once)")
    import yaml

    from ..local.services import free_port

    port = free_port()
    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    storage_dir().mkdir(parents=True, exist_ok=True)
    (folder / "config.yml").write_text(yaml.safe_dump(config(port), sort_keys=False))
    with open(folder / "registry.log", "ab") as log:
        process = subprocess.Popen([str(binary()), "serve", str(folder / "config.yml")], stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not _answers(port):
        if process.poll() is not None or time.monotonic() > deadline:
            tail = (folder / "registry.log").read_text(errors="replace").strip().splitlines()[-1:] or ["no log"]
            if process.poll() is None:
                process.kill()
            raise DoeksError(f"the registry did not answer on {HOST}:{port} within {timeout:.0f}s: {tail[0][:200]} "
                             f"(log: {folder / 'registry.log'})")
        time.sleep(0.2)
    (folder / "registry.json").write_text(json.dumps({"pid": process.pid, "port": port}))
    return f"{HOST}:{port}"


def stop() -> bool:
    """Stop the registry if it runs (its storage is kept); True if it was running. Safe twice."""
    info = _info()
    (state_dir() / "registry.json").unlink(missing_ok=True)
    if info is None:
        return False
    from ..local.services import kill_group

    kill_group(info["pid"])
    try:
        os.waitpid(info["pid"], os.WNOHANG)
    except ChildProcessError:
        pass
    return True


def hosts_toml(mirror: str) -> str:
    """containerd's host configuration for one registry name: pull and resolve from `mirror` (this machine's
    registry) and from nowhere else (the `server` is the mirror too, so no fallback to the name itself)."""
    return "\n".join([f'server = "http://{mirror}"', "", f'[host."http://{mirror}"]',
                      '  capabilities = ["pull", "resolve"]', ""])


def map_host(name: str, mirror: str | None = None) -> Path:
    """Make the node's containerd pull images named `name/...` (an ECR host) from this machine's registry; containerd
    reads the folder at each pull, so no restart is needed. Returns the hosts.toml written."""
    mirror = mirror or endpoint()
    if not mirror:
        raise DoeksError("the registry is not running: nothing to map the registry name to")
    path = hosts_dir() / name / "hosts.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(hosts_toml(mirror))
    return path


def unmap_all() -> None:
    shutil.rmtree(hosts_dir(), ignore_errors=True)


def manifest(repository: str, tag: str) -> tuple[str, str] | None:
    """(media type, manifest text) of `repository:tag` in the running registry, or None when it has no such tag."""
    mirror = endpoint()
    if not mirror:
        return None
    accept = ", ".join(["application/vnd.docker.distribution.manifest.v2+json",
                        "application/vnd.oci.image.manifest.v1+json",
                        "application/vnd.docker.distribution.manifest.list.v2+json",
                        "application/vnd.oci.image.index.v1+json"])
    request = urllib.request.Request(f"http://{mirror}/v2/{repository}/manifests/{tag}", headers={"Accept": accept})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.headers.get("Content-Type", ""), response.read().decode()
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise DoeksError(f"the registry answered {error.code} for {repository}:{tag}") from None


def delete_repository(repository: str) -> bool:
    """Remove a repository (its tags and manifest links) from the registry's storage, as deleting an ECR repository
    removes its images; the blobs stay as unreferenced data (the registry's garbage-collect removes them). True if
    it was there."""
    folder = storage_dir() / "docker" / "registry" / "v2" / "repositories" / repository
    existed = folder.exists()
    shutil.rmtree(folder, ignore_errors=True)
    return existed


def push(local_ref: str, repository: str, tag: str) -> tuple[str, str]:
    """`docker push` of a local image to this machine's registry as `repository:tag`; returns its (media type,
    manifest), as the registry serves them to the node."""
    mirror = endpoint()
    if not mirror:
        raise DoeksError("the registry is not running: `EKS_REHEARSAL=true TARGET=eks invoke up` starts it")
    if shutil.which("docker") is None:
        raise MissingTool("docker is not installed: `invoke setup --docker`")
    remote = f"{mirror}/{repository}:{tag}"
    tagged = subprocess.run(["docker", "tag", local_ref, remote], capture_output=True, text=True)
    if tagged.returncode != 0:
        raise DoeksError(f"docker tag {local_ref} {remote} failed: {(tagged.stderr.strip().splitlines() or ['?'])[-1]}")
    try:
        pushed = subprocess.run(["docker", "push", "-q", remote], capture_output=True, text=True)
    finally:
        subprocess.run(["docker", "rmi", remote], capture_output=True)  # the name only; the image stays
    if pushed.returncode != 0:
        raise DoeksError(f"docker push {remote} failed: {(pushed.stderr.strip().splitlines() or ['?'])[-1]}")
    found = manifest(repository, tag)
    if found is None:
        raise DoeksError(f"docker push {remote} returned, but the registry has no {repository}:{tag}")
    return found

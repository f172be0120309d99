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


def write_module() -> Path:
    """The folder the registry is built in: doeks' main.go and a go.mod requiring `distribution` at VERSION."""
    where = home() / "src"
    where.mkdir(parents=True, exist_ok=True)
    shutil.copy(SOURCE, where / "main.go")
    (where / "go.mod").write_text(f"module doeks.local/registry\n\ngo 1.26.0\n\nrequire {MODULE} {VERSION}\n")
    return where


def build_binary(runner=None) -> Path:
    """`distribution` at VERSION as a dependency of a small module (doeks' main.go), static, into the cache."""
    out = binary()
    if out.exists():
        return out
    if runner is not None and runner.dry_run:
        runner.step(f"build the registry ({MODULE} {VERSION}, filesystem storage only) from the Go module proxy "
                    f"into {out}", lambda: None)
        return out
    where = write_module()
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

    from ..services import free_port

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
    from ..services import kill_group

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
    removes its images; the blobs stay until a later `store` finds them named by nothing (collect_garbage). True
    if it was there."""
    folder = storage_dir() / "docker" / "registry" / "v2" / "repositories" / repository
    existed = folder.exists()
    shutil.rmtree(folder, ignore_errors=True)
    return existed


OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"  # uncompressed: the blob's digest is the layer's diff ID


def _v2() -> Path:
    return storage_dir() / "docker" / "registry" / "v2"


def _blob(digest: str) -> Path:
    algorithm, hexdigest = digest.split(":", 1)
    return _v2() / "blobs" / algorithm / hexdigest[:2] / hexdigest / "data"


def _link(path: Path, digest: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(digest)


def _docker_image(local_ref: str) -> tuple[str, list[str]]:
    """(image ID = its config's digest, its layers' diff IDs in order) of a local docker image."""
    found = subprocess.run(["docker", "image", "inspect", local_ref, "--format", "{{json .}}"], capture_output=True,
                           text=True)
    if found.returncode != 0:
        raise DoeksError(f"docker image {local_ref} not found: {(found.stderr.strip().splitlines() or ['?'])[-1]}")
    info = json.loads(found.stdout)
    return info["Id"], list(info["RootFS"]["Layers"])


def _save_blobs(local_ref: str, wanted: set[str], hash_only: dict[int, set[str]]) -> set[str]:
    """Stream `docker save local_ref` and keep each file whose digest is in `wanted` as that registry blob. A file as
    long as a blob the registry holds already (`hash_only`: size -> digests) is only hashed, not written; returns
    the digests kept plus those hashed, as found."""
    import hashlib
    import tarfile
    import tempfile

    found: set[str] = set()
    scratch = storage_dir().parent / "uploads"  # beside the storage (same file system: a rename moves a blob in)
    scratch.mkdir(parents=True, exist_ok=True)
    save = subprocess.Popen(["docker", "save", local_ref], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with tarfile.open(fileobj=save.stdout, mode="r|") as archive:
            for member in archive:
                if not member.isfile():
                    continue
                source = archive.extractfile(member)
                digest = hashlib.sha256()
                write = member.size not in hash_only
                out = tempfile.NamedTemporaryFile(dir=scratch, delete=False) if write else None
                try:
                    while chunk := source.read(1 << 20):
                        digest.update(chunk)
                        if out:
                            out.write(chunk)
                    name = f"sha256:{digest.hexdigest()}"
                    found.add(name)
                    if out:
                        out.close()
                        if name in wanted and not _blob(name).exists():
                            _blob(name).parent.mkdir(parents=True, exist_ok=True)
                            os.replace(out.name, _blob(name))
                finally:
                    if out:
                        out.close()
                        Path(out.name).unlink(missing_ok=True)
    finally:
        errors = save.stderr.read().decode(errors="replace") if save.stderr else ""
        if save.wait() != 0:
            raise DoeksError(f"docker save {local_ref} failed: {(errors.strip().splitlines() or ['?'])[-1]}")
    return found


def store(local_ref: str, repository: str, tag: str) -> tuple[str, str]:
    """Put a local docker image into this machine's registry as `repository:tag`, layers as docker keeps them
    (uncompressed, so nothing is recompressed: `docker push` gzips every layer, ~5 min for the 3.9 GB CPU training
    image here). The image's files come from `docker save`; only the blobs the registry lacks are written, in
    distribution's own storage layout (blobs by digest, the repository's layer and manifest links, the tag), with an
    OCI image manifest naming docker's config and layers unchanged (so the image ID is the same). The registry then
    serves it like any pushed image: the node's containerd pulls through it what it lacks. Returns (media type,
    manifest) as the registry serves them."""
    mirror = endpoint()
    if not mirror:
        raise DoeksError("the registry is not running: `EKS_REHEARSAL=true TARGET=eks invoke up` starts it")
    if shutil.which("docker") is None:
        raise MissingTool("docker is not installed: `invoke setup --docker`")
    config, layers = _docker_image(local_ref)
    wanted = {config, *layers}
    missing = {d for d in wanted if not _blob(d).exists()}
    if missing:
        sizes: dict[int, set[str]] = {}
        for digest in wanted - missing:  # a file as long as a blob the registry has is most likely that blob
            sizes.setdefault(_blob(digest).stat().st_size, set()).add(digest)
        found = _save_blobs(local_ref, missing, sizes)
        if {d for d in missing if not _blob(d).exists()} & found:  # hashed only (its size misled), needed after all
            _save_blobs(local_ref, missing, {})
        left = sorted(d for d in wanted if not _blob(d).exists())
        if left:
            raise DoeksError(f"docker save {local_ref} has no file for {', '.join(left)}")
    document = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                "config": {"mediaType": OCI_CONFIG, "digest": config, "size": _blob(config).stat().st_size},
                "layers": [{"mediaType": OCI_LAYER, "digest": d, "size": _blob(d).stat().st_size} for d in layers]}
    body = json.dumps(document, indent=2).encode()
    import hashlib

    digest = f"sha256:{hashlib.sha256(body).hexdigest()}"
    if not _blob(digest).exists():
        _blob(digest).parent.mkdir(parents=True, exist_ok=True)
        partial = _blob(digest).with_suffix(".partial")
        partial.write_bytes(body)
        partial.replace(_blob(digest))
    repo = _v2() / "repositories" / repository
    for blob in wanted:
        _link(repo / "_layers" / "sha256" / blob.split(":", 1)[1] / "link", blob)
    _link(repo / "_manifests" / "revisions" / "sha256" / digest.split(":", 1)[1] / "link", digest)
    _link(repo / "_manifests" / "tags" / tag / "index" / "sha256" / digest.split(":", 1)[1] / "link", digest)
    _link(repo / "_manifests" / "tags" / tag / "current" / "link", digest)
    served = manifest(repository, tag)
    if served is None or served[1].encode() != body:
        raise DoeksError(f"the registry does not serve {repository}:{tag} as it was stored")
    removed, size = collect_garbage(keep=wanted | {digest})
    if removed:
        ui.say(f"registry: removed {removed} blob(s) that no repository names and no docker image here has "
               f"({size / 1e9:.2f} GB)", style="dim")
    return served


def _named_by_repositories() -> set[str]:
    """Every digest a repository links: its layers and its manifests (distribution's `_layers` and
    `_manifests/revisions` links), and what those manifests name."""
    named: set[str] = set()
    for link in (_v2() / "repositories").glob("**/link"):
        if "/_uploads/" in link.as_posix():
            continue
        named.add(link.read_text().strip())
    for digest in list(named):
        try:
            document = json.loads(_blob(digest).read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(document, dict):
            named.update(d["digest"] for d in [document.get("config") or {}, *(document.get("layers") or []),
                                                *(document.get("manifests") or [])] if d.get("digest"))
    return named


def _docker_digests() -> set[str] | None:
    """Configs (image IDs) and layer diff IDs of every image docker has; None when docker cannot say."""
    ids = subprocess.run(["docker", "image", "ls", "-q", "--no-trunc"], capture_output=True, text=True)
    if ids.returncode != 0:
        return None
    images = sorted(set(ids.stdout.split()))
    if not images:
        return set()
    found = subprocess.run(["docker", "image", "inspect", *images], capture_output=True, text=True)
    if found.returncode != 0:
        return None
    return {d for info in json.loads(found.stdout) for d in [info["Id"], *info["RootFS"].get("Layers", [])]}


def collect_garbage(keep: set[str] = frozenset(), older_than_s: float = 600) -> tuple[int, int]:
    """Remove the blobs that no repository names, that are not in `keep`, that no docker image on this machine has
    (those are the cache: a later `store` of them writes nothing) and that were written over `older_than_s` ago (a
    push in progress links its blobs after writing them). A deleted repository's images and an old base image's
    layers otherwise stay on disk for ever (3.9 GB per training base image). Returns (blobs removed, bytes)."""
    root = _v2() / "blobs" / "sha256"
    if not root.is_dir():
        return 0, 0
    docker = _docker_digests()
    if docker is None:  # without docker's answer a cached layer could look unused: remove nothing
        return 0, 0
    used = _named_by_repositories() | set(keep) | docker
    removed = size = 0
    now = time.time()
    for data in root.glob("*/*/data"):
        digest = f"sha256:{data.parent.name}"
        try:
            stat = data.stat()
        except OSError:
            continue
        if digest in used or now - stat.st_mtime < older_than_s:
            continue
        shutil.rmtree(data.parent, ignore_errors=True)
        removed, size = removed + 1, size + stat.st_size
        try:
            data.parent.parent.rmdir()  # the two-hex-digit folder, when it is empty now
        except OSError:
            pass
    return removed, size


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

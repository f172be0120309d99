"""The operators doeks installs, made real on doeks' cluster: each built from its upstream Go module at the version
doeks pins (`go install module/cmd@version`: none of them `replace`s a module), packaged FROM scratch as a local image
named exactly as its upstream manifests name it, and deployed from the manifests in that same module (kustomize of
the module's own overlay, so the webhooks serve with the certificates their manifests arrange).
"""
from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .. import ui
from ..errors import DoeksError
from . import build, versions


@dataclass(frozen=True)
class Operator:
    name: str
    module: str
    version: str
    package: str          # the main package, relative to the module
    binary: str           # what `go install` names it
    entrypoint: str       # where the image keeps it (the manifests' command)
    overlay: str          # the module's kustomize overlay doeks applies

    @property
    def ref(self) -> str:
        return f"{self.module}@{self.version}"


TRAINING_OPERATOR = Operator("training-operator", "github.com/kubeflow/training-operator", "v1.9.4",
                             "cmd/training-operator.v1", "training-operator.v1", "/manager", "manifests/overlays/standalone")
OPERATORS = {op.name: op for op in (TRAINING_OPERATOR,)}
# The init container image the training operator v1.9.4 injects into workers of a job with a Master
# (pkg/config/config.go PyTorchInitContainerImageDefault); it waits for the master's name with nslookup.
INIT_CONTAINER_IMAGE = "alpine:3.10"


def module_dir(op: Operator) -> Path:
    result = subprocess.run([build.go(), "mod", "download", "-json", op.ref], capture_output=True, text=True,
                            env=build._env(), cwd=versions.cache_dir())
    if result.returncode != 0:
        raise DoeksError(f"go mod download {op.ref} failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return Path(json.loads(result.stdout)["Dir"])


def binary(op: Operator) -> Path:
    return versions.cache_dir() / "operators" / f"{op.name}-{op.version}" / op.binary


def build_binary(op: Operator) -> Path:
    out = binary(op)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    env = build._env()
    env["GOBIN"] = str(out.parent)
    started = time.monotonic()
    ui.say(f"building {op.name} {op.version} from the Go module proxy ({op.module}/{op.package})")
    log = versions.cache_dir() / "operators" / f"{op.name}-{op.version}.log"
    with open(log, "w") as f:
        process = subprocess.run([build.go(), "install", "-trimpath", "-ldflags=-s -w", f"{op.module}/{op.package}@{op.version}"],
                                 stdout=f, stderr=subprocess.STDOUT, env=env, cwd=versions.cache_dir())
    if process.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1:] or ["?"]
        raise DoeksError(f"building {op.name} failed ({tail[0][:300]}): see {log}")
    ui.say(f"  {op.name}: built in {time.monotonic() - started:.0f}s")
    return out


def manifests_text(op: Operator) -> str:
    from ..kube import kubectl

    folder = module_dir(op) / op.overlay
    result = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True)
    if result.returncode != 0:
        raise DoeksError(f"kustomize of {op.name}'s {op.overlay} failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return result.stdout


def images_named(text: str) -> list[str]:
    """The container images the manifests' Deployments name."""
    import yaml

    found = []
    for doc in yaml.safe_load_all(text):
        if doc and doc.get("kind") == "Deployment":
            for c in doc["spec"]["template"]["spec"].get("containers", []):
                if c["image"] not in found:
                    found.append(c["image"])
    return found


def image(op: Operator) -> str:
    named = images_named(manifests_text(op))
    if len(named) != 1:
        raise DoeksError(f"{op.name}'s manifests name {len(named)} images ({', '.join(named)}): expected one")
    return named[0]


def ensure_images(op: Operator, runner) -> list[str]:
    """The operator's image (and any image it injects) built and imported into the node; returns their names."""
    from . import images

    ref = image(op)
    refs = [ref] + ([INIT_CONTAINER_IMAGE] if op is TRAINING_OPERATOR else [])
    if runner.dry_run:
        runner.step(f"build {op.name} {op.version} from the Go module proxy; image {ref} FROM scratch", lambda: None)
        if op is TRAINING_OPERATOR:
            runner.step(f"image {INIT_CONTAINER_IMAGE} (Debian's static busybox FROM scratch) for the init container the "
                        "operator injects", lambda: None)
        images.ensure(runner, refs)
        return refs
    if not images.has_docker_image(ref):
        images.build_scratch_image(ref, build_binary(op), op.entrypoint, [op.entrypoint], extra_dirs=("/tmp",))
    if op is TRAINING_OPERATOR and not images.has_docker_image(INIT_CONTAINER_IMAGE):
        build_init_image()
    images.ensure(runner, refs)
    return refs


def build_init_image() -> None:
    """`alpine:3.10` as the operator's init container uses it (sh, seq, nslookup, sleep): Debian's static busybox
    FROM scratch, its applets installed as links (busybox-static on the host; no network needed)."""
    import shutil
    import tempfile

    busybox = shutil.which("busybox")
    if not busybox:
        raise DoeksError("busybox is not installed: apt-get install busybox-static (invoke setup --kubernetes does)")
    with tempfile.TemporaryDirectory(prefix="doeks-init-") as tmp:
        shutil.copy(busybox, Path(tmp) / "busybox")
        (Path(tmp) / "Dockerfile").write_text("\n".join([
            "FROM scratch", "COPY busybox /bin/busybox", 'RUN ["/bin/busybox", "--install", "-s", "/bin"]',
            'CMD ["sh"]', ""]))
        result = subprocess.run(["docker", "build", "-q", "-t", INIT_CONTAINER_IMAGE, tmp], capture_output=True, text=True)
        if result.returncode != 0:
            raise DoeksError(f"docker build {INIT_CONTAINER_IMAGE} failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")

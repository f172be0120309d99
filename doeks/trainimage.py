"""The training image: `elasticjob/Dockerfile` with the training script where the manifests say, on TRAIN_BASE_IMAGE.

Tagged `doeks-train:<content hash>` (the Dockerfile, every workload file and the base image reference), so a changed
script is a new tag and a manifest never names an image that lacks its script. Built with the local docker daemon and
no registry (the CPU base for this machine is made here from pip wheels, see `elasticjob/Dockerfile.torch-cpu`);
pushed to REGISTRY or this account's ECR (repository created if missing, login through boto3, push through the
docker SDK).
"""
from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import sys
from pathlib import Path

from . import catalog as _catalog
from . import ui
from .container import _client, stream_build
from .errors import DoeksError
from .settings import PROJECT_ROOT

REPOSITORY = "doeks-train"
WORKDIR = "/workspace"  # where elasticjob/Dockerfile puts the workload (the folder of jobspec.CONTAINER_SCRIPT)
TORCH_VERSION = "2.13.0"
TORCHVISION_VERSION = "0.28.0"
SHIM = PROJECT_ROOT / "doeks" / "local" / "torchvision_shim.py"
# An AWS Deep Learning Container for EC2/EKS: CUDA, NCCL, the EFA installer and aws-ofi-nccl (libnccl-ofi), torchrun.
# Source: aws/deep-learning-containers pytorch/training/buildspec-2-9-ec2.yml. Pulled from the public ECR gallery
# (public.ecr.aws/deep-learning-containers, the same repositories and tags as the release account's private ECR,
# doeks.catalog): anonymous pulls, so a build needs no registry login (the management container mounts no docker
# credentials). The training Dockerfile adds python-etcd on top.
DLC_TAG = "2.9.0-gpu-py312-cu130-ubuntu22.04-ec2"
DLC_BASE = f"{_catalog.DLC_PUBLIC}/pytorch-training:{DLC_TAG}"
DOCKERFILE = PROJECT_ROOT / "elasticjob" / "Dockerfile"
BASE_DOCKERFILE = PROJECT_ROOT / "elasticjob" / "Dockerfile.torch-cpu"
WORKLOAD = PROJECT_ROOT / "doeks" / "workload"
# At /opt/doeks-stage: the stager, for the cluster's staging Job (`python -m doeks.datastage`, standard library only),
# the image's torchrun (`python3 -m doeks.pod.torchrun`: torch's, with its etcd rendezvous fixed, preloaded workers
# (doeks.pod.zygote) and the hang watchdog (doeks.pod.watchdog)), each worker run by doeks.pod.worker (`python -u -m doeks.pod.worker
# script.py`, or doeks.pod.worker.run in a zygote's fork), its default command (`doeks-launch`: doeks.pod.launch, the job under
# torchrun with whatever started the container's settings), doeks.checkpoints() for a user's script
# (doeks/workload/checkpoints.py: torch, s3fs, s3torchconnector), and doeks.pod.reasons, by which the image's
# torchrun tells the script's own exception (no restart) from a lost peer's.
# py-spy in the image: the hang watchdog's stack dumps (doeks.pod.watchdog), of a stopped rank too. Its wheel (one static
# binary, any Python, x86_64) is fetched by pip on this machine and installed from the build context, as the CPU
# base's torch wheels are: the image's own pip may not reach an index (behind a TLS-inspecting proxy it has no CA).
PY_SPY = "py-spy==0.4.3"
STAGE_FILES = [PROJECT_ROOT / "doeks" / name for name in (
    "__init__.py", "errors.py", "datastage.py",
    "pod/__init__.py", "pod/torchrun.py", "pod/worker.py", "pod/zygote.py", "pod/watchdog.py", "pod/launch.py",
    "pod/torchcompat.py", "pod/reasons.py",
    "workload/__init__.py", "workload/checkpoints.py", "workload/checkpoint_read.py", "workload/checkpoint_s3.py")]


def _cpu_base() -> str:
    """doeks-torch-cpu:<torch>-<hash of its Dockerfile and the shim>: a changed recipe is a new base."""
    digest = hashlib.sha256(BASE_DOCKERFILE.read_bytes() + SHIM.read_bytes() + TORCHVISION_VERSION.encode())
    return f"doeks-torch-cpu:{TORCH_VERSION}-{digest.hexdigest()[:8]}"


CPU_BASE = _cpu_base()


def base_image(settings, on_this_machine: bool) -> str:
    """TRAIN_BASE_IMAGE, or the default for where the image runs: the CPU base made here, or the AWS DLC."""
    if settings.train_base_image:
        return settings.train_base_image
    return CPU_BASE if on_this_machine else DLC_BASE


def workload_files() -> list[Path]:
    return sorted(p for p in WORKLOAD.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix == ".py")


def content_tag(base: str, code=None) -> str:
    """A hash of the Dockerfile, the base, the job's code (doeks/workload, or the user's source and requirements,
    doeks.code) and the stager: a changed script is a new tag."""
    digest = hashlib.sha256()
    digest.update(DOCKERFILE.read_bytes())
    digest.update(base.encode() + b"\0" + PY_SPY.encode())
    if code is None or code.builtin:
        for path in workload_files():
            digest.update(path.relative_to(WORKLOAD).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    else:
        digest.update(b"user-code\0" + code.digest().encode())
    for path in STAGE_FILES:
        digest.update(b"stage/" + path.relative_to(PROJECT_ROOT / "doeks").as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def local_ref(base: str, code=None) -> str:
    return f"{REPOSITORY}:{content_tag(base, code)}"


def _credentials_configured(settings) -> bool:
    from .aws import credentials_configured

    return credentials_configured(settings)


PLACEHOLDER_ACCOUNT = "<account>"


def registry_host(settings) -> str | None:
    """REGISTRY as a host: an explicit host as it is; 'default' = this account's ECR (any credentials, the instance
    role too); empty, for an image a cluster pulls = this account's ECR when credentials are configured. None when the
    account cannot be told."""
    if settings.registry and settings.registry != "default":
        return settings.registry
    if settings.registry != "default" and not _credentials_configured(settings):
        return None
    from .aws import account_id

    try:
        return f"{account_id(settings)}.dkr.ecr.{settings.aws_region}.amazonaws.com"
    except Exception:  # noqa: BLE001 - no or bad credentials: the plan shows a placeholder, a submit refuses it
        return None


def require_resolved(ref: str) -> str:
    if PLACEHOLDER_ACCOUNT in ref:
        # REGISTRY=default reads the account with whatever credentials botocore finds (an instance or container role
        # too); offered as the fix, it failed the same way where there are none (REGISTRY=default gives this error)
        raise DoeksError(f"cannot tell which ECR registry the cluster pulls {ref.split('/', 1)[1]} from: no working AWS "
                         "credentials (AWS_PROFILE, AWS_ACCESS_KEY_ID or ~/.aws, or an instance role with REGISTRY=default); "
                         "set them, or name the image: REGISTRY=<host> or TRAIN_IMAGE=<image>")
    return ref


def reference(settings, on_this_machine: bool, code=None) -> str:
    """The image reference a job's manifests name: TRAIN_IMAGE, else the content-tagged training image (in the
    registry when the image runs elsewhere or REGISTRY is set; a local name only for this machine). `code`: the
    job's, resolved once by whoever holds the job."""
    from .code import resolve

    if settings.train_image:
        return settings.train_image
    ref = local_ref(base_image(settings, on_this_machine), code or resolve(settings))
    if on_this_machine and not settings.registry:
        return ref
    host = registry_host(settings) or f"{PLACEHOLDER_ACCOUNT}.dkr.ecr.{settings.aws_region}.amazonaws.com"
    return f"{host}/{ref}"


# -- building -------------------------------------------------------------------------------------------------------
def _has_image(client, ref: str) -> bool:
    import docker

    try:
        client.images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


def _ca_bundle() -> Path | None:
    ca = os.environ.get("PIP_CERT") or os.environ.get("REQUESTS_CA_BUNDLE")
    if not ca:  # pip's own setting (pip.conf), as the host's pip uses it
        import subprocess

        out = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.cert"], capture_output=True, text=True)
        ca = out.stdout.strip() if out.returncode == 0 else ""
    return Path(ca) if ca and Path(ca).is_file() else None


def build_cpu_base(settings, runner, client) -> str:
    """The CPU torch base (elasticjob/Dockerfile.torch-cpu): torch and torchvision wheels fetched by pip on the host
    (Python 3.11, manylinux x86_64, the versions doeks pins), the torchvision shim module, the CA bundle pip uses."""
    from .container import BASE_IMAGE

    os_base = BASE_IMAGE if _has_image(client, BASE_IMAGE) else settings.base_image
    context = settings.state_dir / "build" / "torch-cpu"
    shutil.rmtree(context, ignore_errors=True)
    (context / "wheels").mkdir(parents=True)
    runner.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
                "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                "-d", str(context / "wheels"), f"torch=={TORCH_VERSION}", f"torchvision=={TORCHVISION_VERSION}"])
    shim = context / "shim" / "doeks" / "local"
    shim.mkdir(parents=True)
    for name in ("__init__.py", "errors.py"):
        shutil.copyfile(PROJECT_ROOT / "doeks" / name, shim.parent / name)
    (shim / "__init__.py").write_text("")
    shutil.copyfile(PROJECT_ROOT / "doeks" / "local" / "torchvision_shim.py", shim / "torchvision_shim.py")
    ca = _ca_bundle()
    if ca:
        shutil.copyfile(ca, context / "ca.crt")
    shutil.copyfile(BASE_DOCKERFILE, context / "Dockerfile")
    try:
        stream_build(client, context, CPU_BASE, {"BASE_IMAGE": os_base})
    finally:
        shutil.rmtree(context, ignore_errors=True)
    return CPU_BASE


def build(settings, runner, on_this_machine: bool, code=None) -> str:
    """Build the training image (and the CPU base first when it is the base and missing); returns the reference the
    manifests name. Idempotent: an image with the same content tag is not built again."""
    from .code import CODE_DIR, resolve

    code = code or resolve(settings)
    base = base_image(settings, on_this_machine)
    ref = local_ref(base, code)
    named = reference(settings, on_this_machine, code) if not settings.train_image else ref
    workdir = CODE_DIR
    entry = "" if code.module else code.entry
    script = shlex.join(code.launcher()[1:])  # the image's default command runs it (DOEKS_TRAIN_SCRIPT)
    files = code.files()
    if runner.dry_run:
        if base == CPU_BASE:
            runner.step(f"docker build {CPU_BASE} from {BASE_DOCKERFILE.relative_to(PROJECT_ROOT)} (if missing)", lambda: None)
        runner.step(f"docker build --network host --build-arg TRAIN_BASE_IMAGE={base} --build-arg WORKDIR={workdir} "
                    f"--build-arg ENTRY={entry} --build-arg SCRIPT={shlex.quote(script)} -t {ref}{' -t ' + named if named != ref else ''} "
                    f"({DOCKERFILE.relative_to(PROJECT_ROOT)}, {len(files)} files of {code.source} -> {workdir}/"
                    + (f", pip install -r {code.requirements}" if code.requirements else "") + ")", lambda: None)
        return named
    client = _client()
    if base == CPU_BASE and not _has_image(client, CPU_BASE):
        runner.note(f"building the CPU training base {CPU_BASE} (once; a few minutes)")
        build_cpu_base(settings, runner, client)
    if _has_image(client, ref):
        ui.say(f"training image {ref} is up to date")
    else:
        context = settings.state_dir / "build" / "train"
        shutil.rmtree(context, ignore_errors=True)
        (context / "workload").mkdir(parents=True)
        for path in files:  # the job's code: doeks/workload, or the user's TRAIN_SOURCE
            target = context / "workload" / path.relative_to(code.source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        (context / "requirements").mkdir()
        (context / "requirements" / "requirements.txt").write_bytes(code.requirements.read_bytes() if code.requirements else b"")
        for path in STAGE_FILES:
            target = context / "stage" / "doeks" / path.relative_to(PROJECT_ROOT / "doeks")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        shutil.copyfile(DOCKERFILE, context / "Dockerfile")
        _tool_wheels(context / "tools", runner)
        try:
            stream_build(client, context, ref, {"TRAIN_BASE_IMAGE": base, "WORKDIR": workdir, "ENTRY": entry,
                                                 "SCRIPT": script})
        finally:
            shutil.rmtree(context, ignore_errors=True)
        ui.say(f"built training image {ref}")
    if named != ref and PLACEHOLDER_ACCOUNT not in named:
        client.images.get(ref).tag(named)
    return named


def _tool_wheels(folder: Path, runner) -> None:
    """PY_SPY's wheel into the build context (best effort: without it the watchdog dumps stacks with faulthandler)."""
    import subprocess

    folder.mkdir(parents=True, exist_ok=True)
    fetched = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                              "--platform", "manylinux2014_x86_64", "-d", str(folder), PY_SPY],
                             capture_output=True, text=True)
    if fetched.returncode != 0:
        runner.note(f"{PY_SPY} not fetched ({(fetched.stderr.strip().splitlines() or ['?'])[-1]}): the image goes "
                    "without it; the hang watchdog asks the ranks for their stacks with SIGUSR1 instead")


def require_image(ref: str, settings=None) -> str:
    """A training image a container target runs must be in the local daemon; one line naming the fix otherwise (the
    command that builds this very image: the settings a deploy had from its flags and the environment with it)."""
    if not _has_image(_client(), ref):
        what = "(TRAIN_IMAGE) is not in this machine's docker: `docker pull` or `docker load` it" if (
            settings is not None and settings.train_image) else f"is not built: `{command(settings, 'elasticjob.build')}`"
        raise DoeksError(f"training image {ref} {what}")
    return ref


def is_built(ref: str) -> bool | None:
    """The image (its local tag: a registry's name without the host) is in this machine's docker; None when the
    daemon cannot be asked."""
    try:
        client = _client()
    except DoeksError:
        return None
    try:
        return _has_image(client, ref) or _has_image(client, ref.rsplit("/", 1)[-1])
    except Exception:  # noqa: BLE001 - a daemon that stopped answering
        return None


# what decides which image a job's code is in: a command that builds it must carry these as the deploy had them
IMAGE_KEYS = ("TARGET", "SAGEMAKER_LOCAL", "TRAIN_SCRIPT", "TRAIN_SOURCE", "TRAIN_REQUIREMENTS", "TRAIN_BASE_IMAGE",
              "REGISTRY", "KUBECONFIG")


def command(settings, tasks: str) -> str:
    """`invoke TASKS` as it must be typed to act on the same image as this job: the keys that decide its code and
    image, where they came from a flag or the environment (not .env, which every command reads), before it."""
    import shlex

    if settings is None:
        return f"invoke {tasks}"
    given = [f"{key}={shlex.quote(settings.raw(key))}" for key in IMAGE_KEYS
             if settings.source(key) in ("environment", "flag")]
    return " ".join(given + ["invoke", tasks])


def push(settings, runner, on_this_machine: bool = False) -> str:
    """Push the training image to REGISTRY or this account's ECR (repository created if missing); returns the ref."""
    from .aws import client as aws_client
    from .code import resolve

    base = base_image(settings, on_this_machine)
    ref = local_ref(base, resolve(settings))
    host = (settings.registry if settings.registry and settings.registry != "default" else None) or registry_host(settings)
    if host is None and runner.dry_run:  # `up --dry-run` on a fresh clone: the plan names the step all the same
        runner.unknown("this account's ECR registry")
        host = f"{PLACEHOLDER_ACCOUNT}.dkr.ecr.{settings.aws_region}.amazonaws.com"
    if host is None:
        raise DoeksError("cannot tell this account's ECR registry: no AWS credentials (set AWS_PROFILE or AWS_ACCESS_KEY_ID, "
                         "or REGISTRY=<host>)")
    remote = f"{host}/{ref}"
    is_ecr = ".dkr.ecr." in host
    if is_ecr and PLACEHOLDER_ACCOUNT in host:
        runner.step(f"create ECR repository {REPOSITORY} if missing", lambda: None)
    elif is_ecr:
        ensure_repository(settings, runner)
        if in_ecr(settings, ref.split(":", 1)[1]):
            # the tag is the content's hash: the same tag is the same image, and the repository is IMMUTABLE (a
            # second push of a tag is refused): nothing to push
            ui.say(f"{remote} is in ECR already: not pushed again")
            return remote
    if runner.dry_run:
        runner.step(f"docker tag {ref} {remote} && docker push {remote}", lambda: None)
        return remote
    from .container import ecr_credentials

    docker_client = _client()
    if not _has_image(docker_client, ref):
        raise DoeksError(f"training image {ref} is not built: run `invoke elasticjob.build` first")
    docker_client.images.get(ref).tag(remote)
    auth = None
    if is_ecr:
        user, password, _ = ecr_credentials(settings)
        runner.secrets.append(password)
        auth = {"username": user, "password": password}
    try:
        for chunk in docker_client.images.push(remote, stream=True, decode=True, auth_config=auth):
            if "error" in chunk:
                raise DoeksError(runner.mask(f"push of {remote} failed: {chunk['error'].strip()}"))
    except DoeksError:
        raise
    except Exception as error:  # noqa: BLE001 - a registry that cannot be reached
        raise DoeksError(runner.mask(f"push of {remote} failed: {str(error).splitlines()[0]}")) from None
    ui.say(f"pushed {remote}")
    return remote


ECR_TAG = "doeks/cluster"  # the repository's cluster: `invoke down` deletes it with the cluster, `invoke audit` lists it


def ensure_repository(settings, runner) -> None:
    """This account's ECR repository for the training image: IMMUTABLE tags (a tag is a content hash), scanned on
    push, tagged with the cluster it was made for."""
    from .aws import client as aws_client

    ecr = aws_client(settings, "ecr")
    try:
        ecr.describe_repositories(repositoryNames=[REPOSITORY])
    except ecr.exceptions.RepositoryNotFoundException:
        runner.call(ecr, "create_repository", repositoryName=REPOSITORY, imageTagMutability="IMMUTABLE",
                    imageScanningConfiguration={"scanOnPush": True},
                    tags=[{"Key": "doeks", "Value": "true"}, {"Key": ECR_TAG, "Value": settings.cluster_name}])


def in_ecr(settings, tag: str) -> bool:
    """Whether this account's ECR repository has the image tag already (DescribeImages)."""
    from .aws import client as aws_client

    ecr = aws_client(settings, "ecr")
    try:
        return bool(ecr.describe_images(repositoryName=REPOSITORY, imageIds=[{"imageTag": tag}])["imageDetails"])
    except (ecr.exceptions.ImageNotFoundException, ecr.exceptions.RepositoryNotFoundException):
        return False


def repository(settings) -> dict | None:
    """The training image's ECR repository when it is this cluster's (tag doeks/cluster), with its image count."""
    from .aws import client as aws_client

    ecr = aws_client(settings, "ecr")
    try:
        found = ecr.describe_repositories(repositoryNames=[REPOSITORY])["repositories"][0]
    except ecr.exceptions.RepositoryNotFoundException:
        return None
    tags = {t["Key"]: t["Value"] for t in ecr.list_tags_for_resource(resourceArn=found["repositoryArn"]).get("tags", [])}
    if tags.get(ECR_TAG) != settings.cluster_name:
        return None
    images = sum(len(page["imageIds"]) for page in ecr.get_paginator("list_images").paginate(repositoryName=REPOSITORY))
    return {**found, "images": images}


def delete_repository(settings, runner) -> bool:
    """Delete the training image's ECR repository and its images when this cluster's `up` made it (tag
    doeks/cluster); another cluster's, or a REGISTRY that is not this account's ECR, is left alone. Safe twice."""
    from .aws import lookup

    if settings.registry and settings.registry != "default" and ".dkr.ecr." not in settings.registry:
        return False
    found = lookup(runner, f"ECR repository {REPOSITORY}", lambda: repository(settings), False)
    if found is False:  # a dry run without credentials
        from .aws import client as aws_client

        runner.call(aws_client(settings, "ecr"), "delete_repository", repositoryName=REPOSITORY, force=True)
        return False
    if found is None:
        ui.say(f"no ECR repository {REPOSITORY} of cluster {settings.cluster_name}")
        return False
    from .aws import client as aws_client

    runner.call(aws_client(settings, "ecr"), "delete_repository", repositoryName=REPOSITORY, force=True)
    return True

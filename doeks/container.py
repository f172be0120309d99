"""The management container (the seed's build/run/exec/status/stop/logs/push/pull/login/test scripts) via the
docker SDK. Image name and tag from `.env`; REGISTRY empty = local only, `default` = this account's ECR.
"""
from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path

from . import ui
from .errors import DoeksError
from .settings import PROJECT_ROOT

BASE_IMAGE = "doeks-base:bookworm"  # Debian bookworm made here (invoke setup --docker), for builds with no registry


def _client():
    try:
        import docker
    except ImportError:
        raise DoeksError("the docker SDK is not installed: pip install -e '.[cloud]'") from None
    try:
        client = docker.from_env(timeout=600)
        client.ping()
        return client
    except Exception as error:  # noqa: BLE001
        raise DoeksError(f"no docker daemon reachable ({type(error).__name__}): start docker, or `invoke setup --docker`") from None


def registry(settings) -> str:
    if settings.registry == "default":
        from .aws import account_id

        return f"{account_id(settings)}.dkr.ecr.{settings.aws_region}.amazonaws.com"
    return settings.registry


def image_ref(settings, with_registry: bool = False) -> str:
    name = f"{settings.image_name}:{settings.image_tag}"
    if with_registry:
        host = registry(settings)
        if not host:
            raise DoeksError("REGISTRY is empty (local only): set REGISTRY=default for this account's ECR, or a registry host")
        return f"{host}/{name}"
    return name


def context_digest(root: Path = PROJECT_ROOT) -> str:
    """12 hex digits over every file the build sees (the .dockerignore allow-list: `!path` lines), so an image tagged
    with it is rebuilt exactly when its context changed (the container test reuses a built image this way)."""
    import hashlib

    lines = (root / ".dockerignore").read_text().splitlines()
    allowed = [line[1:].strip().rstrip("/") for line in lines if line.startswith("!") and line[1:].strip() != ".build/"]
    digest = hashlib.sha256()
    for name in sorted(allowed):
        path = root / name
        files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else []
        for file in files:
            if "__pycache__" in file.parts or file.suffix == ".pyc":
                continue
            digest.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def build_args(settings) -> dict[str, str]:
    return {"BASE_IMAGE": settings.base_image, "DOWNLOADS": "true" if settings.container_downloads else "false"}


def _build_extras() -> Path:
    """.build/ in the context: the host's CA bundle for pip (when PIP_CERT names one), removed after the build."""
    extras = PROJECT_ROOT / ".build"
    extras.mkdir(exist_ok=True)
    ca = os.environ.get("PIP_CERT") or os.environ.get("REQUESTS_CA_BUNDLE")
    if ca and Path(ca).is_file():
        import shutil

        shutil.copyfile(ca, extras / "ca.crt")
    return extras


def at_defaults(settings) -> bool:
    """BASE_IMAGE and CONTAINER_DOWNLOADS as shipped: then a build with no registry falls back to the local base."""
    from .settings import KEY_BY_NAME

    return settings.base_image == KEY_BY_NAME["BASE_IMAGE"].default and settings.container_downloads


def offline_fallback(client, base: str) -> str:
    """Why `base` cannot be had (not here, and a pull fails: offline), or "" when it can."""
    import docker

    try:
        client.images.get(base)
        return ""
    except docker.errors.ImageNotFound:
        pass
    repository, _, tag = base.rpartition(":") if ":" in base.rsplit("/", 1)[-1] else (base, "", "latest")
    try:
        client.images.pull(repository, tag=tag)
        return ""
    except Exception as error:  # noqa: BLE001 - any registry error: no network, no DNS, refused
        return f"{base} is not here and cannot be pulled ({(str(error).strip().splitlines() or [type(error).__name__])[0][:160]})"


def _offline_args(client, settings) -> dict[str, str]:
    """The build args: as set, or with default settings and no registry, the local base made by `invoke setup
    --docker` (doeks-base:bookworm) and the offline tools (CONTAINER_DOWNLOADS=false), saying so."""
    import docker

    LOCAL_BASE = BASE_IMAGE

    args = build_args(settings)
    if not at_defaults(settings):
        return args
    why = offline_fallback(client, settings.base_image)
    if not why:
        return args
    try:
        client.images.get(LOCAL_BASE)
    except docker.errors.ImageNotFound:
        raise DoeksError(f"{why}, and the local base {LOCAL_BASE} is not there either: `invoke setup --docker` makes it "
                         "(debootstrap), or set BASE_IMAGE to an image you have") from None
    ui.warn(f"{why}: building offline on the local base {LOCAL_BASE} with CONTAINER_DOWNLOADS=false (kubectl, helm "
            "and aws from PyPI; eksctl missing); set BASE_IMAGE and CONTAINER_DOWNLOADS in .env to choose")
    return {"BASE_IMAGE": LOCAL_BASE, "DOWNLOADS": "false"}


def build(settings, runner, no_cache: bool = False) -> None:
    args = build_args(settings)
    tag = image_ref(settings)
    shown = " ".join(f"--build-arg {k}={v}" for k, v in args.items())
    if runner.dry_run:
        LOCAL_BASE = BASE_IMAGE

        fallback = (f" (if {settings.base_image} cannot be pulled: --build-arg BASE_IMAGE={LOCAL_BASE} --build-arg "
                    "DOWNLOADS=false, the local base and the offline tools)") if at_defaults(settings) else ""
        runner.step(f"docker build --network host {shown} -t {tag} {PROJECT_ROOT}{fallback}", lambda: None)
        return
    client = _client()
    args = _offline_args(client, settings)
    shown = " ".join(f"--build-arg {k}={v}" for k, v in args.items())
    runner.note(f"docker build --network host {shown} -t {tag} {PROJECT_ROOT}")
    extras = _build_extras()
    try:
        stream_build(client, PROJECT_ROOT, tag, args, nocache=no_cache)
    finally:
        (extras / "ca.crt").unlink(missing_ok=True)
    ui.say(f"built {tag}")


def stream_build(client, context: Path, tag: str, buildargs: dict[str, str], dockerfile: str = "Dockerfile",
                 nocache: bool = False) -> None:
    """`docker build --network host` through the SDK, its output on stderr under a progress line; one error line."""
    with ui.progress() as bar:
        task_id = bar.add_task(f"building {tag}", total=None)
        stream = client.api.build(path=str(context), dockerfile=dockerfile, tag=tag, buildargs=buildargs,
                                  network_mode="host", nocache=nocache, rm=True, forcerm=True, decode=True)
        for chunk in stream:
            if "error" in chunk:
                raise DoeksError(f"docker build of {tag} failed: {chunk['error'].strip().splitlines()[-1]}")
            line = chunk.get("stream", "").rstrip()
            if line:
                bar.console.print(line, markup=False, highlight=False)
                if line.startswith("Step "):
                    bar.update(task_id, description=f"building {tag}: {line.split(':')[0]}")


def run_kwargs(settings) -> dict:
    home = Path.home()
    volumes = {str(PROJECT_ROOT): {"bind": "/doeks", "mode": "rw"},
               "/var/run/docker.sock": {"bind": "/var/run/docker.sock", "mode": "rw"}}
    if (home / ".aws").exists():
        volumes[str(home / ".aws")] = {"bind": "/root/.aws", "mode": "ro"}
    if (home / ".kube").exists():
        volumes[str(home / ".kube")] = {"bind": "/root/.kube", "mode": "rw"}
    return {"name": settings.doeks_container_name, "detach": True, "tty": True, "stdin_open": True, "volumes": volumes,
            "working_dir": "/doeks", "network_mode": "host", "command": ["sleep", "infinity"],
            "labels": {"app.kubernetes.io/part-of": "doeks"}}


def _find(client, name: str):
    import docker

    try:
        return client.containers.get(name)
    except docker.errors.NotFound:
        return None


def run(settings, runner) -> None:
    kwargs = run_kwargs(settings)
    if runner.dry_run:
        runner.step(f"docker run {image_ref(settings)} {json.dumps(kwargs, default=str)}", lambda: None)
        return
    client = _client()
    existing = _find(client, settings.doeks_container_name)
    if existing is not None and existing.status == "running":
        ui.say(f"container {settings.doeks_container_name} is already running")
        return
    if existing is not None:
        existing.remove(force=True)
    import docker

    try:
        container = client.containers.run(image_ref(settings), **kwargs)
    except docker.errors.ImageNotFound:
        raise DoeksError(f"image {image_ref(settings)} not found: run `invoke build` (or `invoke pull`)") from None
    ui.say(f"container {container.name} running ({container.short_id})")


def exec_(settings, command: str) -> int:
    client = _client()
    container = _find(client, settings.doeks_container_name)
    if container is None or container.status != "running":
        raise DoeksError(f"container {settings.doeks_container_name} is not running: `invoke run` first")
    if not command:
        os.execvp("docker", ["docker", "exec", "-it", settings.doeks_container_name, "bash"])
    # not a login shell: /etc/profile would reset PATH and hide the image's tools (/opt/doeks/bin: invoke, doeks);
    # in /doeks, the mounted project, whose code (PYTHONPATH=/doeks in the image) and .env are what run
    result = container.exec_run(["bash", "-c", command], demux=False, workdir="/doeks")
    sys.stdout.write(result.output.decode(errors="replace"))
    if result.exit_code:
        raise DoeksError(f"`{command}` exited with {result.exit_code} in {settings.doeks_container_name}")
    return result.exit_code


def status(settings, extra_rows: list[list] = ()) -> None:
    """The management container's state, then `extra_rows` (what the target runs here: the local runtime's servers)."""
    rows = []
    try:
        client = _client()
        container = _find(client, settings.doeks_container_name)
        rows.append(["container " + settings.doeks_container_name, container.status if container else "absent",
                     container.image.tags[0] if container and container.image.tags else "", container.short_id if container else ""])
    except DoeksError as error:
        rows.append(["docker", "unreachable", str(error), ""])
    rows += [list(row) for row in extra_rows]
    ui.table("doeks status", ["what", "state", "detail", "id/pid"], rows)


def stop(settings, runner) -> None:
    if runner.dry_run:
        runner.step(f"docker rm -f {settings.doeks_container_name}", lambda: None)
        return
    client = _client()
    container = _find(client, settings.doeks_container_name)
    if container is None:
        ui.say(f"container {settings.doeks_container_name} is not there: nothing to stop")
        return
    container.remove(force=True)
    ui.say(f"container {settings.doeks_container_name} stopped and removed")


def logs(settings, follow: bool = False) -> None:
    client = _client()
    container = _find(client, settings.doeks_container_name)
    if container is None:
        raise DoeksError(f"the tools container {settings.doeks_container_name} is not running (`invoke run` starts "
                         "it); the training job's logs: `invoke elasticjob.logs`")
    for chunk in container.logs(stream=True, follow=follow):
        sys.stdout.write(chunk.decode(errors="replace"))


def ecr_credentials(settings) -> tuple[str, str, str]:
    from .aws import client

    data = client(settings, "ecr").get_authorization_token()["authorizationData"][0]
    user, password = base64.b64decode(data["authorizationToken"]).decode().split(":", 1)
    return user, password, data["proxyEndpoint"]


def login(settings, runner) -> None:
    user, password, endpoint = ecr_credentials(settings)
    runner.secrets.append(password)
    if runner.dry_run:
        runner.step(f"docker login --username {user} --password-stdin {endpoint}", lambda: None)
        return
    _client().login(username=user, password=password, registry=endpoint)
    ui.say(f"logged in to {endpoint}")


def push(settings, runner) -> None:
    remote = image_ref(settings, with_registry=True)
    if runner.dry_run:
        runner.step(f"docker tag {image_ref(settings)} {remote} && docker push {remote}", lambda: None)
        return
    client = _client()
    client.images.get(image_ref(settings)).tag(remote)
    for chunk in client.images.push(remote, stream=True, decode=True):
        if "error" in chunk:
            raise DoeksError(f"push failed: {chunk['error']}")
    ui.say(f"pushed {remote}")


def pull(settings, runner) -> None:
    remote = image_ref(settings, with_registry=True)
    if runner.dry_run:
        runner.step(f"docker pull {remote}", lambda: None)
        return
    client = _client()
    image = client.images.pull(remote)
    image.tag(image_ref(settings))
    ui.say(f"pulled {remote}")


NEEDED_TOOLS = ("aws", "eksctl", "kubectl", "helm")  # what `up`/`down` on TARGET=eks run; kubectx, kubens: conveniences


def self_test(settings) -> None:
    """The image's doeks-selftest; fails when a check fails or a needed tool (NEEDED_TOOLS) is missing."""
    client = _client()
    import docker

    try:
        container = client.containers.run(image_ref(settings), ["doeks-selftest"], detach=True, network_mode="host")
    except docker.errors.ImageNotFound:
        raise DoeksError(f"image {image_ref(settings)} not found: run `invoke build`") from None
    try:
        code = container.wait(timeout=600).get("StatusCode", 1)
        output = container.logs(stdout=True, stderr=True).decode(errors="replace")
    finally:
        container.remove(force=True)
    sys.stdout.write(output)
    failed = [line.split(None, 1)[1] for line in output.splitlines() if line.startswith("FAIL ")]
    missing = [line.split(":", 1)[0].split()[1] for line in output.splitlines()
               if line.startswith("missing ") and line.split(":", 1)[0].split()[1] in NEEDED_TOOLS]
    if failed or missing or code:
        what = ([f"missing {', '.join(missing)}"] if missing else []) + ([f"failed: {'; '.join(failed)}"] if failed else [])
        raise DoeksError(f"self-test of {image_ref(settings)}: {', '.join(what) or f'exit code {code}'} (see above; "
                         "an offline build has no eksctl: build with CONTAINER_DOWNLOADS=true where downloads work)")

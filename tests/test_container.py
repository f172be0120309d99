"""The management container, built and run against a real local docker daemon (Debian docker.io, vfs storage).

The image is built offline: on the base image `invoke setup --docker` makes with debootstrap + docker import, with
CONTAINER_DOWNLOADS=false (no registry or release downloads are reachable here). CI always has a daemon; elsewhere
the test is skipped when none is reachable.
"""
from __future__ import annotations

import uuid

import pytest

from doeks import preflight

from .conftest import invoke

pytestmark = [pytest.mark.slow, pytest.mark.docker]


@pytest.fixture(scope="module")
def docker_env(docker_client):
    import docker

    client = docker_client
    name = f"doeks-test-{uuid.uuid4().hex[:6]}"
    env = {"BASE_IMAGE": preflight.BASE_IMAGE, "CONTAINER_DOWNLOADS": "false", "IMAGE_NAME": "doeks-test",
           "IMAGE_TAG": name, "DOEKS_CONTAINER_NAME": name}
    yield env
    for container in client.containers.list(all=True, filters={"name": name}):
        container.remove(force=True)
    try:
        client.images.remove(f"doeks-test:{name}", force=True)
    except docker.errors.ImageNotFound:
        pass


def test_build_run_exec_stop(docker_env, state_dir):
    dry = invoke("build", "--dry-run", env=docker_env)
    assert dry.returncode == 0 and "would docker build" in dry.stderr and "BASE_IMAGE=doeks-base:bookworm" in dry.stderr

    built = invoke("build", env=docker_env, timeout=1500)
    assert built.returncode == 0, built.stderr[-3000:]
    assert "built doeks-test:" in built.stderr

    selftest = invoke("test", env=docker_env, timeout=300)
    assert selftest.returncode == 0, selftest.stdout + selftest.stderr
    assert "ok   python3 -c import doeks" in selftest.stdout and "skip eksctl" in selftest.stdout

    started = invoke("run", env=docker_env)
    assert started.returncode == 0, started.stderr
    again = invoke("run", env=docker_env)
    assert again.returncode == 0 and "already running" in again.stderr

    ran = invoke("exec", "--", "echo", "ok", env=docker_env)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "ok"
    listed = invoke("exec", "--", "invoke --list", env=docker_env)  # the image's PATH: was `command not found` (127)
    assert listed.returncode == 0 and "elasticjob.deploy" in listed.stdout, listed.stdout + listed.stderr
    failing = invoke("exec", "--", "exit 3", env=docker_env)
    assert failing.returncode == 1 and "exited with 3" in failing.stderr

    status = invoke("status", env={**docker_env, "COLUMNS": "200"})
    assert status.returncode == 0 and "running" in status.stderr

    assert invoke("stop", env=docker_env).returncode == 0
    second = invoke("stop", env=docker_env)
    assert second.returncode == 0 and "nothing to stop" in second.stderr
    missing = invoke("exec", "--", "true", env=docker_env)
    assert missing.returncode == 1 and "not running" in missing.stderr and "Traceback" not in missing.stderr

"""The project's promises to a new user: README, CI, task list, import weight."""
from __future__ import annotations

import re
import subprocess
import sys

from doeks import settings as S

from .conftest import ROOT, invoke

ROOT_TASKS = ["build", "run", "exec", "status", "stop", "logs", "push", "pull", "login", "test", "up", "down",
              "config", "setup", "doctor", "demo"]


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r'^TEST_COMMAND="(.*)"$', ci, re.M).group(1)
    assert f"```bash\n{command}\n```" in readme
    assert "```bash\npip install -e '.[dev]' && invoke setup demo\n```" in readme


def test_readme_env_reference_is_in_step_with_settings():
    reference = (ROOT / "docs" / "env-reference.md").read_text()  # the README links it (issue 24)
    assert S.render_reference_table() in reference
    assert "(docs/env-reference.md)" in (ROOT / "README.md").read_text()


def test_readme_is_read_in_five_minutes_and_its_links_lead_somewhere():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    for heading in ("## Quickstart", "## Bring your own script", "## Targets", "## Units"):
        assert heading in readme, heading
    links = re.findall(r"\]\(((?:docs/)[^)#]*)", readme)
    for page in ("docs/mechanism.md", "docs/env-reference.md", "docs/benchmarks.md", "docs/testing.md"):
        assert page in links, page
    assert all((ROOT / link).exists() for link in links), links


def test_invoke_list_shows_every_root_task_with_help_and_unit_tasks():
    result = invoke("--list", env={"COLUMNS": "300"})
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.startswith("  ")}
    for name in ROOT_TASKS:
        assert name in lines and len(lines[name].split()) > 1, f"root task {name} missing or without help"
    for name in ("eks.create", "eks.delete", "elasticjob.deploy", "elasticjob.scale"):
        assert name in lines


def test_invoke_list_imports_nothing_heavy():
    probe = ("import atexit, runpy, sys\n"
             "heavy = ('torch', 'boto3', 'botocore', 'kubernetes', 'sagemaker', 'kfp', 'docker', 'matplotlib')\n"
             "atexit.register(lambda: print('HEAVY:' + ','.join(m for m in heavy if m in sys.modules)))\n"
             "sys.argv = ['invoke', '--list']\n"
             "runpy.run_module('invoke', run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True).stdout
    assert "HEAVY:\n" in out or out.rstrip().endswith("HEAVY:")


def test_up_and_down_dry_run_go_in_opposite_orders(state_dir):
    up = invoke("up", "--dry-run", "--full")
    down = invoke("down", "--dry-run")
    assert up.returncode == 0 and down.returncode == 0, up.stderr + down.stderr
    order_up = re.findall(r"== up: (\S+)", up.stderr)
    order_down = re.findall(r"== down: (\S+)", down.stderr)
    assert order_up and order_down == list(reversed(order_up))
    assert not (state_dir / "services").exists()


def test_up_then_down_on_local_for_real_leaves_nothing_running(state_dir):
    from .test_elasticjob_local import leftover_processes

    env = {"DATA_TRAIN_PER_CLASS": "20", "DATA_VAL_PER_CLASS": "5"}
    up = invoke("up", env=env, timeout=300)
    assert up.returncode == 0, up.stderr[-2000:]
    from doeks.local import jobs, services

    assert services.etcd(state_dir).info() and services.moto(state_dir).info() and services.gpu_sampler(state_dir).info()
    assert jobs.is_active(state_dir / "jobs" / "imagenet")
    down = invoke("down", env=env, timeout=300)
    assert down.returncode == 0, down.stderr[-2000:]
    assert leftover_processes(state_dir) == []
    assert all(server.info() is None for server in services.services(state_dir))
    assert (state_dir / "volumes" / "fsx-pvc" / "data" / "train").is_dir()  # data is kept
    again = invoke("down", env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]


def test_login_and_push_dry_run_use_ecr_and_never_show_the_token(state_dir):
    from doeks.local import services

    server = services.moto(state_dir)
    server.start()
    try:
        env = {"AWS_ENDPOINT_URL": server.endpoint(), "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "REGISTRY": "default"}
        import base64

        import boto3

        token = boto3.client("ecr", endpoint_url=server.endpoint(), region_name="us-west-2", aws_access_key_id="testing",
                             aws_secret_access_key="testing").get_authorization_token()["authorizationData"][0]["authorizationToken"]
        password = base64.b64decode(token).decode().split(":", 1)[1]
        login = invoke("login", "--dry-run", env=env)
        assert login.returncode == 0, login.stderr
        assert "would docker login --username AWS --password-stdin" in login.stderr
        assert password not in login.stdout + login.stderr
        push = invoke("push", "--dry-run", env=env)
        assert push.returncode == 0, push.stderr
        assert ".dkr.ecr.us-west-2.amazonaws.com/doeks:latest" in push.stderr
        local_only = invoke("push", "--dry-run", env={**env, "REGISTRY": ""})
        assert local_only.returncode == 1 and "REGISTRY is empty" in local_only.stderr
    finally:
        server.stop()

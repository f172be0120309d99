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


def test_ci_runs_in_a_fresh_venv_that_sees_nothing_of_the_machine():
    """A green CI must mean the README works for a new user: the machine's own interpreter once held boto3 and moto,
    which hid a ResolutionImpossible that every clean install met."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r'^python3 -m venv "\$VENV"', ci, re.M), "CI makes its own venv"
    assert "system-site-packages" not in ci
    assert ci.index('. "$VENV/bin/activate"') < ci.index('bash -c "$TEST_COMMAND"')
    assert "-c constraints.txt" in re.search(r'^TEST_COMMAND="(.*)"$', ci, re.M).group(1)


def test_ci_runs_the_clusters_modules_in_one_worker_and_the_rest_beside():
    """CI's `python -m pytest -ra` runs on two xdist workers (tests/conftest.py): every module with a test of the
    run's one cluster is in one group, which one worker runs in file order; every other module is a group of its own."""
    from . import conftest

    modules = {path.name: path.read_text() for path in (ROOT / "tests").glob("test_*.py")}
    uses = {name for name, text in modules.items() if re.search(r"mark\.(kubernetes|cluster_down)\b", text)}
    assert uses and all(conftest.in_cluster_group(name) for name in uses), uses - conftest.CLUSTER_MODULES
    assert conftest.CLUSTER_MODULES <= set(modules), conftest.CLUSTER_MODULES - set(modules)  # none renamed away
    assert conftest.scope("tests/test_kubernetes_jobs.py::test_every_job_name[job.1]") == "cluster"
    assert conftest.scope("tests/test_rehearsal_iam.py::test_x") == conftest.scope("tests/test_rehearsal_new.py::t")
    assert conftest.scope("tests/test_rehearsal_iam.py::test_x") == "cluster"
    assert conftest.scope("tests/test_kubernetes_target.py::test_x") == "tests/test_kubernetes_target.py"
    assert conftest.scope("tests/test_docker_target.py::test_x") == "tests/test_docker_target.py"


def test_constraints_pin_a_version_that_pyproject_allows():
    """constraints.txt (the lock CI installs) and pyproject's bounds agree: a bound changed in one place alone would
    have CI test versions users never get, or fail to resolve."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^ ;]+)", line)
        if match:
            pins[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = Version(match.group(2))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"]) + [r for extra in ("train", "cloud", "local", "dev")
                                               for r in project["optional-dependencies"][extra]]
    checked = 0
    for text in wanted:
        requirement = Requirement(text)
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        if name == "doeks":
            continue
        assert name in pins, f"{name} is not pinned in constraints.txt (uv pip compile, docs/testing.md)"
        assert pins[name] in requirement.specifier, f"constraints.txt pins {name}=={pins[name]}, pyproject says {text}"
        checked += 1
    assert checked > 20


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
    from doeks import services
    from doeks.local import jobs

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
    from doeks import services

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


# The first commit whose subject keeps to 72 characters; every commit after it must too (git log's one-line views,
# GitHub's titles, `git shortlog`): the detail goes in the body.
SHORT_SUBJECTS_SINCE = "eac8c3d"


def test_commit_subjects_since_the_rule_keep_to_72_characters():
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)

    if git("cat-file", "-e", f"{SHORT_SUBJECTS_SINCE}^{{commit}}").returncode != 0:
        import pytest

        pytest.skip("no history here (a shallow clone or an export): nothing to read")
    subjects = git("log", "--no-merges", "--format=%h %s", f"{SHORT_SUBJECTS_SINCE}..HEAD").stdout.splitlines()
    long = [line for line in subjects if len(line.split(" ", 1)[1]) > 72]
    assert not long, "commit subjects over 72 characters (put the detail in the body):\n" + "\n".join(long)

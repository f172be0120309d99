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
    readme = (ROOT / "README.md").read_text()
    assert S.render_reference_table() in readme


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
    up = invoke("up", "--dry-run")
    down = invoke("down", "--dry-run")
    assert up.returncode == 0 and down.returncode == 0, up.stderr + down.stderr
    order_up = re.findall(r"== up: (\S+)", up.stderr)
    order_down = re.findall(r"== down: (\S+)", down.stderr)
    assert order_up and order_down == list(reversed(order_up))
    assert not (state_dir / "services").exists()

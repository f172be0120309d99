"""What a new user trips over (issue 24): plans one can diff and review, one short flag per meaning."""
from __future__ import annotations

import re

from .conftest import invoke


def _plan(*args, env=None):
    result = invoke(*args, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_the_same_inputs_print_the_same_plan_without_yaml_anchors(state_dir):
    for target, task, extra in (("local", "elasticjob.deploy", ()), ("local", "elasticjob.deploy", ("--rdzv-backend", "c10d")),
                                ("eks", "elasticjob.deploy", ()), ("eks", "kubeflow.pipeline.deploy", ())):
        first = _plan(task, "--dry-run", *extra, env={"TARGET": target})
        second = _plan(task, "--dry-run", *extra, env={"TARGET": target})
        assert first.stdout == second.stdout, (target, task, extra)
        assert first.stderr == second.stderr, (target, task, extra)
        assert not re.search(r"[&*]id\d+", first.stdout), (target, task)  # a printed manifest is plain YAML
    assert "rdzvId: imagenet-dry-run" in first.stdout or "rdzvId" not in first.stdout


def test_a_local_plan_says_which_port_in_words(state_dir):
    result = _plan("elasticjob.deploy", "--dry-run")
    assert "127.0.0.1:a free port" not in result.stderr
    assert "on a free port of 127.0.0.1" in result.stderr


def _tasks(collection, prefix=""):
    for name, task in collection.tasks.items():
        yield prefix + name, task
    for name, sub in collection.collections.items():
        yield from _tasks(sub, f"{prefix}{name}.")


def test_dash_d_is_dry_run_in_every_task_that_has_one():
    import importlib.util

    from .conftest import ROOT

    spec = importlib.util.spec_from_file_location("doeks_root_tasks", ROOT / "tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    checked = 0
    for name, task in _tasks(module.ns):
        arguments = {argument.name: argument.names for argument in task.get_arguments()}
        if "dry_run" in arguments:
            checked += 1
            assert "d" in arguments["dry_run"], f"{name}: -d is not --dry-run ({arguments})"
    assert checked > 20

"""What a new user trips over (issue 24): plans one can diff and review, one short flag per meaning."""
from __future__ import annotations

import re

import pytest

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


def test_a_misspelled_env_key_is_a_warning_naming_the_closest_known_key(state_dir, tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("REPLCAS=3\n")
    (tmp_path / ".env.local").write_text("EPOCH=2\n")
    result = invoke("elasticjob.deploy", "--dry-run", env={"DOEKS_ENV_FILE": str(env_file)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "warning: .env: unknown key REPLCAS is ignored: did you mean REPLICAS?" in result.stderr
    assert "warning: .env.local: unknown key EPOCH is ignored: did you mean EPOCHS?" in result.stderr
    assert result.stderr.count("unknown key REPLCAS") == 1


def test_a_bad_value_names_the_file_or_variable_it_came_from(tmp_path):
    from doeks import settings as S
    from doeks.errors import SettingsError

    env_file = tmp_path / ".env"
    env_file.write_text("EPOCHS=many\n")
    cases = [({}, "(from .env)"), ({"EPOCHS": "lots"}, "(from the environment)")]
    for environ, where in cases:
        with pytest.raises(SettingsError) as error:
            S.load(environ=environ, path=env_file)
        assert str(error.value).endswith(where), str(error.value)
    (tmp_path / ".env.local").write_text("EPOCHS=0\n")
    with pytest.raises(SettingsError, match=r"^EPOCHS='0' is not accepted: .*\(from \.env\.local\)$"):
        S.load(environ={}, path=env_file)
    (tmp_path / ".env.local").unlink()
    env_file.write_text("MIN_REPLICAS=3\n")  # a check across keys names where each value came from
    with pytest.raises(SettingsError, match=r"\(MIN_REPLICAS from \.env\)$"):
        S.load(environ={}, path=env_file)


def test_config_and_doctor_still_run_with_a_bad_value_and_show_it_marked(state_dir):
    env = {"EPOCHS": "x", "COLUMNS": "250"}
    config = invoke("config", env=env)
    assert config.returncode == 1 and "Traceback" not in config.stderr
    assert re.search(r"EPOCHS\s*│\s*x \(NOT ACCEPTED", config.stdout), config.stdout
    assert "AWS_REGION" in config.stdout  # the whole table
    assert config.stderr.strip().splitlines()[-1] == \
        "error: EPOCHS='x' is not accepted: expected an integer from 1 to 10000 (from the environment)"
    doctor = invoke("doctor", env=env)
    assert doctor.returncode == 1 and "Traceback" not in doctor.stderr
    assert re.search(r"setting EPOCHS\s*│\s*NO\s*│\s*EPOCHS='x' is not accepted", doctor.stderr), doctor.stderr
    assert "python: torch" in doctor.stderr  # the other checks ran


def test_ctrl_c_while_following_says_the_job_still_runs_and_a_second_deploy_refuses_first(state_dir, monkeypatch):
    import os
    import signal
    import subprocess
    import sys

    from doeks import elastic
    from doeks.local import jobs

    from .conftest import ROOT, job_settings, wait_for
    from .test_elasticjob_local import SMALL, leftover_processes, max_step

    s = job_settings({**SMALL, "EPOCHS": "20"}, monkeypatch)
    # SIGINT as a terminal's foreground process has it: a suite started in the background by a non-interactive shell
    # (`.ci/run &`) inherits it ignored, and so would the task, which then never sees the Ctrl-C
    follow = subprocess.Popen([sys.executable, "-m", "invoke", "elasticjob.deploy", "--fresh", "--follow"], cwd=ROOT,
                              env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(lambda: max_step(s) >= 1, 240, "the job to train")
        follow.send_signal(signal.SIGINT)  # what Ctrl-C sends the foreground process
        out, err = follow.communicate(timeout=60)
        assert follow.returncode == 130, err[-2000:]
        last = err.strip().splitlines()[-1]
        assert last == ("interrupted: job imagenet is still running on TARGET=local (Running); follow it with "
                        "`invoke elasticjob.logs --follow`, stop it with `invoke elasticjob.delete`"), err[-2000:]
        assert jobs.is_active(elastic.home(s))  # it was only the following that stopped

        again = invoke("elasticjob.deploy")
        assert again.returncode == 1
        assert again.stdout == ""  # no manifests before the refusal
        assert [line for line in again.stderr.splitlines() if line.strip()] == [
            "error: job imagenet is already running: `invoke elasticjob.status`, or `invoke elasticjob.delete` first"]
    finally:
        if follow.poll() is None:
            follow.kill()
        invoke("elasticjob.delete")
        invoke("eks.delete")
    assert leftover_processes(state_dir) == []


@pytest.mark.docker
def test_a_build_with_default_settings_and_no_registry_falls_back_to_the_local_base(docker_client, state_dir, monkeypatch):
    import dataclasses

    from doeks import container, machine
    from doeks import settings as S
    from doeks.services import free_port

    try:
        docker_client.images.get(machine.BASE_IMAGE)
    except Exception:  # noqa: BLE001
        pytest.skip(f"no {machine.BASE_IMAGE} (`invoke setup --docker` makes it)")
    dry = invoke("build", "--dry-run", env={"BASE_IMAGE": "debian:bookworm-slim", "CONTAINER_DOWNLOADS": "true"})
    assert dry.returncode == 0, dry.stderr
    assert "if debian:bookworm-slim cannot be pulled: --build-arg BASE_IMAGE=doeks-base:bookworm --build-arg DOWNLOADS=false" in dry.stderr

    unreachable = f"127.0.0.1:{free_port()}/debian:bookworm-slim"  # a registry that is not there, as offline
    monkeypatch.setitem(S.KEY_BY_NAME, "BASE_IMAGE", dataclasses.replace(S.KEY_BY_NAME["BASE_IMAGE"], default=unreachable))
    monkeypatch.setenv("BASE_IMAGE", unreachable)
    monkeypatch.setenv("CONTAINER_DOWNLOADS", "true")
    S.reset()
    args = container._offline_args(docker_client, S.current())
    assert args == {"BASE_IMAGE": "doeks-base:bookworm", "DOWNLOADS": "false"}
    monkeypatch.setenv("CONTAINER_DOWNLOADS", "false")  # chosen, not the default: built as set
    S.reset()
    assert container._offline_args(docker_client, S.current())["BASE_IMAGE"] == unreachable


def test_ranks_sharing_a_log_never_merge_lines(tmp_path):
    """Two ranks of a node write to the node's one log (O_APPEND, unbuffered, as torchrun's workers do)."""
    import os
    import subprocess
    import sys

    from .conftest import ROOT

    log = tmp_path / "agent.log"
    probe = ("import os, sys\nsys.path.insert(0, 'doeks/workload')\nimport train\n"
             "for i in range(3000):\n    train.log(f'line {i}')\n")
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        ranks = [subprocess.Popen([sys.executable, "-c", probe], cwd=ROOT, stdout=fd, stderr=subprocess.PIPE,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", "RANK": str(rank)}) for rank in (0, 1)]
        for rank in ranks:
            assert rank.wait(timeout=300) == 0, rank.stderr.read()
    finally:
        os.close(fd)
    lines = log.read_text().splitlines()
    bad = [line for line in lines if not re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3} \[rank [01]\] line \d+", line)]
    assert not bad and len(lines) == 6000, bad[:5]


def test_every_task_help_in_the_list_is_whole():
    """`invoke --list` shows a docstring's first line: a first paragraph over two lines was cut mid-phrase."""
    import importlib.util
    import inspect

    from .conftest import ROOT

    spec = importlib.util.spec_from_file_location("doeks_root_tasks_list", ROOT / "tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cut = [name for name, task in _tasks(module.ns) if "\n" in (inspect.getdoc(task.body) or "").split("\n\n")[0]]
    assert cut == [], f"first paragraph over more than one line (cut in `invoke --list`): {cut}"


def test_a_choice_is_read_case_insensitively(tmp_path):
    from doeks import settings as S

    s = S.load(environ={"TARGET": "EKS", "RDZV_BACKEND": "C10D", "FSX_COMPRESSION": "lz4"}, path=tmp_path / "none")
    assert (s.target, s.rdzv_backend, s.fsx_compression) == ("eks", "c10d", "LZ4")


def test_an_apply_in_a_dry_run_names_each_object(state_dir):
    result = _plan("gpu-metrics.deploy", "--agent", "--dry-run", env={"TARGET": "eks"})
    lines = [line for line in result.stderr.splitlines() if line.startswith("would create or change ")]
    kinds = re.findall(r"^kind: (\S+)$", result.stdout, re.M)
    assert len(lines) == len(kinds) > 0, result.stderr
    assert "would create or change DaemonSet amazon-cloudwatch/cloudwatch-agent-gpu (the YAML on stdout)" in lines

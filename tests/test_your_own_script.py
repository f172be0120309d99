"""Your own training code (TRAIN_SCRIPT, TRAIN_SOURCE, TRAIN_ARGS): a script outside the repository, with strict
argparse, runs unchanged on the local target from its own folder, gets its arguments exactly, resumes from its
checkpoint folder, shows its own steps (no made-up totals) and fails with its exception as the reason. The examples in
examples/ run as they are. Docker and SageMaker local mode: tests/test_your_own_script_docker.py."""
from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from doeks import code, elastic, jobspec, targets
from doeks.errors import DoeksError
from doeks.runner import Runner

from .conftest import ROOT, invoke, job_settings

EXAMPLES = ROOT / "examples"
ARGS = "--steps 6 --checkpoint-every 3 --note 'two words, one arg' --lr 0.05"
SMALL = {"REPLICAS": "1", "MIN_REPLICAS": "1", "MAX_REPLICAS": "2", "NPROC_PER_NODE": "2", "MAX_RESTARTS": "1",
         "TARGET": "local"}


@pytest.fixture
def user_script(tmp_path):
    """examples/ddp-plain/train.py copied outside the repository, as a user's own project."""
    folder = tmp_path / "my-project"
    folder.mkdir()
    shutil.copyfile(EXAMPLES / "ddp-plain" / "train.py", folder / "fit.py")
    return folder / "fit.py"


def _settings(monkeypatch, **values):
    return job_settings({**SMALL, **values}, monkeypatch)


def _run(s, timeout=300):
    target = targets.get(s)
    target.submit(target.plan(targets.Job(s)), Runner(echo=False))
    return target.wait(timeout=timeout, quiet=True)


def _log(s) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(elastic.home(s).glob("runs/*/replicas/*/agent.log")))


def test_the_jobs_command_is_the_users_script_and_its_arguments_alone(user_script, state_dir, monkeypatch):
    s = _settings(monkeypatch, TRAIN_SCRIPT=str(user_script), TRAIN_ARGS=ARGS, JOB_NAME="byo-spec")
    worker = jobspec.worker_pod(jobspec.pytorchjob(s, ["--step-delay", "0"]))["containers"][0]
    assert worker["command"] == ["torchrun", "/workspace/fit.py"] and worker["workingDir"] == "/workspace"
    assert worker["args"] == shlex.split(ARGS) + ["--step-delay", "0"]  # no ImageNet flags: exactly its own
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["DOEKS_CHECKPOINT_DIR"] == "/fsx-shared/checkpoints/byo-spec" and env["SM_CHANNEL_TRAINING"] == "/fsx-shared/data"
    assert json.loads(env["SM_HOSTS"]) == ["byo-spec-worker-0"] and env["DOEKS_RUN_ID"].startswith("byo-spec-")
    # the built-in workload is just the default job: its flags, in the same place
    builtin = jobspec.worker_pod(jobspec.pytorchjob(s.with_overrides(train_script="")))["containers"][0]
    assert builtin["command"] == ["torchrun", "/workspace/train.py"] and "--data" in builtin["args"]
    assert builtin["args"][-len(shlex.split(ARGS)):] == shlex.split(ARGS)  # TRAIN_ARGS after its own
    module = code.resolve(s.with_overrides(train_script="-m my_pkg.train", train_source=str(user_script.parent)))
    assert module.launcher() == ["torchrun", "-m", "my_pkg.train"] and module.source == user_script.parent


def test_bad_settings_are_one_line_and_a_users_arguments_are_not_checked_against_doeks_parser(user_script, state_dir):
    missing = invoke("elasticjob.deploy", "--dry-run", env={"TRAIN_SCRIPT": str(user_script.parent / "nope.py")})
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines()[-1].endswith(f"TRAIN_SCRIPT={str(user_script.parent / 'nope.py')!r}: "
                                                             f"no such file ({user_script.parent / 'nope.py'})")
    quoted = invoke("elasticjob.deploy", "--dry-run", env={"TRAIN_SCRIPT": str(user_script), "TRAIN_ARGS": "--note 'x"})
    assert quoted.returncode != 0 and "Traceback" not in quoted.stderr and "TRAIN_ARGS=" in quoted.stderr
    # --steps is no flag of doeks/workload/train.py: for a user's script that is the script's business
    ok = invoke("elasticjob.deploy", "--dry-run", "--train-args", "--steps 3", env={"TRAIN_SCRIPT": str(user_script)})
    assert ok.returncode == 0, ok.stderr
    assert f"{user_script} --steps 3 (in {user_script.parent})" in ok.stderr  # run from the script's folder
    cluster = invoke("elasticjob.deploy", "--dry-run", "--train-args", "--steps 3",
                     env={"TRAIN_SCRIPT": str(user_script), "TARGET": "kubernetes"})
    worker = jobspec.worker_pod(list(yaml.safe_load_all(cluster.stdout))[-1])["containers"][0]
    assert worker["args"] == ["--steps", "3"]
    refused = invoke("elasticjob.deploy", "--dry-run", "--train-args", "--steps 3")  # the built-in one is checked
    assert refused.returncode != 0 and "unrecognized arguments: --steps 3" in refused.stderr


@pytest.mark.slow
def test_a_script_outside_the_repo_trains_locally_with_its_arguments_exactly_and_resumes(user_script, state_dir,
                                                                                        monkeypatch):
    s = _settings(monkeypatch, TRAIN_SCRIPT=str(user_script), TRAIN_ARGS=ARGS, JOB_NAME="byo-local")
    status = _run(s)
    assert status.state == "Succeeded", (status.reason, _log(s)[-3000:])
    log = _log(s)
    assert json.loads(re.search(r"argv: (.*)", log).group(1)) == shlex.split(ARGS)  # exactly, quoting and all
    assert f"cwd={user_script.parent} " in log and "world=2 " in log
    assert [r.step for r in status.replicas] == [6] and [r.total for r in status.replicas] == [6]
    assert (elastic.checkpoint_dir(s) / "checkpoint.pt").is_file()
    assert (state_dir / "volumes" / s.shared_pvc / "models" / "byo-local" / "model.pt").is_file()
    # the same job again, more steps: it resumes from its checkpoint folder (DOEKS_CHECKPOINT_DIR)
    s = s.with_overrides(train_args=ARGS.replace("--steps 6", "--steps 8"))
    status = _run(s)
    assert status.state == "Succeeded" and [r.step for r in status.replicas] == [8]
    assert re.search(r"resumed from .*checkpoint\.pt at step 6", _log(s))


@pytest.mark.slow
def test_a_script_that_raises_ends_failed_at_once_with_its_exception_and_line_as_the_reason(user_script, state_dir,
                                                                                            monkeypatch):
    """Any exception the script's own code raises (here RuntimeError, which used to crash-loop until torch's
    RendezvousClosedError was the reason) ends the job without a restart, named with its file and line; the fix names
    a logs command whose output shows the traceback."""
    monkeypatch.setenv("JOB_NAME", "byo-fail")
    _settings(monkeypatch, TRAIN_SCRIPT=str(user_script), TRAIN_ARGS="--steps 6 --fail-at 2", MAX_RESTARTS="10")
    line = next(i for i, text in enumerate(user_script.read_text().splitlines(), 1) if "raise RuntimeError(" in text)
    result = invoke("elasticjob.deploy", "--follow", timeout=300)
    own = [text for text in result.stderr.splitlines() if not text.startswith("[node-")]
    assert result.returncode != 0 and not any("Traceback" in text for text in own), result.stderr[-3000:]
    assert own[-1] == (f"error: job byo-fail ended Failed after 0 restarts: the script raised RuntimeError: --fail-at "
                       f"2: failing on purpose at step 2 (fit.py, line {line}, in main) (fix: `invoke elasticjob.logs "
                       "--errors` shows its traceback; fix the script, then `invoke elasticjob.deploy`)")
    # doeks stopping its own agents is one line each, not torch's SignalException traceback
    assert not [text for text in result.stderr.splitlines() if "SignalException" in text or "ChildFailedError" in text]
    shown = invoke("elasticjob.status")
    assert "Failed (run " in shown.stderr and ", 0 restarts" in shown.stderr
    assert f"reason: the script raised RuntimeError: --fail-at 2: failing on purpose at step 2 (fit.py, line {line}" in shown.stderr
    errors = invoke("elasticjob.logs", "--errors")
    assert errors.returncode == 0, errors.stderr
    assert f'File "{user_script}", line {line}, in main' in errors.stdout
    assert errors.stdout.count("Traceback (most recent call last):") == 1  # each distinct exception once
    assert "zygote" not in errors.stdout and "runpy" not in errors.stdout  # the script's frames, as `python fit.py`'s
    assert f"in the job's code at {user_script}, line {line}, in main" in errors.stderr


@pytest.mark.slow
def test_a_library_error_that_comes_back_after_a_restart_ends_the_job_with_one_restart_count(tmp_path, state_dir,
                                                                                            monkeypatch):
    """An error raised inside a library the script calls may pass (a lost peer): the node restarts once; the same
    error again ends the job. The restart count is one number: the state line, the table and the history agree."""
    script = tmp_path / "project" / "parse.py"
    script.parent.mkdir()
    script.write_text("import json\nimport torch.distributed as dist\n\ndist.init_process_group('gloo')\n"
                      "json.loads('{not json')\n")
    _settings(monkeypatch, TRAIN_SCRIPT=str(script), JOB_NAME="byo-again", MAX_RESTARTS="5")
    result = invoke("elasticjob.deploy", "--follow", timeout=300)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: job byo-again ended Failed after 1 restarts: the script failed with "
                           "json.decoder.JSONDecodeError: Expecting property name enclosed in double quotes: line 1 "
                           "column 2 (char 1) (parse.py, line 5, in <module>), the same after a restart"), result.stderr[-3000:]
    shown = invoke("elasticjob.status", env={"COLUMNS": "250"})
    assert ", 1 restarts" in shown.stderr and "│ Failed │ 1 " in shown.stderr, shown.stderr


@pytest.mark.slow
def test_max_restarts_is_honoured_and_named(tmp_path, state_dir, monkeypatch):
    """An error that differs at every restart never counts as the same: the node restarts until MAX_RESTARTS, not
    further (torchrun's restarts and the node's together), and the reason says so."""
    script = tmp_path / "project" / "flaky.py"
    script.parent.mkdir()
    script.write_text("import ipaddress, time\nimport torch.distributed as dist\n\ndist.init_process_group('gloo')\n"
                      "ipaddress.ip_address(f'x{time.time_ns()}')\n")  # raised in the standard library, never twice the same
    _settings(monkeypatch, TRAIN_SCRIPT=str(script), JOB_NAME="byo-flaky", MAX_RESTARTS="2")
    result = invoke("elasticjob.deploy", "--follow", timeout=300)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: job byo-flaky ended Failed after 2 restarts: restart limit: node-0 restarted 2 "
                           "times (MAX_RESTARTS=2), last error: ValueError: 'x"), result.stderr[-3000:]
    log = _log(_settings(monkeypatch, JOB_NAME="byo-flaky"))
    assert log.count("doeks: worker group failed") + log.count("start #") - 1 == 2  # torchrun's + the node's: 2


@pytest.mark.slow
def test_a_script_that_reports_nothing_shows_no_step_count_and_no_made_up_result(tmp_path, state_dir, monkeypatch):
    (tmp_path / "quiet.py").write_text("import os, sys\nprint('quiet rank', os.environ['RANK'], sys.argv[1:])\n")
    _settings(monkeypatch, TRAIN_SCRIPT=str(tmp_path / "quiet.py"), JOB_NAME="byo-quiet")
    result = invoke("elasticjob.deploy", "--follow", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "job byo-quiet succeeded: no step count (the script reports none" in result.stderr
    assert "nan" not in result.stderr and "/200" not in result.stderr and "accuracy" not in result.stderr
    shown = invoke("elasticjob.status")
    assert "no step count" in shown.stdout + shown.stderr and "Succeeded" in shown.stdout + shown.stderr


@pytest.mark.slow
def test_the_sagemaker_style_example_runs_locally_with_the_sm_environment(state_dir, monkeypatch):
    s = _settings(monkeypatch, TRAIN_SCRIPT=str(EXAMPLES / "sagemaker-style" / "train.py"),
                  TRAIN_ARGS="--epochs 2 --learning-rate 0.2", JOB_NAME="byo-sm")
    status = _run(s)
    assert status.state == "Succeeded", (status.reason, _log(s)[-3000:])
    log = _log(s)
    data = state_dir / "volumes" / s.shared_pvc / "data"
    assert f"host byo-sm-worker-0 of ['byo-sm-worker-0'], world 2, channels {{'training': '{data}'}}" in log
    assert (state_dir / "volumes" / s.shared_pvc / "models" / "byo-sm" / "model.pt").is_file()
    assert [r.step for r in status.replicas] == [8] and status.replicas[0].samples_per_s  # doeks.report's rate


def test_report_prints_the_documented_line(capsys, monkeypatch):
    import doeks

    monkeypatch.setenv("WORLD_SIZE", "4")
    doeks._last_report.clear()
    assert doeks.report(step=1, loss=0.5) == "doeks: step=1 loss=0.5 world=4"
    line = doeks.report(step=2, loss=0.25, samples=32, total=10)
    from doeks.local.jobs import parse_progress

    progress = parse_progress(capsys.readouterr().out)
    assert progress["step"] == 2 and progress["loss"] == 0.25 and progress["world"] == 4 and progress["total"] == 10
    assert progress["samples_per_s"] > 0 and line.startswith("doeks: step=2 loss=0.25 samples/s=")
    with pytest.raises(DoeksError):
        code.resolve(_FakeSettings(train_script="notes.txt"))


class _FakeSettings:
    def __init__(self, **values):
        self.__dict__.update({"train_script": "", "train_source": "", "train_args": "", "train_requirements": ""}, **values)


REGISTRY = "123456789012.dkr.ecr.us-west-2.amazonaws.com"


def test_eks_dry_run_names_the_users_image_and_command_and_a_process_per_gpu(user_script, state_dir):
    env = {"TARGET": "eks", "TRAIN_SCRIPT": str(user_script), "TRAIN_ARGS": "--steps 100 --note 'a b'",
           "REGISTRY": REGISTRY, "JOB_NAME": "byo-eks", "GPU_INSTANCE_TYPE": "p4d.24xlarge"}
    built = invoke("elasticjob.build", "--dry-run", env=env)
    assert built.returncode == 0, built.stderr
    image = re.search(r"training image: (\S+)", built.stderr).group(1)
    out = invoke("elasticjob.deploy", "--dry-run", env=env)
    assert out.returncode == 0, out.stderr
    job = list(yaml.safe_load_all(out.stdout))[-1]
    worker = jobspec.worker_pod(job)["containers"][0]
    assert worker["image"] == image and image.startswith(f"{REGISTRY}/doeks-train:")
    assert worker["command"] == ["torchrun", "/workspace/fit.py"] and worker["args"] == ["--steps", "100", "--note", "a b"]
    assert job["spec"]["nprocPerNode"] == "8" and worker["resources"]["limits"]["nvidia.com/gpu"] == 8  # all 8 GPUs
    assert "warning: NPROC_PER_NODE" not in out.stderr  # all 8 GPUs used: no idle-GPU warning
    # the image of this code is built nowhere here: the plan says so, with the command that builds and pushes it
    assert (f"is not built on this machine; unless it is in the registry already, the pods cannot pull it: `TARGET=eks "
            f"TRAIN_SCRIPT={user_script} REGISTRY={REGISTRY} invoke elasticjob.build elasticjob.push`") in out.stderr
    # the image is the user's code: another script is another tag
    other = user_script.parent / "other.py"
    other.write_text("print('other')\n")
    assert re.search(r"training image: (\S+)", invoke("elasticjob.build", "--dry-run", env={
        **env, "TRAIN_SCRIPT": str(other)}).stderr).group(1) != image
    g5 = list(yaml.safe_load_all(invoke("elasticjob.deploy", "--dry-run", env={**env, "GPU_INSTANCE_TYPE": "g5.12xlarge"}).stdout))
    assert g5[-1]["spec"]["nprocPerNode"] == "4"
    idle = invoke("elasticjob.deploy", "--dry-run", env={**env, "NPROC_PER_NODE": "2"})
    assert idle.returncode == 0 and ("warning: NPROC_PER_NODE=2 uses 2 of the 8 GPUs of each p4d.24xlarge node: 6 idle"
                                     in idle.stderr)
    for task in ("efa.test", "kubeflow.trainjob.submit"):  # the NCCL test and the TrainJob say so too
        shown = invoke(task, "--dry-run", env={**env, "NPROC_PER_NODE": "2"})
        assert shown.returncode == 0 and "6 idle" in shown.stderr, (task, shown.stderr[-2000:])


def test_the_pipelines_kubernetes_and_sagemaker_branches_run_the_users_script(user_script, state_dir, monkeypatch):
    import base64
    import io
    import tarfile

    from doeks import pipeline

    (user_script.parent / "helpers.py").write_text("X = 1\n")
    s = _settings(monkeypatch, TRAIN_SCRIPT=str(user_script), TRAIN_ARGS="--steps 7 --note 'a b'", REGISTRY=REGISTRY,
                  JOB_NAME="byo-kfp")
    for kind in ("trainjob", "pytorchjob"):
        args = pipeline.arguments(s.with_overrides(pipeline_job_kind=kind), "kubernetes")
        assert args["steps"] == 0  # no --max-steps for a script that does not know it
        job = json.loads(args["job"])
        container = job["spec"]["trainer"] if kind == "trainjob" else jobspec.worker_pod(
            {"spec": {"pytorchReplicaSpecs": {"Worker": job["spec"]["pytorchReplicaSpecs"]["Master"]}}})["containers"][0]
        assert container["command"] == ["torchrun", "/workspace/fit.py"] and container["args"] == ["--steps", "7", "--note", "a b"]
        assert {e["name"] for e in container["env"]} >= {"DOEKS_CHECKPOINT_DIR", "SM_MODEL_DIR", "SM_HOSTS"}
    request = json.loads(args["sagemaker_request"])
    assert request["HyperParameters"]["sagemaker_program"] == "fit.py"
    assert {k: v for k, v in request["HyperParameters"].items() if not k.startswith("sagemaker_")} == {"steps": "7", "note": "a b"}
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(args["source_tar_b64"]))) as tar:
        assert sorted(tar.getnames()) == ["fit.py", "helpers.py"]  # the source folder is the source archive
    with pytest.raises(DoeksError, match="local branch runs the built-in ImageNet workload only"):
        pipeline.arguments(s, "local")


def test_an_exception_is_the_scripts_reason_only_when_its_own_code_raised_it():
    from doeks.pod import reasons

    mine = ["Traceback (most recent call last):", '  File "/workspace/fit.py", line 9, in <module>', "ValueError: boom"]
    assert reasons.from_lines(mine).text == "the script raised ValueError: boom (fit.py, line 9, in <module>)"
    assert reasons.from_lines(mine).permanent
    # the etcd client's own IndexError when the rendezvous server is gone is no bug of the script
    library = ["Traceback (most recent call last):",
               '  File "/usr/lib/python3.11/site-packages/etcd/client.py", line 3, in api_execute',
               "IndexError: pop from empty list"]
    assert reasons.from_lines(library) is None
    assert reasons.last_error(["RuntimeError: NCCL boom", "torch.distributed.elastic.rendezvous.api.RendezvousClosedError",
                               "  error_file: <N/A>"]) == "RuntimeError: NCCL boom"

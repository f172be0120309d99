"""A job is named by its code, and lives under its name: the demo stays `imagenet`, the examples and a user's script
get their own names (checkpoints, metrics, models, runs), so one never reads another's state; `--job-name` on every
job task; a checkpoint of another model is refused with its folder and --fresh; the help of every flag is right."""
from __future__ import annotations

import hashlib
import re
import shutil

import pytest

from doeks import code, elastic, jobpaths
from doeks import settings as S

from .conftest import ROOT, invoke, job_settings

EXAMPLES = ROOT / "examples"


def test_the_job_name_comes_from_the_code_and_the_folders_from_one_function():
    assert S.job_name_of("") == "imagenet" and S.job_name_of("doeks/workload/train.py") == "imagenet"
    assert S.job_name_of("examples/ddp-plain/train.py") == "ddp-plain"
    assert S.job_name_of("examples/sagemaker-style/train.py") == "sagemaker-style"
    assert S.job_name_of("/home/me/cifar/src/main.py") == "cifar" and S.job_name_of("/home/me/fit_v2.py") == "fit-v2"
    assert S.job_name_of("-m my_pkg.train") == "my-pkg" and S.job_name_of("/x/2nd_Try.py") == "nd-try"
    s = S.load(environ={"TRAIN_SCRIPT": "examples/ddp-plain/train.py"}, path=ROOT / ".env")
    assert s.job_name == "ddp-plain" and s.with_overrides(train_script="").job_name == "imagenet"
    assert s.with_overrides(job_name="mine").job_name == "mine"  # JOB_NAME (or --job-name) wins
    assert S.load(environ={"JOB_NAME": "x", "TRAIN_SCRIPT": "a/fit.py"}, path=ROOT / ".env").job_name == "x"
    env = code.contract(s, "/fsx-shared", "run", [])
    assert env["DOEKS_CHECKPOINT_DIR"] == jobpaths.checkpoint_uri(s) == "/fsx-shared/checkpoints/ddp-plain"
    assert env["DOEKS_MODEL_DIR"] == env["SM_MODEL_DIR"] == jobpaths.job_folder(s, "models") == "/fsx-shared/models/ddp-plain"
    assert str(elastic.checkpoint_dir(s)) == jobpaths.checkpoint_uri(s, str(elastic.data_root(s).parent))
    shown = invoke("config", "--key", "JOB_NAME", env={"TRAIN_SCRIPT": "examples/ddp-plain/train.py", "COLUMNS": "200"})
    assert "ddp-plain" in shown.stdout and "from TRAIN_SCRIPT" in shown.stdout, shown.stdout


def test_every_job_task_takes_job_name_and_every_flag_has_a_true_help():
    """`invoke --help elasticjob.deploy` showed `--=STRING, --train-requirements=STRING`: invoke gave the flag the
    '-' of its name as its short flag once the letters before it were taken. Every task's flags, read as invoke builds
    them: alphanumeric short flags, a help text each."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("doeks_root_tasks_help", ROOT / "tasks.py")
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)
    names = root.ns.task_names
    job_tasks = ("deploy", "status", "describe", "logs", "history", "scale", "delete", "artifacts", "plot", "scaling",
                 "tensorboard")
    for task in job_tasks:
        assert "job_name" in [a.attr_name or a.name for a in root.ns[f"elasticjob.{task}"].get_arguments()], task
    root = importlib.util.module_from_spec(spec)  # get_arguments takes the help texts: a fresh load for the rest
    spec.loader.exec_module(root)
    for name in names:
        for argument in root.ns[name].get_arguments():
            short = [n for n in argument.names if len(n) == 1]
            assert all(n.isalnum() for n in short), (name, argument.names)
            assert argument.help, (name, argument.names)  # efa.report's --file had none
    shown = invoke("--help", "elasticjob.deploy").stdout
    assert "--=STRING" not in shown and "--train-requirements=STRING" in shown


def _md5(path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _demo_state(s):
    """What the Quickstart (`invoke setup demo`) leaves: the demo's ResNet-18 checkpoint and model under its name."""
    import torch

    from doeks.workload import train

    model = train.build_model("resnet18", s.data_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    folder = elastic.checkpoint_dir(s)
    folder.mkdir(parents=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 100, "epoch": 4,
                "arch": "resnet18"}, folder / "checkpoint.pt")
    models = elastic.job_dir(s, "models")
    models.mkdir(parents=True)
    torch.save(model.state_dict(), models / "model.pt")
    return [folder / "checkpoint.pt", models / "model.pt"]


@pytest.mark.slow
def test_the_examples_and_a_users_script_run_after_the_quickstart_and_leave_the_demos_model_alone(
        tmp_path, state_dir, monkeypatch):
    """The example's own command after the Quickstart used to load the demo's ResNet checkpoint (Unexpected key(s)),
    crash-loop 31 times and, with --fresh, overwrite the demo's model: each job now has its own folders."""
    s = job_settings({"REPLICAS": "1", "MIN_REPLICAS": "1", "MAX_REPLICAS": "1", "NPROC_PER_NODE": "2",
                      "TARGET": "local"}, monkeypatch)
    assert s.job_name == "imagenet"
    demo = _demo_state(s)
    before = [_md5(path) for path in demo]
    mine = tmp_path / "my-project" / "fit.py"
    mine.parent.mkdir()
    shutil.copyfile(EXAMPLES / "ddp-plain" / "train.py", mine)
    for script, args, name in ((EXAMPLES / "ddp-plain" / "train.py", "--steps 6", "ddp-plain"),
                               (EXAMPLES / "sagemaker-style" / "train.py", "--epochs 1", "sagemaker-style"),
                               (mine, "--steps 4", "fit"), (EXAMPLES / "ddp-plain" / "train.py", "--steps 6", "ddp-plain")):
        result = invoke("elasticjob.deploy", "--follow", env={"TRAIN_SCRIPT": str(script), "TRAIN_ARGS": args}, timeout=300)
        assert result.returncode == 0, (name, result.stderr[-3000:])
        last = result.stderr.strip().splitlines()[-1]
        assert re.fullmatch(rf"job {name} succeeded: \d+ steps in (\d+m)?\d+s; model: \S+/models/{name}/model.pt", last), last
        assert (state_dir / "volumes" / "fsx-pvc" / "checkpoints" / name).is_dir() or name == "sagemaker-style"
    assert [_md5(path) for path in demo] == before  # the demo's checkpoint and model untouched
    # the tasks find a job by its name; without one they mean the one deployed last (doeks.lastjob)
    status = invoke("elasticjob.status", "--job-name", "sagemaker-style")
    assert "job sagemaker-style on local: Succeeded" in status.stderr, status.stderr
    assert "job ddp-plain on local" in invoke("elasticjob.status").stderr
    history = invoke("elasticjob.history", "--job-name", "ddp-plain", env={"COLUMNS": "250"})
    assert history.stderr.count("examples/ddp-plain/train.py --steps 6") == 2, history.stderr


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_refused_naming_its_folder_and_fresh(tmp_path, state_dir, monkeypatch):
    mine = tmp_path / "my-project" / "fit.py"
    mine.parent.mkdir()
    shutil.copyfile(EXAMPLES / "ddp-plain" / "train.py", mine)
    s = job_settings({"REPLICAS": "1", "MIN_REPLICAS": "1", "MAX_REPLICAS": "1", "NPROC_PER_NODE": "1",
                      "TARGET": "local", "TRAIN_SCRIPT": str(mine), "TRAIN_ARGS": "--steps 4"}, monkeypatch)
    folder = _demo_state(s.with_overrides(job_name="fit"))[0].parent  # another model's checkpoint in fit's folder
    line = next(i for i, text in enumerate(mine.read_text().splitlines(), 1) if "model.load_state_dict(" in text)
    result = invoke("elasticjob.deploy", "--follow", timeout=300)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: job fit ended Failed after 0 restarts: a checkpoint that does not fit the model: "
                           "RuntimeError: Error(s) in loading state_dict for Linear: "
                           f"(fit.py, line {line}, in main)"), result.stderr[-3000:]
    assert last.endswith(f"(fix: {folder} holds a checkpoint of another model: `invoke elasticjob.deploy --fresh` "
                         "starts over (or move that folder away, or give this job its own --job-name))"), last
    assert invoke("elasticjob.deploy", "--follow", "--fresh", timeout=300).returncode == 0


TOOLS = ("build", "run", "exec", "stop", "logs", "push", "pull", "login", "test")


def test_the_tools_containers_tasks_say_so_and_point_to_the_jobs():
    """The root `build run exec status logs ...` are the tools container's (the design keeps them at the root): a
    user typing `invoke logs` for the job got "container doeks is not there"."""
    listing = invoke("--list", env={"COLUMNS": "300"}).stdout
    lines: dict[str, str] = {}
    for line in listing.splitlines():
        if line.startswith("  ") and line[2] != " ":
            name = line.split()[0]
            lines[name] = line
        elif line.startswith("   ") and lines:
            lines[name] += " " + line.strip()  # invoke wraps a long help
    for name in TOOLS:
        assert "Tools container" in lines[name], lines[name]
    assert "`invoke elasticjob.logs`" in lines["logs"] and "`invoke elasticjob.status`" in lines["status"]


@pytest.mark.docker
def test_invoke_logs_without_the_tools_container_points_to_the_jobs_logs(docker_client, state_dir):
    result = invoke("logs", env={"DOEKS_CONTAINER_NAME": "doeks-no-such-container"})
    assert result.returncode == 1 and result.stderr.strip() == (
        "error: the tools container doeks-no-such-container is not running (`invoke run` starts it); the training "
        "job's logs: `invoke elasticjob.logs`")


def test_a_second_script_under_a_name_another_ran_is_refused(tmp_path, state_dir):
    """fit.py of two projects take the same name: the second would resume from the first's checkpoint."""
    first, second = tmp_path / "one" / "fit.py", tmp_path / "two" / "fit.py"
    for script in (first, second):
        script.parent.mkdir()
        script.write_text("print('fit')\n")
    s = S.load(environ={"TRAIN_SCRIPT": str(first), "STATE_DIR": str(state_dir)}, path=ROOT / ".env")
    from doeks.targets import runs

    runs.start(s, "local", "20261125-000000-0001", code=code.resolve(s))
    refused = invoke("elasticjob.deploy", "--dry-run", env={"TRAIN_SCRIPT": str(second)})
    assert refused.returncode == 1 and refused.stderr.strip() == (
        f"error: job fit ran {first}, not {second}: its checkpoints and model are that script's; deploy this one with "
        "--job-name <another name> (or --fresh to start fit over with it)")
    assert invoke("elasticjob.deploy", "--dry-run", env={"TRAIN_SCRIPT": str(first)}).returncode == 0
    assert invoke("elasticjob.deploy", "--dry-run", "--job-name", "fit-two", env={"TRAIN_SCRIPT": str(second)}).returncode == 0

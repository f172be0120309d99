"""The training image's default command (doeks.pod.launch, `doeks-launch`): what it runs for each launcher's environment,
read with torch's own torchrun parser. The image runs it for real in tests/test_your_own_script_docker.py (torchrun
flags, SageMaker's `train` on two hosts) and tests/test_kubernetes_sdk.py (Kubeflow Trainer's and the training
operator's pods)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from doeks.pod import launch

from .conftest import ROOT

IMAGE = {"DOEKS_TRAIN_SCRIPT": "/workspace/train.py", "PATH": "/usr/bin:/bin"}
# what Kubeflow Trainer v2.3.0's torch plugin gives the node container (pkg/runtime/framework/plugins/torch/torch.go)
TRAINER = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "j-node-0-0.j",
           "PET_MASTER_PORT": "29400"}
# the training operator v1.9.4 for a PyTorchJob with a Master (pkg/controller.v1/pytorch/envvar.go, master.go)
OPERATOR = {"MASTER_ADDR": "j-master-0", "MASTER_PORT": "23456", "PET_MASTER_ADDR": "j-master-0",
            "PET_MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1", "PET_NODE_RANK": "1", "PET_NNODES": "2"}


def test_kubeflow_trainer_and_the_training_operator_need_nothing_added_torchrun_reads_pet_variables():
    for env in (TRAINER, OPERATOR):
        got = launch.plan([], {**IMAGE, **env})
        assert got.argv == ["torchrun", "/workspace/train.py"] and got.source == "Kubeflow (PET_* variables)"
    # the arguments a tool gives (a TrainJob's trainer.args, `kubectl run IMAGE -- ...`) go to the image's script
    got = launch.plan(["--epochs", "1", "--max-steps", "3"], {**IMAGE, **TRAINER})
    assert got.argv == ["torchrun", "/workspace/train.py", "--epochs", "1", "--max-steps", "3"]
    # none given: DOEKS_TRAIN_ARGS (what a tool with only environment variables can set)
    got = launch.plan([], {**IMAGE, **TRAINER, "DOEKS_TRAIN_ARGS": "--note 'two words'"})
    assert got.argv == ["torchrun", "/workspace/train.py", "--note", "two words"]


def test_master_addr_world_size_and_rank_alone_are_one_process_per_pod():
    env = {**IMAGE, "MASTER_ADDR": "j-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2"}
    got = launch.plan([], env)
    assert got.argv == ["torchrun", "--nnodes", "3", "--node-rank", "2", "--nproc-per-node", "1", "--master-addr",
                        "j-master-0", "--master-port", "23456", "/workspace/train.py"]


def test_torchrun_flags_then_the_images_script_and_its_arguments():
    got = launch.plan(["--nnodes", "1", "--nproc-per-node=2", "--", "--steps", "3"], IMAGE)
    assert got.argv == ["torchrun", "--nnodes", "1", "--nproc-per-node=2", "/workspace/train.py", "--steps", "3"]
    assert got.source == "torchrun options"
    # without `--`: the first argument torchrun does not know starts the script's
    got = launch.plan(["--standalone", "--nproc_per_node", "2", "--steps", "3"], IMAGE)
    assert got.argv == ["torchrun", "--standalone", "--nproc_per_node", "2", "/workspace/train.py", "--steps", "3"]
    assert launch.plan(["--standalone", "--", "--steps", "3"], IMAGE).source == "torchrun options"
    got = launch.plan([], IMAGE)  # `docker run IMAGE`: one node, one process
    assert got.argv == ["torchrun", "/workspace/train.py"] and got.source == "one node (no launcher variables)"
    # `--` with nothing after it: no arguments, not DOEKS_TRAIN_ARGS
    assert launch.plan(["--"], {**IMAGE, "DOEKS_TRAIN_ARGS": "--x 1"}).argv == ["torchrun", "/workspace/train.py"]


def test_a_script_or_module_named_replaces_the_images():
    got = launch.plan(["--nproc-per-node", "2", "other.py", "--lr", "0.1"], IMAGE)
    assert got.argv == ["torchrun", "--nproc-per-node", "2", "other.py", "--lr", "0.1"]
    got = launch.plan(["-m", "pkg.train", "--lr", "0.1"], IMAGE)
    assert got.argv == ["torchrun", "-m", "pkg.train", "--lr", "0.1"]
    got = launch.plan([], {**IMAGE, "DOEKS_TRAIN_SCRIPT": "-m pkg.train"})
    assert got.argv == ["torchrun", "-m", "pkg.train"]


def test_a_command_runs_as_it_is():
    assert launch.plan(["sh", "-c", "echo hi"], IMAGE).argv == ["sh", "-c", "echo hi"]
    # doeks' own containers on docker and SageMaker local mode name torchrun themselves
    env = {**IMAGE, "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin"}
    assert launch.plan([os.path.basename(sys.executable), "-V"], env).source == "a command"


def _sagemaker_root(tmp_path, current: str, program: str | None = None):
    config = tmp_path / "input" / "config"
    config.mkdir(parents=True)
    (config / "resourceconfig.json").write_text(json.dumps({"current_host": current, "hosts": ["algo-1", "algo-2"]}))
    hyper = {"steps": "4", "note": "two words"}
    if program:
        hyper["sagemaker_program"] = program
        (tmp_path / "code").mkdir()
        (tmp_path / "code" / program).write_text("print('hi')\n")
    (config / "hyperparameters.json").write_text(json.dumps(hyper))
    (config / "inputdataconfig.json").write_text(json.dumps({"training": {}, "val": {}}))
    return str(tmp_path)


def test_sagemaker_train_one_node_per_host_hyperparameters_as_arguments(tmp_path):
    got = launch.plan(["train"], {**IMAGE, "SM_CHANNEL_TRAINING": "/mine"}, root=_sagemaker_root(tmp_path, "algo-2"))
    assert got.argv == ["torchrun", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--master-addr",
                        "algo-1", "--master-port", "7777", "/workspace/train.py", "--steps", "4", "--note", "two words"]
    assert got.env["SM_HOSTS"] == '["algo-1", "algo-2"]' and got.env["SM_CURRENT_HOST"] == "algo-2"
    assert got.env["SM_MODEL_DIR"] == "/opt/ml/model" and got.env["SM_CHANNEL_VAL"] == "/opt/ml/input/data/val"
    assert "SM_CHANNEL_TRAINING" not in got.env  # what the platform or the user set stays
    assert json.loads(got.env["SM_HPS"]) == {"steps": "4", "note": "two words"}
    assert got.source == "SageMaker (host algo-2 of 2)"


def test_sagemaker_runs_the_program_it_brought_in_opt_ml_code(tmp_path):
    got = launch.plan(["train"], IMAGE, root=_sagemaker_root(tmp_path, "algo-1", program="fit.py"))
    assert got.argv[got.argv.index("--master-port") + 2:] == ["/opt/ml/code/fit.py", "--steps", "4", "--note", "two words"]
    assert got.argv[got.argv.index("--node-rank") + 1] == "0" and got.cwd == "/opt/ml/code"


def test_doeks_names_for_sagemakers_folders_are_the_submit_paths():
    from doeks import sagemaker

    assert launch.DOEKS_ON_SAGEMAKER == sagemaker.ENVIRONMENT


@pytest.mark.parametrize("args, env, said", [
    ([], {"PATH": "/usr/bin"}, "no script named and the image has none (DOEKS_TRAIN_SCRIPT is empty)"),
    (["--nnodes"], IMAGE, "torchrun's --nnodes needs a value"),
])
def test_bad_input_is_one_line_and_exit_2(args, env, said):
    result = subprocess.run([sys.executable, "-m", "doeks.pod.launch", *args], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"doeks-launch: error: {said}") and result.stderr.count("\n") == 1


def test_a_module_flag_without_a_module_is_refused():
    with pytest.raises(launch.LaunchError, match="-m names no module"):
        launch.plan(["-m"], IMAGE, options={"--nnodes": 1})

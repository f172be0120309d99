"""The job as one value (`Target.job`): its code, image and world resolved once and handed to the target's verbs
(doeks/code.py was entered four times on one `elasticjob.deploy` to TARGET=kubernetes); one world for one `.env` on
every target, SageMaker local mode included, or a line saying why it differs; the image follows the code (a deploy
builds the image it lacks where it runs it here, or names the exact command)."""
from __future__ import annotations

import importlib.util
import re

import pytest

from doeks import code, trainimage
from doeks import settings as S
from doeks import targets

from .conftest import ROOT, invoke


def _elasticjob_tasks():
    spec = importlib.util.spec_from_file_location("doeks_unit_elasticjob_test", ROOT / "elasticjob" / "tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("target", ["local", "docker", "kubernetes", "eks", "sagemaker"])
def test_one_deploy_resolves_the_jobs_code_once(target, state_dir, monkeypatch, capsys):
    tasks = _elasticjob_tasks()
    calls = []
    resolve = code.resolve

    def counted(settings):
        calls.append(settings.job_name)
        return resolve(settings)

    monkeypatch.setattr(code, "resolve", counted)
    for key, value in {"TARGET": target, "KUBECONFIG": "", "REGISTRY": "123456789012.dkr.ecr.us-west-2.amazonaws.com",
                       "TRAIN_SCRIPT": str(ROOT / "examples" / "ddp-plain" / "train.py"), "TRAIN_ARGS": "--steps 3"}.items():
        monkeypatch.setenv(key, value)
    S.reset()
    tasks.deploy.body(None, dry_run=True)
    assert calls == ["ddp-plain"], calls  # once, in Target.job
    assert "world " in capsys.readouterr().err


def test_one_env_is_one_world_on_every_target_or_a_line_says_why(state_dir):
    env = {"REPLICAS": "2", "NPROC_PER_NODE": "2", "SAGEMAKER_INSTANCE_COUNT": "2", "KUBECONFIG": "",
           "REGISTRY": "123456789012.dkr.ecr.us-west-2.amazonaws.com"}
    for target in ({"TARGET": "local"}, {"TARGET": "docker"}, {"TARGET": "kubernetes"},
                   {"TARGET": "sagemaker", "SAGEMAKER_LOCAL": "true"}):
        shown = invoke("elasticjob.deploy", "--dry-run", env={**env, **target})
        assert shown.returncode == 0, (target, shown.stderr[-2000:])
        assert "world 4 = 2 nodes x 2 processes\n" in shown.stderr, (target, shown.stderr[-2000:])
    # SageMaker local mode ran --nnodes 2 --nproc_per_node 1 (world 2) where the others ran 4
    local_mode = invoke("elasticjob.deploy", "--dry-run", env={**env, "TARGET": "sagemaker", "SAGEMAKER_LOCAL": "true"})
    assert re.findall(r"torchrun --nnodes 2 --nproc_per_node 2 --node_rank [01] ", local_mode.stderr) == [
        "torchrun --nnodes 2 --nproc_per_node 2 --node_rank 0 ", "torchrun --nnodes 2 --nproc_per_node 2 --node_rank 1 "]
    other = invoke("elasticjob.deploy", "--dry-run", env={**env, "TARGET": "sagemaker", "SAGEMAKER_LOCAL": "true",
                                                          "SAGEMAKER_INSTANCE_COUNT": "3"})
    assert ("world 6 = 3 nodes x 2 processes (SAGEMAKER_INSTANCE_COUNT=3 hosts, where the other targets start "
            "REPLICAS=2 nodes)") in other.stderr
    real = invoke("elasticjob.deploy", "--dry-run", env={**env, "TARGET": "sagemaker",
                                                         "SAGEMAKER_INSTANCE_TYPE": "ml.g5.12xlarge"})
    assert "world 8 = 2 nodes x 4 processes (SageMaker runs one process per GPU of ml.g5.12xlarge, not NPROC_PER_NODE)" \
        in real.stderr, real.stderr[-2000:]


def test_the_command_that_builds_a_jobs_image_carries_what_chose_it(monkeypatch):
    monkeypatch.setenv("TARGET", "docker")
    monkeypatch.delenv("TRAIN_SCRIPT", raising=False)
    s = S.load(path=ROOT / ".env").with_overrides(train_script="examples/ddp-plain/train.py")
    assert trainimage.command(s, "elasticjob.build") == ("TARGET=docker TRAIN_SCRIPT=examples/ddp-plain/train.py "
                                                        "invoke elasticjob.build")
    job = targets.get(s).job()
    assert job.image == trainimage.reference(s, True) and job.code.entry == "train.py" and job.world.size == 4


@pytest.mark.docker
def test_a_docker_deploy_plans_the_build_of_the_image_it_lacks(docker_client, state_dir, tmp_path):
    """`deploy --train-script X` said "image A is not built: run `invoke elasticjob.build`", which built (or found up
    to date) the .env's image B: the deploy builds A itself, saying so and as which command."""
    script = tmp_path / "never-built-here" / "fit.py"
    script.parent.mkdir()
    script.write_text("print('a script whose image nobody built')\n")
    shown = invoke("elasticjob.deploy", "--dry-run", "--train-script", str(script), env={"TARGET": "docker"})
    assert shown.returncode == 0, shown.stderr
    image = re.search(r"would build the training image (doeks-train:\w+): none is built for this code", shown.stderr)
    assert image and f"as `TARGET=docker TRAIN_SCRIPT={script} invoke elasticjob.build` does" in shown.stderr
    assert f"image {image.group(1)}," in shown.stderr  # the image the containers run

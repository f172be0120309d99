"""Your own training code in containers, for real: `elasticjob.build` puts a user's script (outside the repository)
and its requirements on the CPU training base, and the same settings train it on TARGET=docker and in SageMaker
local mode with its arguments exactly; a script that raises ends Failed with its exception as the reason on both."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import tarfile
import uuid

import pytest

from doeks import trainimage

from .conftest import ROOT, invoke

pytestmark = [pytest.mark.slow, pytest.mark.docker]

ARGS = "--steps 4 --checkpoint-every 2 --note 'two words, one arg'"
JOB = {"TARGET": "docker", "REPLICAS": "1", "MIN_REPLICAS": "1", "MAX_REPLICAS": "1", "NPROC_PER_NODE": "2",
       "MAX_RESTARTS": "0", "TRAIN_BASE_IMAGE": trainimage.CPU_BASE, "JOB_NAME": "byo-docker", "SAGEMAKER_INSTANCE_COUNT": "2",
       "SAGEMAKER_INSTANCE_TYPE": "ml.m5.large"}


@pytest.fixture(scope="module")
def client(docker_client):
    return docker_client


@pytest.fixture
def job_env(client, state_dir, tmp_path, monkeypatch):
    folder = tmp_path / "my-project"
    folder.mkdir()
    # the example, with every rank writing lines at once, each in five writes as `python -u` prints them (each must
    # reach the container's log whole: with stock torchrun 274 of 1,200 such lines ran together, `i=26hello rank=0`)
    text = (ROOT / "examples" / "ddp-plain" / "train.py").read_text()
    (folder / "fit.py").write_text(text.replace("    torch.manual_seed(0)\n", "    for i in range(100):\n        print("
                                                "f'hello rank={rank}', f'i={i}', 'x' * 60, flush=True)\n    torch.manual_seed(0)\n", 1)
                                   + f"# this test's own copy ({uuid.uuid4().hex}): an image no earlier run built\n")
    (folder / "requirements.txt").write_text("python-etcd\n")  # in the base already: installed without a download
    env = {**JOB, "TRAIN_SCRIPT": str(folder / "fit.py"), "TRAIN_ARGS": ARGS}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield env
    for container in client.containers.list(all=True, filters={"label": "doeks/job=byo-docker"}):
        container.remove(force=True)
    from doeks import code, settings

    settings.reset()
    try:  # this copy's image: its layers but the last few are the base's, which stays
        client.images.remove(trainimage.local_ref(trainimage.CPU_BASE, code.resolve(settings.current())), noprune=False)
    except Exception:  # noqa: BLE001 - never built (a test that failed before), or in use
        pass


def _argv(text: str) -> list[list[str]]:
    return [json.loads(m) for m in re.findall(r"argv: (\[.*\])", text)]


def test_a_users_script_trains_on_docker_and_sagemaker_local_mode_from_the_same_settings(client, job_env, state_dir):
    # no `elasticjob.build` first: the deploy builds the image of this code, saying so, and that is the image the
    # command it names finds up to date (it used to say "not built: run `invoke elasticjob.build`", which built another)
    docker = invoke("elasticjob.deploy", "--follow", timeout=1800)
    assert docker.returncode == 0, docker.stderr[-4000:]
    planned = re.search(r"^build the training image (\S+): none is built for this code", docker.stderr, re.M)
    assert planned, docker.stderr[:3000]
    built = invoke("elasticjob.build", timeout=1800)
    assert built.returncode == 0, built.stderr[-3000:]
    image = re.search(r"training image: (\S+)", built.stderr).group(1)
    assert image == planned.group(1) and f"training image {image} is up to date" in built.stderr
    listing = client.containers.run(image, ["sh", "-c", "pwd; ls; python3 -c 'import doeks; print(doeks.report(step=1))'"],
                                    entrypoint=[], remove=True, network_mode="host").decode()
    assert listing.split() == ["/workspace", "fit.py", "requirements.txt", "doeks:", "step=1", "doeks:", "step=1"]
    assert _argv(docker.stderr) == [shlex.split(ARGS)]  # exactly, quoting and all
    assert re.search(r"job byo-docker succeeded: 4 steps in (\d+m)?\d+s; model: \S+/models/byo-docker/model.pt$",
                     docker.stderr.strip().splitlines()[-1]) and "nan" not in docker.stderr
    hello = [line for line in docker.stderr.splitlines() if "hello" in line]
    assert len(hello) == 200 and all(re.fullmatch(r"\[node-0\] hello rank=[0-3] i=\d+ x{60}", line) for line in hello), \
        [line for line in hello if not re.fullmatch(r"\[node-0\] hello rank=[0-3] i=\d+ x{60}", line)][:5]
    assert (state_dir / "volumes" / "fsx-pvc" / "models" / "byo-docker" / "model.pt").is_file()

    sm = {"TARGET": "sagemaker", "SAGEMAKER_LOCAL": "true"}
    assert invoke("elasticjob.build", env=sm, timeout=1800).returncode == 0  # the same image: same base, same code
    local_mode = invoke("elasticjob.deploy", "--follow", env=sm, timeout=600)
    assert local_mode.returncode == 0, local_mode.stderr[-4000:]
    # hyperparameters {"steps": "4", ...} come back as --key value: the same arguments
    assert _argv(local_mode.stderr) == [["--steps", "4", "--checkpoint-every", "2", "--note", "two words, one arg"]]
    # two hosts (algo-1, algo-2) of NPROC_PER_NODE=2 processes each (it ran one per host: world 2 where docker's
    # REPLICAS=1 x 2 was 2 too by chance), and the plan says why its world is not docker's
    assert "world=4 " in local_mode.stderr
    assert ("world 4 = 2 nodes x 2 processes (SAGEMAKER_INSTANCE_COUNT=2 hosts, where the other targets start "
            "REPLICAS=1 nodes)") in local_mode.stderr
    archive = next((state_dir / "sagemaker" / "byo-docker").glob("*/output/model.tar.gz"))
    with tarfile.open(archive) as tar:
        assert "model.pt" in tar.getnames()


def test_a_script_that_raises_ends_failed_with_its_exception_on_docker_and_sagemaker_local_mode(client, job_env):
    """RuntimeError at step 2 (docker restarted the containers 20 times in 244 s before "crash loop ...
    RendezvousClosedError" named torch's error instead): ended at once, its own exception and line the reason."""
    assert invoke("elasticjob.build", timeout=1800).returncode == 0
    line = next(i for i, text in enumerate((ROOT / "examples" / "ddp-plain" / "train.py").read_text().splitlines(), 1)
                if "raise RuntimeError(" in text) + 2  # the test's copy has two lines more before it
    for extra in ({}, {"TARGET": "sagemaker", "SAGEMAKER_LOCAL": "true"}):
        failed = invoke("elasticjob.deploy", "--follow", env={**extra, "TRAIN_ARGS": "--steps 4 --fail-at 2"}, timeout=600)
        assert failed.returncode != 0, (extra, failed.stderr[-3000:])
        last = failed.stderr.strip().splitlines()[-1]
        assert last.startswith("error: job byo-docker ended Failed after 0 restarts: the script raised RuntimeError: "
                               f"--fail-at 2: failing on purpose at step 2 (fit.py, line {line}, in main)"), (extra, last)
        shown = invoke("elasticjob.status", env={**extra, "COLUMNS": "250"})
        assert ", 0 restarts" in shown.stderr and "permanent" in shown.stderr, shown.stderr


def test_the_image_runs_with_no_command_named_as_torchrun_and_sagemaker_start_it(client, job_env, tmp_path):
    """The image's default command (doeks.pod.launch): given torchrun's flags and the script's arguments, as `docker run`
    or `kubectl run` would; and as SageMaker runs a bring-your-own container (`train`), on two hosts whose names
    resolve to this machine, with /opt/ml/input/config as SageMaker writes it: hyperparameters become the script's
    arguments, the first host is the master, the model lands in /opt/ml/model. (Kubeflow's launchers run it on the
    cluster: tests/test_kubernetes_sdk.py.)"""
    from doeks.services import free_port

    built = invoke("elasticjob.build", timeout=1800)
    assert built.returncode == 0, built.stderr[-3000:]
    image = re.search(r"training image: (\S+)", built.stderr).group(1)
    out = client.containers.run(image, ["--standalone", "--nproc-per-node", "2", "--", "--steps", "2", "--note", "a b"],
                                remove=True, network_mode="host", stderr=True).decode()
    assert "doeks-launch: torchrun options: torchrun --standalone --nproc-per-node 2 /workspace/fit.py --steps 2 " \
           "--note 'a b'" in out, out[-3000:]
    assert _argv(out) == [["--steps", "2", "--note", "a b"]] and "world=2 " in out and "done steps=2" in out, out[-3000:]

    hosts, port, started = ["algo-1", "algo-2"], free_port(), []
    try:
        for host in hosts:
            ml = tmp_path / host
            (ml / "input" / "config").mkdir(parents=True)
            (ml / "model").mkdir()
            (ml / "input" / "config" / "resourceconfig.json").write_text(json.dumps({"current_host": host, "hosts": hosts}))
            (ml / "input" / "config" / "hyperparameters.json").write_text(json.dumps({"steps": "3", "note": "two words"}))
            started.append(client.containers.run(
                image, ["train"], detach=True, network_mode="host", extra_hosts={h: "127.0.0.1" for h in hosts},
                environment={"MASTER_PORT": str(port)}, labels={"doeks/job": "byo-docker"},
                volumes={str(ml / "input" / "config"): {"bind": "/opt/ml/input/config", "mode": "ro"},
                         str(ml / "model"): {"bind": "/opt/ml/model", "mode": "rw"}}))
        codes = [c.wait(timeout=300)["StatusCode"] for c in started]
        logs = [c.logs().decode() for c in started]
        assert codes == [0, 0], logs
        assert f"doeks-launch: SageMaker (host algo-1 of 2): torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 " \
               f"--master-addr algo-1 --master-port {port} /workspace/fit.py --steps 3 --note 'two words'" in logs[0], logs[0]
        assert "--node-rank 1 " in logs[1]
        assert _argv(logs[0]) == [["--steps", "3", "--note", "two words"]] and "world=2 " in logs[0], logs[0][-3000:]
        assert (tmp_path / "algo-1" / "model" / "model.pt").is_file()  # DOEKS_MODEL_DIR: SageMaker's /opt/ml/model
    finally:
        for c in started:
            c.remove(force=True)

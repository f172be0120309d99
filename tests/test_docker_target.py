"""TARGET=docker and SageMaker local mode, for real: the training image is built here (on the CPU torch base made from
pip wheels), the cluster's own PyTorchJob runs as containers of it, a container is SIGKILLed and docker restarts it,
and SageMaker's contract (/opt/ml, SM_*, N hosts) trains to a model.tar.gz. CI always has a docker daemon."""
from __future__ import annotations

import json
import os
import re
import signal
import tarfile
import threading
import time

import pytest
import yaml

from doeks import jobspec
from doeks import settings as S
from doeks import trainimage
from doeks.runner import to_yaml_stream
from doeks.pod import reasons

from .conftest import ROOT, invoke, training_processes, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.docker]

SHARED_MOUNT = S.load(environ={}, path=ROOT / ".env").shared_mount
REGISTRY = "123456789012.dkr.ecr.us-west-2.amazonaws.com"
JOB = {"DATA_TRAIN_PER_CLASS": "40", "DATA_VAL_PER_CLASS": "8", "REPLICAS": "2", "NPROC_PER_NODE": "1", "EPOCHS": "1",
       "BATCH_SIZE": "8", "MIN_REPLICAS": "1", "MAX_REPLICAS": "2", "CHECKPOINT_EVERY": "2", "TARGET": "docker",
       "REGISTRY": REGISTRY, "TRAIN_BASE_IMAGE": trainimage.CPU_BASE, "JOB_NAME": "dockerjob",
       "CROP_SIZE": "32"}


@pytest.fixture(scope="module")
def client(docker_client):
    return docker_client


@pytest.fixture
def job_env(client, state_dir, monkeypatch):
    for key, value in JOB.items():
        monkeypatch.setenv(key, value)
    yield dict(JOB)
    for container in client.containers.list(all=True, filters={"label": "app.kubernetes.io/part-of=doeks"}):
        if container.labels.get("doeks/job") in ("dockerjob", "smjob", "cleanlog"):
            container.remove(force=True)


def labelled(client, job: str) -> list:
    return client.containers.list(all=True, filters={"label": f"doeks/job={job}"})


def test_build_then_train_in_containers_of_the_clusters_manifest(client, job_env, state_dir):
    built = invoke("elasticjob.build", timeout=1800)
    assert built.returncode == 0, built.stderr[-3000:]
    image = re.search(r"training image: (\S+)", built.stderr).group(1)
    assert image.startswith(f"{REGISTRY}/doeks-train:")
    # what the manifests name is inside the image: the script where the pod command says, torchrun, etcd client
    out = client.containers.run(image, ["python3", "-c", "import torch, torchvision, etcd, simplejpeg, os; "
                                        "print(os.path.isfile('/workspace/train.py'), torch.__version__)"],
                                entrypoint=[], remove=True, network_mode="host")
    assert out.decode().startswith("True 2.13.0")
    assert invoke("elasticjob.build").returncode == 0  # twice: up to date, not rebuilt
    assert invoke("elasticjob.data").returncode == 0
    missing = invoke("elasticjob.deploy", env={"TRAIN_IMAGE": "doeks-train:not-built"})
    assert missing.returncode == 1 and missing.stderr.strip().splitlines()[-1] == \
        "error: training image doeks-train:not-built (TRAIN_IMAGE) is not in this machine's docker: `docker pull` or " \
        "`docker load` it"  # an image named by hand: building this code's image would not make it (issue 32)
    assert labelled(client, "dockerjob") == []  # nothing half-created

    result = invoke("elasticjob.deploy", "--fresh", "--follow", "--epochs", "1", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "job dockerjob succeeded" in result.stderr
    containers = labelled(client, "dockerjob")
    assert len(containers) == 2 and all(c.attrs["State"]["ExitCode"] == 0 for c in containers)
    assert {c.image.tags[0] for c in containers} >= {image} or image in containers[0].image.tags
    final = json.loads((state_dir / "volumes" / "fsx-pvc" / "metrics" / "dockerjob" / "final.json").read_text())
    assert final["step"] > 0

    # byte for byte the manifests `TARGET=eks invoke elasticjob.deploy --dry-run` prints, but for the run id
    ran = (state_dir / "docker" / "dockerjob" / "manifests.yaml").read_text()
    # EKS keeps checkpoints and model in S3 by default (its FSx volume goes with `down`: tests/test_eks_outputs.py);
    # named on the shared volume, as docker keeps them, its manifests are the ones docker ran
    shared = {"CHECKPOINT_URI": f"{SHARED_MOUNT}/checkpoints", "MODEL_URI": f"{SHARED_MOUNT}/models"}
    eks = invoke("elasticjob.deploy", "--epochs", "1", "--dry-run", env={"TARGET": "eks", **shared})
    assert eks.returncode == 0, eks.stderr
    run_id = re.compile(r"dockerjob-(\d{8}-\d{6}-[0-9a-f]{4}|dry-run)")  # a shown plan's run id is always dry-run
    # but the hang watchdog's account and rights, which a cluster target applies beside the job (its watchdog acts
    # through the API server: docker has none), and the pods' serviceAccountName naming that account
    rights = {"ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
    on_eks = [d for d in yaml.safe_load_all(eks.stdout) if d and d["kind"] not in rights]
    accounts = [jobspec.worker_pod(d).pop("serviceAccountName") for d in on_eks if d["kind"] == "PyTorchJob"]
    assert accounts == ["dockerjob-watchdog"], accounts
    assert run_id.sub("RUN", ran) == run_id.sub("RUN", to_yaml_stream(on_eks))

    status = invoke("elasticjob.status", env={"COLUMNS": "200"})
    assert status.returncode == 0 and "on docker: Succeeded" in status.stderr
    assert invoke("elasticjob.delete").returncode == 0
    assert invoke("elasticjob.delete").returncode == 0  # twice: nothing left, no error
    assert labelled(client, "dockerjob") == []


def test_a_healthy_run_logs_no_traceback(client, job_env, state_dir, monkeypatch):
    """The image's torchrun is torch's with the etcd run directory fixed (doeks.pod.torchrun): stock torch renews that
    directory as if it were a key, etcd refuses, and every node's log of a healthy run held the lease thread's traceback
    (issue 21); the directory was never renewed either, so it lapsed 2 h into the job."""
    from urllib.request import urlopen

    from doeks import services

    monkeypatch.setenv("JOB_NAME", "cleanlog")
    assert invoke("elasticjob.build", timeout=1800).returncode == 0
    assert invoke("elasticjob.data").returncode == 0
    result = invoke("elasticjob.deploy", "--fresh", "--follow", "--train-args", "--max-steps 2", timeout=900)
    assert result.returncode == 0 and "job cleanlog succeeded" in result.stderr, result.stderr[-3000:]
    nodes = labelled(client, "cleanlog")
    logs = {c.name: c.logs().decode(errors="replace") for c in nodes}
    assert len(logs) == 2 and all(re.search(r"Rendezvous version \d+ is complete", text) for text in logs.values())
    for name, text in logs.items():
        assert "Traceback" not in text and "Exception in thread" not in text, f"{name}:\n{text[:3000]}"
    rdzv_id = next(e.split("=", 1)[1] for e in nodes[0].attrs["Config"]["Env"] if e.startswith("PET_RDZV_ID="))
    with urlopen(f"{services.etcd(state_dir).endpoint()}/v2/keys/torchelastic/p2p/run_{rdzv_id}") as reply:
        run_dir = json.load(reply)["node"]
    assert run_dir["dir"] and run_dir["ttl"] > 6 * 24 * 3600  # not torch's 2 h, which nothing could renew
    assert invoke("elasticjob.delete").returncode == 0
    assert labelled(client, "cleanlog") == []


def test_a_killed_container_is_restarted_and_the_job_finishes(client, job_env, state_dir):
    assert invoke("elasticjob.build", timeout=1800).returncode == 0
    assert invoke("elasticjob.data").returncode == 0
    started = invoke("elasticjob.deploy", "--fresh", "--train-args", "--step-delay 0.5 --log-every 1")
    assert started.returncode == 0, started.stderr[-2000:]
    checkpoint = state_dir / "volumes" / "fsx-pvc" / "checkpoints" / "dockerjob" / "latest"
    wait_for(checkpoint.exists, 300, "a first checkpoint")
    victim = next(c for c in labelled(client, "dockerjob") if c.labels["doeks/replica"] == "1")
    victim.reload()
    os.kill(victim.attrs["State"]["Pid"], signal.SIGKILL)  # the container's main process dies (not a `docker stop`)

    def restarted():
        victim.reload()
        return victim.attrs["RestartCount"] >= 1 and victim.attrs["State"]["Running"]
    wait_for(restarted, 120, "docker to restart the killed container (restartPolicy OnFailure)")
    follow = invoke("elasticjob.logs", "--follow", timeout=900)
    assert follow.returncode == 0 and "resumed from checkpoint" in follow.stdout
    status = invoke("elasticjob.status", env={"COLUMNS": "200"})
    assert "on docker: Succeeded" in status.stderr, status.stderr
    row = next(line for line in status.stderr.splitlines() if "node-1" in line)
    assert re.search(r"Succeeded\s*│\s*[1-9]", row), row  # the restart is counted on its replica
    scale = invoke("elasticjob.scale", "--replicas", "3")
    assert scale.returncode == 1 and "outside MIN_REPLICAS:MAX_REPLICAS" in scale.stderr
    assert invoke("elasticjob.delete").returncode == 0
    assert labelled(client, "dockerjob") == []


def test_sagemaker_local_mode_trains_to_a_model_artifact(client, job_env, state_dir, monkeypatch):
    monkeypatch.setenv("TARGET", "sagemaker")
    monkeypatch.setenv("SAGEMAKER_LOCAL", "true")
    monkeypatch.setenv("SAGEMAKER_INSTANCE_COUNT", "2")
    monkeypatch.setenv("JOB_NAME", "smjob")
    assert invoke("elasticjob.build", env={"TARGET": "docker"}, timeout=1800).returncode == 0
    assert invoke("elasticjob.data", env={"TARGET": "docker"}).returncode == 0
    dry = invoke("elasticjob.deploy", "--dry-run")
    assert dry.returncode == 0 and "kubectl" not in dry.stdout + dry.stderr
    request = json.loads(dry.stdout)
    assert request["operation"] == "CreateTrainingJob" and request["params"]["ResourceConfig"]["InstanceCount"] == 2
    result = invoke("elasticjob.deploy", "--follow", "--train-args", "--max-steps 2", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[algo-1]" in result.stderr and "[algo-2]" in result.stderr and "world=2" in result.stderr
    (root,) = (state_dir / "sagemaker" / "smjob").glob("smjob-*")
    hyper = json.loads((root / "algo-2" / "input" / "config" / "hyperparameters.json").read_text())
    assert hyper["max-steps"] == "2" and hyper["sagemaker_program"] == "train.py"
    with tarfile.open(root / "output" / "model.tar.gz") as tar:
        assert tar.getnames() == ["model.pt"]
    assert invoke("elasticjob.delete").returncode == 0
    assert invoke("elasticjob.delete").returncode == 0
    assert labelled(client, "smjob") == []


def test_restarts_reasons_and_runs_in_containers(client, job_env, state_dir):
    """Stock torchrun in the image restarts a node's killed workers inside the container: those restarts count
    (docker's RestartCount does not see them), three with no step between are a crash loop; a permanent error ends
    the job at once from the follow loop; each deploy is a run whose logs stay apart."""

    assert invoke("elasticjob.build", timeout=1800).returncode == 0
    assert invoke("elasticjob.data").returncode == 0
    env = {"REPLICAS": "1", "MAX_RESTARTS": "10"}
    assert invoke("elasticjob.deploy", "--fresh", "--train-args", "--step-delay 5 --log-every 1", env=env).returncode == 0
    (node,) = labelled(client, "dockerjob")

    def workers():
        node.reload()
        return training_processes(node.attrs["State"]["Pid"])

    stop = threading.Event()

    def crash_loop():  # every worker torchrun starts is killed at once, until told to stop
        while not stop.is_set():
            for pid in workers():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
    killer = threading.Thread(target=crash_loop, daemon=True)
    killer.start()
    try:
        status = wait_for(lambda: (lambda out: out if re.search(r", [3-9]\d* restarts", out.stderr) and
                                   "reason: crash loop" in out.stderr else None)(
            invoke("elasticjob.status", env={"COLUMNS": "250"})), 240, "three restarts counted, a crash loop named")
        described = invoke("elasticjob.describe", env={"COLUMNS": "250"})  # still in the crash loop
    finally:
        stop.set()
        killer.join()
    # Restarting while torchrun brings the killed workers back (issue 32), else Running; the fix names the traceback
    assert re.search(r"on docker: (Running|Restarting) ", status.stderr) and f"fix: {reasons.LOGS_FIX}" in status.stderr
    node.reload()
    assert node.attrs["RestartCount"] == 0  # docker saw none of them: the container never exited
    assert "dockerjob-worker-0: started (docker restarts so far: 0)" in described.stderr, described.stderr
    assert "reason: crash loop" in described.stderr
    first = re.search(r"\(run (\S+)\)", status.stderr).group(1)
    assert invoke("elasticjob.delete").returncode == 0

    started = time.monotonic()
    bad = invoke("elasticjob.deploy", "--follow", "--train-args", "--data /nothing", env=env, timeout=300)
    assert bad.returncode == 1
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith("error: job dockerjob ended Failed") and "data missing: data folder /nothing/train" in last
    assert time.monotonic() - started < 60
    second = re.search(r"\(run (\S+)\)", invoke("elasticjob.status").stderr).group(1)
    logs = invoke("elasticjob.logs")
    assert logs.stdout.count("process started") >= 1 and "step=" not in logs.stdout  # only the second run
    earlier = invoke("elasticjob.logs", "--run", first)  # kept when `delete` removed its container
    assert earlier.returncode == 0 and "failed (exitcode: -9)" in earlier.stdout and "/nothing" not in earlier.stdout
    assert "failed (exitcode: -9)" not in logs.stdout
    history = invoke("elasticjob.history", env={"COLUMNS": "250"})
    assert first in history.stderr and second in history.stderr and "data missing" in history.stderr
    assert invoke("elasticjob.delete").returncode == 0
    assert labelled(client, "dockerjob") == []

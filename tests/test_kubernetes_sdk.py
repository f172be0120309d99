"""Kubeflow's own Python SDKs on doeks' own cluster, as upstream documents them: `kubeflow` 0.5.0's TrainerClient
(Kubeflow Trainer v2.3.0) and `kubeflow-training` 1.9.4's TrainingClient (the training operator v1), each through the
API server of the cluster `TARGET=kubernetes invoke up` starts.

- docs/kubernetes.md's example, run as a user runs it: TrainerClient() runs a function (`CustomTrainer(func=...)`) on
  the torch-distributed runtime, whose image (`pytorch/pytorch:2.13.0-...`) `kubeflow.trainer.deploy` makes from
  doeks' CPU torch base; wait_for_job_status, get_job_logs, delete_job.
- doeks' training image with no command, from both SDKs at once: TrainerClient's CustomTrainerContainer and
  TrainingClient's create_job(base_image=...); its default command under each launcher's variables; the SDK's
  TrainJob shown by `invoke kubeflow.trainjob.status`.
Both SDKs reading jobs doeks submitted (its elastic PyTorchJob, its TrainJob) are checked where those jobs run, in
tests/test_kubernetes_cluster.py. A job that will never start (an image the node cannot pull, a container with no
command) fails its test at once with the pod's reason, not at the SDK's timeout. Needs `invoke setup --kubernetes`.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from .conftest import ROOT, invoke, wait_for
from .test_kubernetes_cluster import SMALL_JOB, _said, kubectl, own_cluster, trainer_client, training_client

pytestmark = [pytest.mark.kubernetes, pytest.mark.slow]

JOB = "sdkjob"            # the elastic job `up` deploys, deleted at once (this module submits its own)
CLAIM, MOUNT = "fsx-pvc", "/fsx-shared"
# the built-in workload, as small as it runs: 2 optimizer steps of the smallest model on 64-pixel crops
TINY = "--data {m}/data --arch mobilenet_v3_small --epochs 1 --max-steps 2 --batch-size 8 --crop-size 64 --workers 0 " \
       "--checkpoint-dir {m}/checkpoints/{name} --metrics-dir {m}/metrics/{name}"
NEVER_STARTS = {"ErrImagePull", "ImagePullBackOff", "CreateContainerError", "CreateContainerConfigError",
                "InvalidImageName", "CrashLoopBackOff"}


@pytest.fixture(scope="module")
def env(request):
    yield from own_cluster(request, {"JOB_NAME": JOB, **SMALL_JOB})


@pytest.fixture(scope="module")
def cluster(env):
    """The cluster with every unit (`up`: the training operator, the claim with the data, the training image on the
    node; the elastic job it starts deleted) and Kubeflow Trainer with its runtimes; yields the training image's name."""
    from doeks import trainimage
    from doeks.settings import load

    up = invoke("up", env=env, timeout=1800)
    assert up.returncode == 0, up.stderr[-3000:]
    deleted = invoke("elasticjob.delete", env=env, timeout=600)  # its job is not this module's: nothing trains beside
    assert deleted.returncode == 0, deleted.stderr[-3000:]
    deployed = invoke("kubeflow.trainer.deploy", env=env, timeout=1800)
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    yield trainimage.reference(load({**os.environ, **env}), on_this_machine=True)


def never_starts(selector: str, unschedulable_s: float = 120) -> str:
    """Why the pods of `selector` will never run (a waiting reason and its message; or not schedulable for
    `unschedulable_s`: nothing on the one node frees what they ask for while the test waits), or empty."""
    from datetime import datetime, timezone

    pods = json.loads(kubectl({}, "get", "pods", "-n", "default", "-l", selector, "-o", "json").stdout or '{"items": []}')
    now = datetime.now(timezone.utc)
    for pod in pods["items"]:
        for c in pod.get("status", {}).get("initContainerStatuses", []) + pod.get("status", {}).get("containerStatuses", []):
            waiting = c.get("state", {}).get("waiting", {})
            if waiting.get("reason") in NEVER_STARTS:
                said = ""
                if waiting["reason"] == "CrashLoopBackOff":  # what the container said before it ended, each time
                    said = "\n" + kubectl({}, "logs", "-n", "default", pod["metadata"]["name"], "-c", c["name"],
                                           "--previous", "--tail", "60").stdout[-4000:]
                return f"{pod['metadata']['name']}: {waiting['reason']}: {waiting.get('message', '')[:300]}{said}"
        for condition in pod.get("status", {}).get("conditions", []):
            if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
                since = datetime.fromisoformat(condition["lastTransitionTime"].replace("Z", "+00:00"))
                if (now - since).total_seconds() > unschedulable_s:
                    return f"{pod['metadata']['name']}: Unschedulable for over {unschedulable_s:.0f} s: {condition.get('message', '')[:300]}"
    return ""


def pods_said(selector: str) -> str:
    """The pods of `selector` and their events, for a failed test's message."""
    return kubectl({}, "describe", "pods", "-n", "default", "-l", selector).stdout[-3000:]


def fail_fast(selector: str):
    def check(_job) -> None:
        why = never_starts(selector)
        assert not why, f"the job's pods will never run: {why}"
    return check


def claim_patch():
    """The shared claim mounted in the runtime's `node` container, with the SDK's own option classes."""
    from kubeflow.trainer import options as o

    pod = o.PodSpecPatch(volumes=[{"name": "shared", "persistentVolumeClaim": {"claimName": CLAIM}}],
                         containers=[o.ContainerPatch(name="node", volume_mounts=[{"name": "shared", "mountPath": MOUNT}])])
    return o.RuntimePatch(training_runtime_spec=o.TrainingRuntimeSpecPatch(template=o.JobSetTemplatePatch(
        spec=o.JobSetSpecPatch(replicated_jobs=[o.ReplicatedJobPatch(name="node", template=o.JobTemplatePatch(
            spec=o.JobSpecPatch(template=o.PodTemplatePatch(spec=pod))))]))))


def _delete_and_wait_gone(client, name: str) -> None:
    from doeks import trainjob

    client.delete_job(name)
    wait_for(lambda: not kubectl({}, "get", "trainjob", name, "-n", "default", "--ignore-not-found", "-o", "name").stdout.strip()
             and not kubectl({}, "get", "pods", "-n", "default", "-l", trainjob.selector(name), "-o", "name").stdout.strip(),
             180, f"TrainJob {name} and its pods gone", poll=2)


def _remove_trainjob(name: str) -> None:
    kubectl({}, "delete", "trainjob", name, "-n", "default", "--ignore-not-found", "--wait=true")


def docs_example() -> str:
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    block = text.split("<!-- sdk-example:start -->", 1)[1].split("<!-- sdk-example:end -->", 1)[0]
    return block.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_docs_sdk_example_runs_a_function_on_the_torch_distributed_runtimes_image(cluster, env, tmp_path):
    """docs/kubernetes.md's example as a user runs it (`python sdk_example.py` with KUBECONFIG set): TrainerClient()
    with CustomTrainer(func) on the default runtime, wait_for_job_status, get_job_logs, delete_job."""
    import subprocess
    import time

    from doeks.cluster import versions

    client = trainer_client()
    assert client.get_runtime("torch-distributed").trainer.image == versions.TORCH_RUNTIME_IMAGE
    assert len(client.list_runtimes()) == 8
    before = {j.name for j in client.list_jobs()}
    script = tmp_path / "sdk_example.py"
    script.write_text(docs_example())
    process = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env={**os.environ, "KUBECONFIG": str(versions.kubeconfig())})
    try:
        deadline = time.monotonic() + 900
        while process.poll() is None:  # a job whose pods will never start fails now, not at the SDK's 600 s
            why = never_starts("jobset.sigs.k8s.io/jobset-name")
            assert not why, f"the example's job will never run: {why}"
            assert time.monotonic() < deadline, "the example did not end in 900 s:\n" + pods_said("jobset.sigs.k8s.io/jobset-name")
            time.sleep(3)
        out = process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, out[-3000:] + "\n" + pods_said("jobset.sigs.k8s.io/jobset-name")
    assert "rank 0 of 2: sum 3.0" in out, out[-3000:]
    assert {j.name for j in client.list_jobs()} == before  # delete_job took it away


def test_doeks_image_with_no_command_runs_under_the_trainers_and_the_operators_variables(cluster, env):
    """doeks' training image, no command named, submitted by both SDKs at once (so their pods start side by side):
    TrainerClient's CustomTrainerContainer (a TrainJob; the claim mounted with the SDK's RuntimePatch) and
    TrainingClient's create_job(base_image=...) (a PyTorchJob: 1 Master + 1 Worker, which waits in the operator's
    injected init container). The image's default command reads each launcher's PET_* variables and runs the image's
    script with DOEKS_TRAIN_ARGS; the SDK's TrainJob shows in `invoke kubeflow.trainjob.status`; delete_job takes
    each away."""
    from kubeflow.trainer import CustomTrainerContainer
    from kubeflow.trainer.options import Name
    from kubernetes import client as k8s

    from doeks import trainjob

    trainer, operator = trainer_client(), training_client()
    name, pytorchjob = "sdk-image", "sdk-operator"
    _remove_trainjob(name)
    kubectl({}, "delete", "pytorchjob", pytorchjob, "-n", "default", "--ignore-not-found", "--wait=true")
    trainer.train(runtime="torch-distributed",
                  trainer=CustomTrainerContainer(image=cluster, num_nodes=2,
                                                 env={"DOEKS_TRAIN_ARGS": TINY.format(m=MOUNT, name=name)}),
                  options=[Name(name), claim_patch()])
    operator.create_job(name=pytorchjob, base_image=cluster, num_workers=2, num_procs_per_worker=1,
                        env_vars={"DOEKS_TRAIN_ARGS": TINY.format(m=MOUNT, name=pytorchjob)},
                        volumes=[k8s.V1Volume(name="shared", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
                            claim_name=CLAIM))],
                        volume_mounts=[k8s.V1VolumeMount(name="shared", mount_path=MOUNT)])
    try:
        job = trainer.wait_for_job_status(name, timeout=600, polling_interval=3,
                                          callbacks=[fail_fast(trainjob.selector(name))])
        assert job.status == "Complete"
        logs = "\n".join(trainer.get_job_logs(name))
        assert "doeks-launch: Kubeflow (PET_* variables): torchrun /workspace/train.py --data" in logs, logs[-2000:]
        assert "world=2" in logs and "done final_val_acc=" in logs and "steps=2" in logs, logs[-2000:]
        # the SDK's job is a TrainJob like doeks' own: the doeks task shows it, with nothing wrong to say
        status = invoke("kubeflow.trainjob.status", env={**env, "JOB_NAME": name}, timeout=120)
        said = _said(status)
        assert status.returncode == 0 and name in said and "Complete" in said and "reason:" not in said, said[-2000:]

        operator.wait_for_job_conditions(pytorchjob, wait_timeout=600, polling_interval=3,
                                         callback=fail_fast(f"training.kubeflow.org/job-name={pytorchjob}"))
        pods, _ = operator.get_job_logs(pytorchjob, is_master=False)
        assert sorted(pods) == [f"{pytorchjob}-master-0", f"{pytorchjob}-worker-0"]
        master = pods[f"{pytorchjob}-master-0"]
        assert "doeks-launch: Kubeflow (PET_* variables): torchrun /workspace/train.py --data" in master, master[-2000:]
        assert "world=2" in master and "done final_val_acc=" in master and "steps=2" in master, master[-2000:]
    finally:
        operator.delete_job(pytorchjob)
        _delete_and_wait_gone(trainer, name)
    assert name not in [j.name for j in trainer.list_jobs()]
    assert pytorchjob not in [j.metadata.name for j in operator.list_jobs()]

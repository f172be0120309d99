"""The target interface: one contract every target passes (like TorchX's scheduler tests), and the target x verb
matrix through the CLI (each verb works or says in one line that the target cannot do it).

Real where it can be here: the local target trains with torchrun and etcd, the docker target runs containers of the
training image (tests/test_docker_target.py), sagemaker talks to a moto server over HTTP, eks to a scripted kubectl
stand-in (no API server can run here) that can fail like kubectl does.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from doeks import jobspec, targets
from doeks import settings as S
from doeks.runner import Runner, to_yaml_stream
from doeks.targets import STATES, NotSupported

from .conftest import invoke

STANDIN = Path(__file__).with_name("kubectl_standin.py")
SECRET = "s3cr3t-never-printed"
TINY = {"DATA_TRAIN_PER_CLASS": "12", "DATA_VAL_PER_CLASS": "4", "REPLICAS": "1", "NPROC_PER_NODE": "1", "EPOCHS": "1",
        "BATCH_SIZE": "4", "MIN_REPLICAS": "1", "MAX_REPLICAS": "2", "CHECKPOINT_EVERY": "1"}


def pytorchjob_json(state: str = "Running", pods: list | None = None) -> str:
    job = jobspec.pytorchjob(S.current(), image="example/train:1")
    job["status"] = {"conditions": [{"type": "Created", "status": "True"}, {"type": state, "status": "True",
                                                                            "message": "PyTorchJob imagenet is " + state}]}
    return json.dumps(job)


def pod(name: str, phase: str, restarts: int = 0, waiting: str = "") -> dict:
    state = {"waiting": {"reason": waiting}} if waiting else {"running": {}}
    return {"metadata": {"name": name, "labels": {"doeks/job": "imagenet"}}, "spec": {"nodeName": "ip-10-0-0-1"},
            "status": {"phase": phase, "containerStatuses": [{"name": "pytorch", "restartCount": restarts, "state": state}]}}


@pytest.fixture
def world(state_dir, tmp_path, monkeypatch):
    """Settings for tiny jobs, a scripted kubectl on PATH, a moto server for sagemaker, a secret to look for."""
    for key, value in TINY.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("REGISTRY", "123456789012.dkr.ecr.us-west-2.amazonaws.com")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(f"#!/bin/sh\nexec {sys.executable} {STANDIN} \"$@\"\n")
    (bin_dir / "kubectl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    script = tmp_path / "kubectl.json"
    monkeypatch.setenv("KUBECTL_SCRIPT", str(script))
    monkeypatch.setenv("RECORD", str(tmp_path / "record.jsonl"))
    S.reset()
    script.write_text(json.dumps([
        {"match": ["get", "pytorchjob"], "stdout": pytorchjob_json()},
        {"match": ["get", "pods"], "stdout": json.dumps({"items": [pod("imagenet-worker-0", "Running", 2)]})},
        {"match": ["logs"], "stdout": "[pod/imagenet-worker-0/pytorch] step=1 epoch=0 loss=1.0 acc=0.5 samples/s=9.0 world=1\n"},
        {"match": ["apply"]}, {"match": ["delete"]}, {"match": ["patch"]},
    ]))
    from doeks import services

    moto = services.moto(state_dir)
    moto.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.endpoint())
    S.reset()
    return {"script": script, "record": tmp_path / "record.jsonl", "state": state_dir}


def settings_for(name: str):
    return S.current().with_overrides(target=name)


def files_under(folder: Path) -> set[str]:
    return {str(p) for p in folder.rglob("*")} if folder.exists() else set()


@pytest.mark.parametrize("name", ["local", "docker", "eks", "sagemaker"])
def test_every_target_plans_a_value_that_changes_nothing(world, name):
    s = settings_for(name)
    target = targets.get(s)
    assert target.name == name and isinstance(target, targets.Target)
    before = files_under(world["state"])
    plan = target.plan(targets.Job(s, ["--log-every", "2"]))
    assert files_under(world["state"]) == before, "a plan must change nothing"
    assert not world["record"].exists(), "a plan must not call kubectl"
    assert plan.target == name and plan.steps and all(isinstance(line, str) and line for line in plan.describe())
    shown = "\n".join(plan.describe()) + to_yaml_stream(plan.manifests) + json.dumps(plan.requests)
    assert SECRET not in shown
    assert plan.image, "every plan names the image its workload runs in"
    if plan.manifests:  # local, docker, eks: the same PyTorchJob, running the script the training image holds
        worker = plan.manifests[-1]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
        assert worker["command"] == ["torchrun", jobspec.CONTAINER_SCRIPT] and worker["args"][-2:] == ["--log-every", "2"]
        assert plan.manifests[-1]["spec"]["elasticPolicy"]["rdzvId"].endswith(plan.job.run)
    if name != "local":
        assert "doeks-train:" in plan.image or name == "sagemaker"
    if name == "sagemaker":
        (request,) = plan.requests
        assert request["operation"] == "CreateTrainingJob" and request["params"]["HyperParameters"]["log-every"] == "2"
        assert not any("kubectl" in line for line in plan.describe())


class StepRecorder:
    """A runner that records each step a submission takes and runs none of them."""

    def __init__(self, dry_run: bool):
        self.dry_run, self.ran = dry_run, []

    def step(self, what, fn, *args, **kwargs):
        self.ran.append(what)


def test_no_target_submits_outside_its_plan():
    """Issue 53: `--dry-run` and the run cannot differ when every target submits through Target.submit, which runs the
    plan's steps and nothing else (the Kubernetes target once built, checked, deleted and applied outside them)."""
    from doeks import keys

    for module, cls in [*keys.BUILTIN_TARGETS.values(), keys.REHEARSAL_TARGET]:
        target_class = getattr(__import__(module, fromlist=[cls]), cls)
        assert target_class.submit is targets.Target.submit, f"{cls} overrides submit: its run differs from its plan"


def test_a_target_is_a_place_and_a_job_backend_of_at_most_15_verbs():
    """Issue 53: the job's interface is small (TorchX's Scheduler, kind's Provider, the Kubeflow SDK's backends have 10
    to 12); the helpers a target builds its plans from (JobPlanning) are not part of it, nor the units' verbs (Place)."""
    from doeks.targets.base import JobBackend, JobPlanning, Place

    public = {name for name, value in vars(JobBackend).items() if callable(value) and not name.startswith("_")}
    assert public == set(JobBackend.VERBS) and len(JobBackend.VERBS) <= 15
    assert not public & {name for name in vars(Place)} and not public & {name for name in vars(JobPlanning)}
    assert targets.Target.__mro__[1:4] == (Place, JobBackend, JobPlanning)


@pytest.mark.parametrize("name", ["local", "docker", "eks", "sagemaker"])
def test_a_submission_runs_the_steps_its_dry_run_lists(world, name):
    s = settings_for(name)
    target = targets.get(s)
    plan = target.plan(targets.Job(s, ["--log-every", "2"]))
    dry, run = StepRecorder(dry_run=True), StepRecorder(dry_run=False)
    target.submit(plan, dry)
    target.submit(plan, run)
    assert run.ran == dry.ran == [step.what for step in plan.steps if step.run is not None] and run.ran
    assert [line for line in plan.describe() if any(what in line for what in run.ran)], "the plan shows its steps"


def test_same_pytorchjob_on_docker_and_eks_apart_from_the_run(world):
    """With the same settings (the base image and crop too: by default each follows where the job trains) the docker
    target runs the very manifests eks applies."""
    from doeks import trainimage

    same = {"train_base_image": trainimage.CPU_BASE, "crop_size": "32"}
    job = targets.Job(settings_for("docker").with_overrides(**same), ["--max-steps", "3"], run="RUN")
    docker_plan = targets.get(job.settings).plan(job)
    eks_job = targets.Job(settings_for("eks").with_overrides(**same), ["--max-steps", "3"], run="RUN")
    eks_plan = targets.get(eks_job.settings).plan(eks_job)
    # on a cluster the hang watchdog acts through the API server: its service account comes first and the pods run
    # under it; docker restarts a replica itself
    account = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
    applied = [m for m in eks_plan.manifests if m["kind"] not in account]
    assert jobspec.worker_pod(applied[-1]).pop("serviceAccountName") == "imagenet-watchdog"
    assert to_yaml_stream(docker_plan.manifests) == to_yaml_stream(applied)


def test_lifecycle_on_eks_through_the_scripted_kubectl(world):
    s = settings_for("eks")
    target = targets.get(s)
    runner = Runner(echo=False)
    target.submit(target.plan(targets.Job(s, fresh=True)), runner)  # the scripted cluster has it running: replace it
    calls = [json.loads(line) for line in world["record"].read_text().splitlines()]
    applied = list(yaml.safe_load_all(calls[-1]["stdin"]))
    assert calls[-1]["argv"][:2] == ["apply", "--server-side"] and applied[-1]["kind"] == "PyTorchJob"
    status = target.describe()
    assert status.state == "Running" and status.replicas[0].restarts == 2 and status.state in STATES
    assert list(target.logs())[0].endswith("world=1")
    target.scale(2, runner)
    with pytest.raises(Exception, match="outside MIN_REPLICAS:MAX_REPLICAS"):
        target.scale(5, runner)
    assert target.cancel(runner) and target.cancel(runner)  # kubectl delete --ignore-not-found: safe twice
    # TARGET=eks keeps checkpoints and the model in S3 (the FSx volume goes with `down`); named ones stay
    assert target.artifacts()["checkpoints"] == "s3://doeks-training/doeks/checkpoints/imagenet"
    assert target.artifacts()["model"] == "s3://doeks-training/doeks/models/imagenet/model.pt"
    on_claim = targets.get(s.with_overrides(checkpoint_uri="/fsx-shared/ck", model_uri="/fsx-shared/models"))
    assert on_claim.artifacts()["checkpoints"] == "/fsx-shared/ck/imagenet"
    # a pod that cannot pull its image is the reason shown; kubectl failing is one line naming the fix
    world["script"].write_text(json.dumps([
        {"match": ["get", "pytorchjob"], "stdout": pytorchjob_json("Created")},
        {"match": ["get", "pods"], "stdout": json.dumps({"items": [pod("imagenet-worker-0", "Pending", 0, "ImagePullBackOff")]})}]))
    assert "ImagePullBackOff" in target.describe().reason
    world["script"].write_text(json.dumps([{"match": ["get"], "rc": 1,
                                            "stderr": "The connection to the server localhost:8080 was refused\n"}]))
    with pytest.raises(Exception, match="invoke eks.connect"):
        target.describe()


def test_lifecycle_on_sagemaker_against_moto(world):
    s = settings_for("sagemaker")
    runner = Runner(echo=False, secrets=s.secrets())
    from doeks import sagemaker

    sagemaker.ensure_role(s, runner)
    from doeks.aws import client

    client(s, "s3").create_bucket(Bucket=s.s3_bucket, CreateBucketConfiguration={"LocationConstraint": s.aws_region})
    target = targets.get(s)
    plan = target.plan(targets.Job(s, ["--max-steps", "3"]))
    target.submit(plan, runner)
    name = plan.requests[0]["params"]["TrainingJobName"]
    described = client(s, "sagemaker").describe_training_job(TrainingJobName=name)
    assert described["HyperParameters"]["max-steps"] == "3" and described["RoleArn"].endswith(s.sagemaker_role_name)
    status = target.describe()
    assert status.state == "Succeeded" and status.run == name  # moto completes jobs at once
    assert target.artifacts()["model"].startswith("s3://")
    assert target.cancel(runner) is False and target.cancel(runner) is False  # nothing running: idempotent
    with pytest.raises(NotSupported, match="scale is not supported on TARGET=sagemaker"):
        target.scale(2, runner)


def test_train_args_that_are_not_pairs_are_one_line_on_sagemaker(world):
    s = settings_for("sagemaker")
    with pytest.raises(Exception, match="has no value"):
        targets.get(s).plan(targets.Job(s, ["--bogus"]))


@pytest.mark.slow
def test_lifecycle_on_local_with_real_torchrun(world):
    from doeks import elastic

    s = settings_for("local")
    elastic.make_data(s, Runner(echo=False))
    target = targets.get(s)
    assert target.describe().state == "Stopped" and target.cancel(Runner(echo=False)) is False
    target.submit(target.plan(targets.Job(s, ["--max-steps", "2", "--log-every", "1"], fresh=True)), Runner(echo=False))
    status = target.wait(timeout=300, quiet=True)
    assert status.state == "Succeeded" and status.replicas[0].step == 2
    lines = list(target.logs())
    assert any(line.startswith("[node-0]") and "step=2" in line for line in lines)
    with pytest.raises(Exception, match="--replica 7"):
        list(target.logs(replica=7))
    assert Path(target.artifacts()["final"]).is_file()
    assert target.cancel(Runner(echo=False)) is False  # finished: nothing left to stop, twice
    assert target.cancel(Runner(echo=False)) is False


VERBS = [["elasticjob.deploy", "--dry-run"], ["elasticjob.status"], ["elasticjob.logs"],
         ["elasticjob.scale", "--replicas", "2", "--dry-run"], ["elasticjob.delete", "--dry-run"], ["elasticjob.artifacts"]]


@pytest.mark.parametrize("name", ["local", "docker", "eks", "sagemaker"])
def test_target_by_verb_matrix(world, name):
    """Each verb works (exit 0) or ends with one line saying what cannot be done: never a traceback."""
    env = {"TARGET": name, "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    outcomes = {}
    for argv in VERBS:
        result = invoke(*argv, env=env, timeout=120)
        assert "Traceback" not in result.stderr, (argv, result.stderr)
        assert SECRET not in result.stdout + result.stderr
        if result.returncode:
            last = result.stderr.strip().splitlines()
            assert result.returncode == 1 and last and last[-1].startswith("error: "), (argv, result.stderr)
            outcomes[argv[0]] = last[-1]
        else:
            outcomes[argv[0]] = "ok"
    assert outcomes["elasticjob.deploy"] == "ok"  # every target plans a dry run
    if name == "sagemaker":
        assert "not supported on TARGET=sagemaker" in outcomes["elasticjob.scale"]
    if name == "docker":  # no daemon: one line that says how to get one
        assert "no docker daemon reachable" in outcomes["elasticjob.status"]


def test_bad_replicas_and_missing_image_are_one_line(world):
    bad = invoke("elasticjob.scale", "--replicas", "abc", env={"TARGET": "docker"})
    assert bad.returncode == 1 and bad.stderr.strip() == "error: --replicas 'abc': expected an integer"
    out = invoke("elasticjob.deploy", "--replicas", "5", env={"TARGET": "docker"})
    assert out.returncode == 1 and "REPLICAS" in out.stderr and "Traceback" not in out.stderr
    absent = invoke("elasticjob.deploy", env={"TARGET": "docker", "DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert absent.returncode == 1 and absent.stderr.strip().splitlines()[-1].startswith("error: no docker daemon reachable")


def test_sagemakers_cluster_stages_data_as_eks_does(state_dir, monkeypatch, capsys):
    """TARGET=sagemaker's `up` stages the data onto its EKS cluster's claim, as eks does: its pods get their AWS
    session from EKS Pod Identity (no Secret). The staging step ended in AttributeError: pod_session was eks' alone."""
    monkeypatch.setenv("TARGET", "sagemaker")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secretexample")
    target = targets.get(S.load())
    assert target.pod_session(Runner(dry_run=True), None) is None
    target.stage_data(Runner(dry_run=True), "s3://doeks-training/data/imagenet/", False)
    out = capsys.readouterr()
    assert "Job default/imagenet-stage" in out.out + out.err and "pod identity association" in out.out + out.err

"""TARGET=eks end to end on this machine (issue 31), EKS_REHEARSAL=true: the eks target's own code on doeks' cluster,
with doeks' moto server (IAM enforced) as the account and a registry built here as ECR (docs/testing.md). A user's
script with no data in S3: `up` (cluster, storage, EFA, metrics, operator, the image pushed, the job), the job to the
end, `up` again, a code edit (the deploy refused in one line naming the command, that command, the deploy), `down`,
and `audit`: nothing left. Every step as a user types it, and each one's exit code checked. Before `down`, what
`kubeflow.deploy` leaves on a cluster (its overlay in STATE_DIR and what was applied from it; the platform itself
is fetched from GitHub, so a small stand-in of the same shape is applied) is there for `down` to remove.

The test prints each step's seconds (`-s` shows them): the figures of docs/testing.md."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import invoke, wait_for
from .test_rehearsal_cluster import _built

pytestmark = [pytest.mark.kubernetes, pytest.mark.slow, pytest.mark.cluster_down,
              pytest.mark.timeout(2400)]  # a hang's limit: the whole path takes minutes (docs/testing.md)

SCRIPT = '''import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
print(f"VERSION step 1/1 world={dist.get_world_size()} data={os.environ.get('DOEKS_DATA_DIR')}", flush=True)
dist.barrier()
if dist.get_rank() == 0:  # the documented helper (docs/your-own-script.md): DOEKS_MODEL_URI, S3 on eks
    import doeks
    print("model saved to", doeks.save_model({"version": "VERSION"}), flush=True)
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import os

    if not _built():
        if os.environ.get("CI"):
            pytest.fail("CI must have doeks' cluster and the registry built (invoke setup --kubernetes)")
        pytest.skip("doeks' cluster or the registry is not built (invoke setup --kubernetes)")
    folder = tmp_path_factory.mktemp("rehearsal")
    code = folder / "code"
    code.mkdir()
    (code / "train.py").write_text(SCRIPT.replace("VERSION", "v1"))
    values = {"TARGET": "eks", "EKS_REHEARSAL": "true", "STATE_DIR": str(folder / "state"), "KUBECONFIG": "",
              "TRAIN_SCRIPT": str(code / "train.py"), "GPU_INSTANCE_TYPE": "g5.12xlarge", "NPROC_PER_NODE": "1",
              "REPLICAS": "2", "MIN_REPLICAS": "1", "MAX_REPLICAS": "2", "JOB_NAME": "rehearsal", "COLUMNS": "200"}
    invoke("down", "--yes", env={"TARGET": "kubernetes", "KUBECONFIG": ""}, timeout=900)  # the run's one cluster
    yield values
    invoke("down", "--yes", env=values, timeout=900)
    invoke("eks.delete", env={**values, "TARGET": "local", "EKS_REHEARSAL": "false"}, timeout=300)  # the account


def ok(*args, env, timeout=1800):
    started = time.monotonic()
    result = invoke(*args, env=env, timeout=timeout)
    assert result.returncode == 0, f"{args}: {result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result, time.monotonic() - started


def job_state(env) -> str:
    result, _ = ok("elasticjob.status", env=env, timeout=300)
    for state in ("Succeeded", "Failed", "Running", "Pending", "Restarting"):
        if state in result.stderr + result.stdout:
            return state
    return "?"


def job_ended(env) -> str:
    """The job's end (Succeeded or Failed) once its PyTorchJob has that condition True, else empty: one kubectl on
    doeks' own cluster (the rehearsal's EKS), not a whole `invoke elasticjob.status` start-up."""
    from doeks import kube
    from doeks.cluster import versions

    got = subprocess.run([kube.wheel_kubectl() or kube.kubectl(), f"--kubeconfig={versions.kubeconfig()}", "get",
                          "pytorchjob", env["JOB_NAME"], "-n", "default", "-o", "json"],
                         capture_output=True, text=True, timeout=60)
    if got.returncode != 0:
        return ""
    conditions = json.loads(got.stdout).get("status", {}).get("conditions", [])
    true = {c["type"] for c in conditions if c.get("status") == "True"}
    return next((state for state in ("Succeeded", "Failed") if state in true), "")


def ended(env, what: str) -> str:
    """The job's end as the user's `elasticjob.status` says it, asked once the PyTorchJob's conditions (read every
    1 s) say it ended."""
    wait_for(lambda: job_ended(env), 900, what, poll=1)
    return job_state(env)


def platform_stand_in(state) -> None:
    """What `kubeflow.deploy` leaves: its overlay in STATE_DIR/kubeflow/overlay and what `kubectl apply
    --server-side` made from it; here the namespaces doeks labels (istio-system, cert-manager) and a ConfigMap."""
    from doeks import kube
    from doeks.cluster import versions

    overlay = state / "kubeflow" / "overlay"
    overlay.mkdir(parents=True, exist_ok=True)
    objects = [{"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "kubeflow"}}}
               for name in ("istio-system", "cert-manager")]
    objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "istio", "namespace": "istio-system"},
                    "data": {"mesh": "stand-in"}})
    (overlay / "platform.yaml").write_text("---\n".join(json.dumps(o) + "\n" for o in objects))
    (overlay / "kustomization.yaml").write_text("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
                                                "resources:\n- platform.yaml\n")
    applied = subprocess.run([kube.wheel_kubectl() or kube.kubectl(), f"--kubeconfig={versions.kubeconfig()}", "apply",
                              "--server-side", "-k", str(overlay)], capture_output=True, text=True, timeout=120)
    assert applied.returncode == 0, applied.stderr


MODEL = "s3://doeks-training/doeks/models/rehearsal/model.pt"  # TARGET=eks keeps the model in S3 (MODEL_URI empty)


def model_in_account(env) -> dict:
    """The model the job saved, read from the account (the rehearsal's moto server, which outlives `down`) with doeks'
    administrator key."""
    import io

    import boto3
    import torch

    from doeks import rehearsal

    admin = rehearsal.admin_credentials(Path(env["STATE_DIR"]))
    s3 = boto3.client("s3", endpoint_url=admin["endpoint"], region_name="us-west-2",
                      aws_access_key_id=admin["aws_access_key_id"], aws_secret_access_key=admin["aws_secret_access_key"])
    bucket, key = MODEL[len("s3://"):].split("/", 1)
    return torch.load(io.BytesIO(s3.get_object(Bucket=bucket, Key=key)["Body"].read()))


def test_up_job_up_again_code_edit_down_audit(env):
    timings = {}
    up, timings["up"] = ok("up", env=env, timeout=3600)
    said = up.stdout + up.stderr
    assert "EKS rehearsal" in said and "nothing staged" in said, said[-3000:]  # a user's script needs no data
    assert "AWS_SESSION_TOKEN" not in said  # the pods' role session reaches them by a Secret, never printed
    doctor, _ = ok("doctor", env=env)
    assert "EKS rehearsal (EKS_REHEARSAL=true)" in doctor.stdout + doctor.stderr
    started = time.monotonic()
    assert ended(env, "the job to end") == "Succeeded"
    timings["job"] = time.monotonic() - started
    logs, _ = ok("elasticjob.logs", env=env)
    assert "v1 step 1/1 world=" in logs.stdout and "data=/fsx-shared/data" in logs.stdout, logs.stdout[-2000:]
    assert f"model saved to {MODEL}" in logs.stdout, logs.stdout[-2000:]  # with the pods' own role, from EKS Auth
    again, timings["up again"] = ok("up", env=env, timeout=1800)
    assert "is in ECR already: not pushed again" in again.stdout + again.stderr

    Path(env["TRAIN_SCRIPT"]).write_text(SCRIPT.replace("VERSION", "v2"))  # a code edit: a new content tag
    refused = invoke("elasticjob.deploy", env=env)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 1 and len(errors) == 1, refused.stderr[-2000:]
    assert "is not in ECR" in errors[0] and "`invoke elasticjob.build elasticjob.push`" in errors[0], errors
    _, timings["build push"] = ok("elasticjob.build", "elasticjob.push", env=env)
    _, timings["deploy"] = ok("elasticjob.deploy", "--fresh", env=env)
    started = time.monotonic()
    assert ended(env, "the edited job to end") == "Succeeded"
    timings["edited job"] = time.monotonic() - started
    logs, _ = ok("elasticjob.logs", env=env)
    assert "v2 step 1/1" in logs.stdout, logs.stdout[-2000:]

    platform_stand_in(Path(env["STATE_DIR"]))
    down, timings["down"] = ok("down", "--yes", env=env, timeout=1800)
    said = down.stdout + down.stderr
    assert 'namespace "istio-system" deleted' in said and 'namespace "cert-manager" deleted' in said, said[-3000:]
    assert f"job rehearsal: model {MODEL} (kept" in said, said[:3000]  # down says where the model is
    audit, _ = ok("audit", env=env)
    assert "audit: nothing left for cluster doeks in us-west-2" in audit.stdout + audit.stderr, audit.stderr
    assert model_in_account(env) == {"version": "v2"}  # after down the model is in S3 (the account's: moto)
    print("rehearsal timings (s):", json.dumps({k: round(v) for k, v in timings.items()}))


LONG = "DOEKS_REHEARSAL_IMAGENET"


@pytest.fixture(scope="module")
def imagenet_env(tmp_path_factory):
    import os

    if not os.environ.get(LONG):
        pytest.skip(f"the ImageNet variant of the whole path adds ~9 min to CI (docs/testing.md): {LONG}=1 runs it")
    if not _built():
        pytest.skip("doeks' cluster or the registry is not built (invoke setup --kubernetes)")
    folder = tmp_path_factory.mktemp("rehearsal-imagenet")
    values = {"TARGET": "eks", "EKS_REHEARSAL": "true", "STATE_DIR": str(folder / "state"), "KUBECONFIG": "",
              "GPU_INSTANCE_TYPE": "g5.12xlarge", "NPROC_PER_NODE": "1", "REPLICAS": "2", "MIN_REPLICAS": "1",
              "MAX_REPLICAS": "2", "EPOCHS": "1", "JOB_NAME": "imagenet", "S3_BUCKET": "rehearsal-data",
              "DATA_TRAIN_PER_CLASS": "32", "DATA_VAL_PER_CLASS": "8", "CROP_SIZE": "32", "COLUMNS": "200"}
    invoke("down", "--yes", env={"TARGET": "kubernetes", "KUBECONFIG": ""}, timeout=900)  # the run's one cluster
    yield values
    invoke("down", "--yes", env=values, timeout=900)
    invoke("eks.delete", env={**values, "TARGET": "local", "EKS_REHEARSAL": "false"}, timeout=300)


def upload_imagenet(env, tmp_path) -> int:
    """What a user does first (docs/aws-first-run.md: `aws s3 sync ./imagenet s3://S3_BUCKET/DATA_S3_PREFIX`): the
    ImageNet layout in the account's bucket, with the account owner's keys (the rehearsal's administrator)."""
    import boto3

    from doeks import elastic, rehearsal
    from doeks import settings as S
    from doeks.runner import Runner

    local = S.load(environ={**env, "TARGET": "local", "EKS_REHEARSAL": "false", "STATE_DIR": str(tmp_path)})
    elastic.make_data(local, Runner(echo=False))
    root = elastic.data_root(local)
    keys = rehearsal.admin_credentials(Path(env["STATE_DIR"]))
    s3 = boto3.client("s3", region_name="us-west-2", endpoint_url=keys["endpoint"],
                      aws_access_key_id=keys["aws_access_key_id"], aws_secret_access_key=keys["aws_secret_access_key"])
    s3.create_bucket(Bucket=env["S3_BUCKET"], CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    files = [p for p in root.rglob("*") if p.is_file()]
    for path in files:
        s3.upload_file(str(path), env["S3_BUCKET"], f"data/imagenet/{path.relative_to(root).as_posix()}")
    return len(files)


def test_the_built_in_job_on_data_staged_from_s3(imagenet_env, tmp_path):
    """The same path with the built-in ImageNet job: `up` refuses without data in S3 (one line naming the step), the
    data uploaded, `up` stages it into the claim with the staging Job's own role (Pod Identity's session, IAM
    enforced) and trains to the end, `up` again, `down`, `audit`: nothing left."""
    env, timings = imagenet_env, {}
    ok("doctor", env=env)  # the account (doeks' moto server) starts with the first task
    missing = invoke("up", "--dry-run", "--full", env=env)
    assert missing.returncode == 1 and "no training data under s3://rehearsal-data/data/imagenet/train/" in missing.stderr
    assert upload_imagenet(env, tmp_path) > 0
    up, timings["up"] = ok("up", env=env, timeout=3600)
    said = up.stdout + up.stderr
    assert "imagenet-stage" in said, said[-3000:]  # the staging Job, applied, waited for and deleted
    assert "AWS_SESSION_TOKEN" not in said  # its role's session reaches its pod by a Secret, never printed
    started = time.monotonic()
    assert ended(env, "the ImageNet job to end") == "Succeeded"
    timings["job"] = time.monotonic() - started
    status, _ = ok("elasticjob.status", env=env)
    logs, _ = ok("elasticjob.logs", env=env)
    assert "step=" in logs.stdout and "Traceback" not in logs.stdout, logs.stdout[-2000:]
    _, timings["up again"] = ok("up", env=env, timeout=1800)
    down, timings["down"] = ok("down", "--yes", env=env, timeout=1800)
    audit, _ = ok("audit", env=env)
    assert "audit: nothing left for cluster doeks in us-west-2" in audit.stdout + audit.stderr, audit.stderr
    print("rehearsal (ImageNet) timings (s):", json.dumps({k: round(v) for k, v in timings.items()}))

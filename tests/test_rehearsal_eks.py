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

import pytest

from .conftest import invoke, wait_for
from .test_rehearsal_cluster import _built

pytestmark = [pytest.mark.kubernetes, pytest.mark.slow, pytest.mark.cluster_down]

SCRIPT = '''import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
print(f"VERSION step 1/1 world={dist.get_world_size()} data={os.environ.get('DOEKS_DATA_DIR')}", flush=True)
dist.barrier()
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


def ended(env, what: str) -> str:
    return wait_for(lambda: (lambda state: state if state in ("Succeeded", "Failed") else "")(job_state(env)), 900,
                    what, poll=3)


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


def test_up_job_up_again_code_edit_down_audit(env):
    from pathlib import Path

    timings = {}
    up, timings["up"] = ok("up", env=env, timeout=3600)
    said = up.stdout + up.stderr
    assert "EKS rehearsal" in said and "nothing staged" in said, said[-3000:]  # a user's script needs no data
    doctor, _ = ok("doctor", env=env)
    assert "EKS rehearsal (EKS_REHEARSAL=true)" in doctor.stdout + doctor.stderr
    started = time.monotonic()
    assert ended(env, "the job to end") == "Succeeded"
    timings["job"] = time.monotonic() - started
    logs, _ = ok("elasticjob.logs", env=env)
    assert "v1 step 1/1 world=" in logs.stdout and "data=/fsx-shared/data" in logs.stdout, logs.stdout[-2000:]
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
    audit, _ = ok("audit", env=env)
    assert "audit: nothing left for cluster doeks in us-west-2" in audit.stdout + audit.stderr, audit.stderr
    print("rehearsal timings (s):", json.dumps({k: round(v) for k, v in timings.items()}))

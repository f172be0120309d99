"""TARGET=eks end to end on this machine (issue 31), EKS_REHEARSAL=true: the eks target's own code on doeks' cluster,
with doeks' moto server (IAM enforced) as the account and a registry built here as ECR (docs/testing.md). A user's
script with no data in S3: `up` (cluster, storage, EFA, metrics, operator, the image pushed, the job), the job to the
end, `up` again, a code edit (the deploy refused until the image is pushed, then built, pushed and deployed),
`down`, and `audit`: nothing left. Every step as a user types it, each must exit 0."""
from __future__ import annotations

import json
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
    result = invoke("elasticjob.status", env=env, timeout=300)
    for state in ("Succeeded", "Failed", "Running", "Pending", "Restarting"):
        if state in result.stderr + result.stdout:
            return state
    return "?"


def test_up_job_up_again_code_edit_down_audit(env):
    timings = {}
    _, timings["up"] = ok("up", env=env, timeout=3600)
    doctor = invoke("doctor", env=env)
    assert "rehearsal" in (doctor.stdout + doctor.stderr).lower()
    wait_for(lambda: job_state(env) in ("Succeeded", "Failed"), 900, "the job to end")
    assert job_state(env) == "Succeeded"
    logs = invoke("elasticjob.logs", env=env).stdout
    assert "v1 step 1/1 world=" in logs, logs[-2000:]
    _, timings["up again"] = ok("up", env=env, timeout=1800)
    edited = env["TRAIN_SCRIPT"]
    open(edited, "w").write(SCRIPT.replace("VERSION", "v2"))
    refused = invoke("elasticjob.deploy", env=env)
    assert refused.returncode == 1 and "is not in ECR" in refused.stderr and "elasticjob.build elasticjob.push" in refused.stderr
    _, timings["build push"] = ok("elasticjob.build", "elasticjob.push", env=env)
    ok("elasticjob.deploy", "--fresh", env=env)
    wait_for(lambda: job_state(env) in ("Succeeded", "Failed"), 900, "the edited job to end")
    assert "v2 step 1/1" in invoke("elasticjob.logs", env=env).stdout
    _, timings["down"] = ok("down", "--yes", env=env, timeout=1800)
    audit, _ = ok("audit", env=env)
    assert "nothing left" in (audit.stdout + audit.stderr).lower() or "0 resource" in audit.stderr, audit.stderr
    print(json.dumps(timings))

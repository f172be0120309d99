"""`kubeflow.pytorchjob.submit --no-elastic`: a fixed-size PyTorchJob whose pods find each other.

The contract is what the training operator v1 gives each pod: `operator_env` below follows `setPodEnv` of
kubeflow/trainer v1.9.4 pkg/controller.v1/pytorch/envvar.go (MASTER_ADDR / PET_MASTER_ADDR and node ranks only when
the job has a Master replica; PET_NNODES = all replicas; without them torchrun's static rendezvous uses 127.0.0.1).
"""
from __future__ import annotations

import jsonschema
import pytest
import yaml

from doeks import trainimage
from doeks import jobspec
from doeks import settings as S

from .conftest import ROOT, invoke
from .test_jobspec import assert_shm_in_memory, crd_schema


def operator_env(job: dict, rtype: str, index: int) -> dict[str, str]:
    spec = job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    total = sum(r.get("replicas", 1) for r in replicas.values())
    env = {"PYTHONUNBUFFERED": "1"}
    if "Master" in replicas:  # GetMasterEnvVarGenerator: <job>-master-0, port 23456 by default
        env.update(MASTER_ADDR=f"{job['metadata']['name']}-master-0", PET_MASTER_ADDR=f"{job['metadata']['name']}-master-0",
                   MASTER_PORT="23456", PET_MASTER_PORT="23456")
        rank = index + (1 if rtype == "Worker" else 0)
        env.update(RANK=str(rank), PET_NODE_RANK=str(rank))
    if spec.get("nprocPerNode") is not None:
        env["PET_NPROC_PER_NODE"] = spec["nprocPerNode"]
    if spec.get("elasticPolicy") is None:
        env["PET_NNODES"] = str(total)
    return env


def torchrun_view(container: dict, env: dict[str, str]) -> dict[str, str]:
    """What torchrun's static rendezvous would use: flags win over PET_* variables, defaults otherwise."""
    command = container["command"]
    flags = {command[i].lstrip("-").replace("-", "_"): command[i + 1] for i in range(1, len(command) - 1)
             if command[i].startswith("--")}
    return {"nnodes": flags.get("nnodes", env.get("PET_NNODES", "1")),
            "node_rank": flags.get("node_rank", env.get("PET_NODE_RANK", "0")),
            "master_addr": flags.get("master_addr", env.get("PET_MASTER_ADDR", "127.0.0.1"))}


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_fixed_size_job_has_a_master_and_distinct_ranks(replicas, state_dir):
    s = S.load(environ={"STATE_DIR": str(state_dir), "REPLICAS": str(replicas), "MAX_REPLICAS": "4", "TARGET": "eks"}, path=ROOT / ".env")
    job = jobspec.pytorchjob_fixed(s)
    jsonschema.validate(job, crd_schema("kubeflow.org_pytorchjobs.crd.yaml", "v1"))
    assert "elasticPolicy" not in job["spec"]
    pods = [(rtype, i) for rtype, r in job["spec"]["pytorchReplicaSpecs"].items() for i in range(r["replicas"])]
    assert len(pods) == replicas and pods[0] == ("Master", 0)
    views = []
    for rtype, index in pods:
        container = job["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch" and container["image"] == trainimage.reference(s, False)
        assert_shm_in_memory(job["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"])
        views.append(torchrun_view(container, operator_env(job, rtype, index)))
    assert {v["master_addr"] for v in views} == {f"{s.job_name}-master-0"}
    assert sorted(int(v["node_rank"]) for v in views) == list(range(replicas))
    assert {v["nnodes"] for v in views} == {str(replicas)}


def test_elastic_job_is_unchanged(state_dir):
    s = S.load(environ={"STATE_DIR": str(state_dir), "TARGET": "eks"}, path=ROOT / ".env")
    job = jobspec.pytorchjob(s, run="r1")
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Worker"] and "elasticPolicy" in job["spec"]


def test_submit_no_elastic_dry_run_prints_master_and_workers(state_dir):
    result = invoke("kubeflow.pytorchjob.submit", "--dry-run", "--no-elastic", "--replicas", "3", env={"TARGET": "eks"})
    assert result.returncode == 0, result.stderr
    job = yaml.safe_load(result.stdout)
    views = [torchrun_view(r["template"]["spec"]["containers"][0], operator_env(job, rtype, i))
             for rtype, r in job["spec"]["pytorchReplicaSpecs"].items() for i in range(r["replicas"])]
    # was: Worker-only, so no pod had a master address but 127.0.0.1 and all were node rank 0
    assert [v["master_addr"] for v in views] == [f"{job['metadata']['name']}-master-0"] * 3
    assert sorted(v["node_rank"] for v in views) == ["0", "1", "2"]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2

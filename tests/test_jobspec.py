"""The elastic job's manifests: what `elasticjob.deploy` applies validates against upstream schemas."""
from __future__ import annotations

import jsonschema
import pytest
import yaml

from doeks import jobspec
from doeks import settings as S

from .conftest import ROOT, SCHEMAS, invoke


def crd_schema(filename: str, version: str) -> dict:
    crd = yaml.safe_load((SCHEMAS / filename).read_text())
    return next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version)


def k8s_validate(manifest: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(manifest, "1.31", strict=True)


@pytest.mark.parametrize("env", [{}, {"RDZV_BACKEND": "c10d"}, {"RDZV_BACKEND": "etcd-v2", "GPU_EFA": "false"},
                                 {"GPU_INSTANCE_TYPE": "p5.48xlarge", "NPROC_PER_NODE": "8", "NODE_LABELS": "team=ml"}])
def test_manifests_validate_against_upstream_schemas(env):
    s = S.load(environ=env, path=ROOT / ".env")
    manifests = jobspec.manifests(s)
    kinds = [m["kind"] for m in manifests]
    assert kinds[-1] == "PyTorchJob"
    assert ("Deployment" in kinds) == s.rdzv_backend.startswith("etcd")
    schema = crd_schema("kubeflow.org_pytorchjobs.crd.yaml", "v1")
    for manifest in manifests:
        if manifest["kind"] == "PyTorchJob":
            jsonschema.validate(manifest, schema)
        else:
            k8s_validate(manifest)
    job = manifests[-1]
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    k8s_validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": pod})
    elastic = job["spec"]["elasticPolicy"]
    assert (elastic["minReplicas"], elastic["maxReplicas"]) == (s.min_replicas, s.max_replicas)
    assert job["spec"]["nprocPerNode"] == str(s.nproc_per_node)
    assert ":latest" not in s.etcd_image


def test_schema_catches_a_broken_job():
    """The schema check itself can fail: a wrong type is rejected."""
    s = S.load(environ={}, path=ROOT / ".env")
    job = jobspec.pytorchjob(s)
    job["spec"]["elasticPolicy"]["minReplicas"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(job, crd_schema("kubeflow.org_pytorchjobs.crd.yaml", "v1"))


def test_pet_env_matches_what_the_operator_sets():
    s = S.load(environ={"MIN_REPLICAS": "1", "MAX_REPLICAS": "3"}, path=ROOT / ".env")
    env = jobspec.pet_env(jobspec.pytorchjob(s), "127.0.0.1:2379")
    assert env["PET_NNODES"] == "1:3" and env["PET_RDZV_BACKEND"] == "etcd"
    assert env["PET_RDZV_ENDPOINT"] == "127.0.0.1:2379" and env["PET_NPROC_PER_NODE"] == "2"
    assert "last_call_timeout=" in env["PET_RDZV_CONF"]


def test_deploy_dry_run_prints_the_local_plan_and_starts_nothing(state_dir):
    """On TARGET=local the plan is processes and folders (a local deploy printed a 172-line cluster manifest asking for
    nvidia.com/gpu, EFA and p4d nodes); the cluster targets' dry run is their manifests."""
    result = invoke("elasticjob.deploy", "--dry-run", "--replicas", "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and "nvidia.com/gpu" not in result.stderr and "p4d" not in result.stderr
    assert "would start node 2:" in result.stderr and "doeks.local.agent" in result.stderr
    assert "would start etcd" in result.stderr and "checkpoints in " in result.stderr and "model in " in result.stderr
    assert not (state_dir / "jobs").exists() and not (state_dir / "services").exists()
    cluster = invoke("elasticjob.deploy", "--dry-run", "--replicas", "3", env={"TARGET": "kubernetes"})
    docs = list(yaml.safe_load_all(cluster.stdout))
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "PyTorchJob"], cluster.stderr
    assert docs[-1]["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3

"""`kubeflow.trainjob.*`: the fixed-size job as a Kubeflow Trainer v2.3.0 TrainJob.

Checked against the v2.3.0 CRD in ../shared/schemas (jsonschema, plus a strict unknown-field walk, as `kubectl apply`'s
strict field validation would), against the rules the Trainer's admission webhook enforces (kubeflow/trainer v2.3.0
pkg/runtime/framework/plugins/jobset/jobset.go and torch/torch.go `Validate`), and against what the torch plugin then
gives each pod (torch.go `EnforceMLPolicy`), with the runtime's facts in tests/fixtures/kubeflow-upstream-facts.yaml.
"""
from __future__ import annotations

import re

import jsonschema
import pytest
import yaml

from doeks import trainimage
from doeks import settings as S
from doeks import trainjob

from .conftest import ROOT, invoke
from .test_jobspec import crd_schema

FACTS = yaml.safe_load((ROOT / "tests" / "fixtures" / "kubeflow-upstream-facts.yaml").read_text())["trainer"]
SCHEMA = "trainer.kubeflow.org_trainjobs-v2.3.0.crd.yaml"


def unknown_fields(value, schema: dict, path: str = "") -> list[str]:
    """Paths in `value` that `schema` does not declare (where it declares properties and keeps no unknown fields)."""
    found: list[str] = []
    if isinstance(value, dict) and schema.get("type", "object") == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if schema.get("x-kubernetes-preserve-unknown-fields") or props is None:
            if isinstance(extra, dict):
                for key, item in value.items():
                    found += unknown_fields(item, extra, f"{path}.{key}")
            return found
        for key, item in value.items():
            if key not in props:
                found.append(f"{path}.{key}")
            else:
                found += unknown_fields(item, props[key], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


def validate(job: dict) -> None:
    schema = crd_schema(SCHEMA, "v1alpha1")
    jsonschema.validate(job, schema)
    assert unknown_fields(job, schema) == [], "fields the v2.3.0 CRD does not declare"


DOMAIN_PREFIXED_PATH = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9/\-._~%!$&'()*+,;=:]+")


def webhook_errors(job: dict) -> list[str]:
    """The TrainJob checks of the Trainer v2.3.0 webhook that a schema cannot express."""
    errors = []
    spec = job["spec"]
    names = {(FACTS["replicated_job"], FACTS["container"])}
    for env in spec.get("trainer", {}).get("env", []):
        if env["name"] in FACTS["reserved_env"]:
            errors.append(f"reserved env {env['name']}")
    for patch in spec.get("runtimePatches", []):
        if not DOMAIN_PREFIXED_PATH.fullmatch(patch["manager"]):  # validation.IsDomainPrefixedPath
            errors.append(f"manager {patch['manager']!r} is not a domain-prefixed path")
        for rjob in patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {}).get("replicatedJobs", []):
            pod = rjob.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in pod.get("containers", []) + pod.get("initContainers", []):
                if (rjob["name"], c["name"]) not in names:
                    errors.append(f"container {rjob['name']}/{c['name']} not in the runtime")
                elif c.get("env"):
                    errors.append(f"env on the {c['name']} container in a patch")
    return errors


def pod_environment(job: dict, index: int) -> dict[str, str]:
    """What torch.go EnforceMLPolicy gives pod `index` of the `node` replicated job."""
    name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
    env = {e["name"]: e["value"] for e in trainer.get("env", [])}
    env.update(PET_NNODES=str(trainer.get("numNodes", 1)), PET_NPROC_PER_NODE=str(trainer.get("numProcPerNode", "auto")),
               PET_NODE_RANK=str(index), PET_MASTER_ADDR=f"{name}-node-0-0.{name}", PET_MASTER_PORT="29500")  # constants.ContainerTrainerPort
    return env


def load(env: dict | None = None, state_dir=None):
    return S.load(environ={"STATE_DIR": str(state_dir), "TARGET": "eks", **(env or {})}, path=ROOT / ".env")


def test_dry_run_prints_a_valid_trainjob(state_dir):
    result = invoke("kubeflow.trainjob.submit", "--dry-run", env={"TARGET": "eks"})
    assert result.returncode == 0, result.stderr
    job = yaml.safe_load(result.stdout)
    validate(job)
    assert webhook_errors(job) == []
    s = load(state_dir=state_dir)
    assert job["spec"]["trainer"]["image"] == trainimage.reference(s, False)
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": FACTS["runtime_kind"], "name": FACTS["runtime"]}
    assert "would run: kubectl apply --server-side" in result.stderr


@pytest.mark.parametrize("env", [{}, {"GPU_INSTANCE_TYPE": "p5.48xlarge", "NPROC_PER_NODE": "8", "REPLICAS": "4", "MAX_REPLICAS": "4"},
                                 {"GPU_EFA": "false", "NODE_LABELS": "team=ml"}, {"GPU_INSTANCE_TYPE": "g5.12xlarge", "NPROC_PER_NODE": "4"}])
def test_trainjob_from_settings(env, state_dir):
    s = load(env, state_dir)
    job = trainjob.trainjob(s)
    validate(job)
    assert webhook_errors(job) == []
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == s.replicas and trainer["numProcPerNode"] == s.nproc_per_node
    limits = trainer["resourcesPerNode"]["limits"]
    assert limits["nvidia.com/gpu"] == s.nproc_per_node
    # every EFA adapter of the node type (EC2's DescribeInstanceTypes: g5.12xlarge has one)
    efa = {"p4d.24xlarge": 4, "p5.48xlarge": 32, "g5.12xlarge": 1}.get(s.gpu_instance_type) if s.gpu_efa else None
    assert limits.get("vpc.amazonaws.com/efa") == efa
    pod = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert {"name": "shared", "persistentVolumeClaim": {"claimName": s.shared_pvc}} in pod["volumes"]
    assert pod["containers"][0]["volumeMounts"][0]["mountPath"] == s.shared_mount
    assert all(pod["nodeSelector"][k] == v for k, v in s.node_labels.items())
    # every pod gets one master and its own rank; the command adds no flag that would override PET_*
    assert trainer["command"] == ["torchrun", "/workspace/train.py"]
    views = [pod_environment(job, i) for i in range(trainer["numNodes"])]
    assert {v["PET_MASTER_ADDR"] for v in views} == {f"{s.job_name}-node-0-0.{s.job_name}"}
    assert sorted(int(v["PET_NODE_RANK"]) for v in views) == list(range(s.replicas))
    assert all(a.startswith(s.shared_mount) for a in trainer["args"] if a.startswith("/"))


def test_strict_check_catches_what_the_schema_lets_through(state_dir):
    job = trainjob.trainjob(load(state_dir=state_dir))
    job["spec"]["trainer"]["numNode"] = 2  # typo: the CRD schema alone accepts it (the API server would prune it)
    jsonschema.validate(job, crd_schema(SCHEMA, "v1alpha1"))
    assert unknown_fields(job, crd_schema(SCHEMA, "v1alpha1")) == [".spec.trainer.numNode"]
    old = trainjob.trainjob(load(state_dir=state_dir))
    spec = old["spec"]
    spec["podTemplateOverrides"] = spec.pop("runtimePatches")  # the v2.1.0 API: not in v2.3.0
    assert unknown_fields(old, crd_schema(SCHEMA, "v1alpha1")) == [".spec.podTemplateOverrides"]


def test_webhook_rules_are_checked(state_dir):
    job = trainjob.trainjob(load(state_dir=state_dir))
    job["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "3"})
    job["spec"]["runtimePatches"][0]["manager"] = "doeks"
    rjob = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    rjob["template"]["spec"]["template"]["spec"]["containers"][0]["name"] = "pytorch"
    assert len(webhook_errors(job)) == 3


def test_submit_refuses_off_cluster(state_dir):
    result = invoke("kubeflow.trainjob.submit", env={"TARGET": "local"})
    assert result.returncode == 1 and result.stderr.strip().startswith("error: TARGET=local")
    assert "Traceback" not in result.stderr


def test_delete_dry_run_names_the_trainjob(state_dir):
    result = invoke("kubeflow.trainjob.delete", "--dry-run", env={"TARGET": "eks"})
    assert result.returncode == 0, result.stderr
    assert "kubectl delete --ignore-not-found" in result.stderr


def test_trainer_deploy_dry_run_pins_v2_3_0_manager_then_runtimes(state_dir):
    result = invoke("kubeflow.trainer.deploy", "--dry-run", env={"TARGET": "eks"})
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "kubectl apply" in line]
    assert len(lines) == 2 and "overlays/manager?ref=v2.3.0" in lines[0] and "overlays/runtimes?ref=v2.3.0" in lines[1]
    assert trainjob.TRAINER_VERSION == FACTS["ref"]


def merged_pod(job: dict) -> dict:
    """The `node` pod the Trainer would create: the runtime's pod template (facts) with doeks' runtimePatch merged the
    strategic-merge way (containers and volumes by name, volumeMounts by mountPath; trainingruntime.go
    mergeRuntimePatches) and the trainer fields set on the `node` container (plugins/jobset/builder.go)."""
    trainer = job["spec"]["trainer"]
    pod = {"containers": [{"name": FACTS["container"], "image": FACTS["runtime_image"]}]}
    for patch in job["spec"]["runtimePatches"]:
        for rjob in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            assert rjob["name"] == FACTS["replicated_job"]
            spec = rjob["template"]["spec"]["template"]["spec"]
            pod["nodeSelector"] = {**pod.get("nodeSelector", {}), **spec.get("nodeSelector", {})}
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            volumes.update({v["name"]: v for v in spec.get("volumes", [])})
            pod["volumes"] = list(volumes.values())
            for c in spec.get("containers", []):
                target = next(t for t in pod["containers"] if t["name"] == c["name"])
                mounts = {m["mountPath"]: m for m in target.get("volumeMounts", [])}
                mounts.update({m["mountPath"]: m for m in c.get("volumeMounts", [])})
                target["volumeMounts"] = list(mounts.values())
    node = pod["containers"][0]
    node.update(image=trainer["image"], command=trainer["command"], args=trainer["args"], env=trainer["env"],
                resources=trainer["resourcesPerNode"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x-node-0-0"}, "spec": pod}


def test_the_node_pod_is_a_valid_pod_with_the_shared_volume_mounted(state_dir):
    import kubernetes_validate

    s = load(state_dir=state_dir)
    pod = merged_pod(trainjob.trainjob(s))
    kubernetes_validate.validate(pod, "1.31", strict=True)
    node = pod["spec"]["containers"][0]
    mounted = {m["name"]: m["mountPath"] for m in node["volumeMounts"]}
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["spec"]["volumes"]}
    assert claims[next(n for n, p in mounted.items() if p == s.shared_mount)] == s.shared_pvc
    assert mounted["dshm"] == "/dev/shm" and node["image"] == trainimage.reference(s, False)
    # the data and checkpoint paths the script gets live on the shared volume
    args = dict(zip(node["args"][::2], node["args"][1::2]))
    assert all(args[k].startswith(s.shared_mount + "/") for k in ("--data", "--checkpoint-dir", "--metrics-dir"))

"""The EKS rehearsal with a queue (issue 55): TARGET=eks on doeks' cluster with QUEUE set and KUBE_NODES=2, the nodes
made as EKS makes the node groups' nodes from the ClusterConfig doeks gives eksctl (doeks.eks.group_nodes): node
`doeks` a node of group `sys`, node `doeks-1` a p5en.48xlarge of group `gpu` with EKS' labels, EC2's topology
layers, the group's taint nvidia.com/gpu=true:NoSchedule and one node's GPUs and EFA interfaces from EC2's answer
(moto). Kueue (built here) with EKS' queue (the GPU type's flavor and Topology) admits the job by Topology Aware
Scheduling, which drops every node whose taint the job does not tolerate, and its pods train to the end on the tainted
node, pulling the training image from the registry (ECR's stand-in) through the bridge. Needs `invoke setup --kueue`
(opt-in, as tests/test_kubernetes_kueue.py: without it this module skips in one line)."""
from __future__ import annotations

import json
import subprocess
import time

import pytest

from .conftest import invoke, wait_for
from .test_rehearsal_cluster import _built
from .test_rehearsal_eks import SCRIPT, job_ended, ok

pytestmark = [pytest.mark.kubernetes, pytest.mark.slow, pytest.mark.cluster_down, pytest.mark.timeout(2400)]

INSTANCE = "p5en.48xlarge"  # EC2's topology covers it: Kueue places by Topology, where taints drop nodes
GPU_NODE = "doeks-1"


def _kueue_built() -> bool:
    from doeks.cluster import operators

    return all(operators.binary(op).exists() for op in operators.QUEUE_BUILDS.values())


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import os

    if not _built():
        if os.environ.get("CI"):
            pytest.fail("CI must have doeks' cluster and the registry built (invoke setup --kubernetes)")
        pytest.skip("doeks' cluster or the registry is not built (invoke setup --kubernetes)")
    if not _kueue_built():
        pytest.skip("Kueue and kwok are not built: `invoke setup --kueue` builds them")
    folder = tmp_path_factory.mktemp("rehearsal-kueue")
    code = folder / "code"
    code.mkdir()
    (code / "train.py").write_text(SCRIPT.replace("VERSION", "queued"))
    values = {"TARGET": "eks", "EKS_REHEARSAL": "true", "STATE_DIR": str(folder / "state"), "KUBECONFIG": "",
              "TRAIN_SCRIPT": str(code / "train.py"), "GPU_INSTANCE_TYPE": INSTANCE, "NPROC_PER_NODE": "1",
              "EFA_PER_NODE": "1", "GPU_NODES_MAX": "1", "REPLICAS": "2", "MIN_REPLICAS": "1", "MAX_REPLICAS": "2",
              "JOB_NAME": "queued", "QUEUE": "team-a", "KUBE_NODES": "2", "COLUMNS": "200"}
    invoke("down", "--yes", env={"TARGET": "kubernetes", "KUBECONFIG": ""}, timeout=900)  # the run's one cluster
    yield values
    invoke("down", "--yes", env=values, timeout=900)
    invoke("eks.delete", env={**values, "TARGET": "local", "EKS_REHEARSAL": "false"}, timeout=300)  # the account


def kubectl_json(*args: str) -> dict:
    from doeks import kube
    from doeks.cluster import versions

    got = subprocess.run([kube.wheel_kubectl() or kube.kubectl(), f"--kubeconfig={versions.kubeconfig()}", *args,
                          "-o", "json"], capture_output=True, text=True, timeout=60)
    return json.loads(got.stdout) if got.returncode == 0 else {}


def workload(name: str) -> dict:
    job = kubectl_json("get", "pytorchjob", name, "-n", "default")
    uid = job.get("metadata", {}).get("uid")
    found = kubectl_json("get", "workloads", "-n", "default", "-l", f"kueue.x-k8s.io/job-uid={uid}") if uid else {}
    return (found.get("items") or [{}])[0]


def conditions(wl: dict) -> dict:
    return {c["type"]: c for c in wl.get("status", {}).get("conditions", [])}


def test_a_queued_job_is_admitted_and_trains_on_the_tainted_gpu_node(env):
    timings = {}
    up, timings["up"] = ok("up", env=env, timeout=3600)
    said = up.stdout + up.stderr
    assert f"node {GPU_NODE}: {INSTANCE} of node group gpu" in said, said[-3000:]

    nodes = {n["metadata"]["name"]: n for n in kubectl_json("get", "nodes")["items"]}
    gpu, system = nodes[GPU_NODE], nodes["doeks"]
    labels = gpu["metadata"]["labels"]
    assert labels["node.kubernetes.io/instance-type"] == INSTANCE and labels["eks.amazonaws.com/nodegroup"] == "gpu"
    assert labels["eks.amazonaws.com/capacityType"] == "ON_DEMAND" and labels["vpc.amazonaws.com/efa.present"] == "true"
    assert labels["topology.kubernetes.io/region"] == "us-west-2" and labels["topology.kubernetes.io/zone"].startswith("us-west-2")
    assert all(labels[f"topology.k8s.aws/network-node-layer-{i}"].startswith("nn-") for i in (1, 2, 3))
    assert gpu["spec"]["taints"] == [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]
    assert gpu["status"]["allocatable"]["nvidia.com/gpu"] == "8"           # EC2's answer for p5en.48xlarge (moto)
    assert gpu["status"]["allocatable"]["vpc.amazonaws.com/efa"] == "16"
    assert system["metadata"]["labels"]["eks.amazonaws.com/nodegroup"] == "sys"
    assert not system["spec"].get("taints") and "nvidia.com/gpu" not in system["status"]["allocatable"]

    started = time.monotonic()
    wait_for(lambda: conditions(workload("queued")).get("Admitted", {}).get("status") == "True", 300,
             "Kueue admitting the job (its Workload: " + json.dumps(conditions(workload("queued")))[:1500] + ")", poll=3)
    wl = workload("queued")
    assignment = wl["status"]["admission"]["podSetAssignments"][0]
    assert assignment["flavors"]["nvidia.com/gpu"] == INSTANCE, assignment
    assert assignment.get("topologyAssignment"), assignment  # placed by Topology Aware Scheduling
    assert wait_for(lambda: job_ended(env), 900, "the queued job to end", poll=2) == "Succeeded"
    timings["admitted and trained"] = time.monotonic() - started
    pods = kubectl_json("get", "pods", "-n", "default", "-l", "training.kubeflow.org/job-name=queued")["items"]
    assert pods and {p["spec"]["nodeName"] for p in pods} == {GPU_NODE}, [p["spec"].get("nodeName") for p in pods]
    logs, _ = ok("elasticjob.logs", env=env)
    assert "queued step 1/1 world=2" in logs.stdout, logs.stdout[-2000:]
    status, _ = ok("elasticjob.status", env=env)
    assert "queue team-a: finished" in status.stdout + status.stderr, (status.stdout + status.stderr)[-2000:]

    down, timings["down"] = ok("down", "--yes", env=env, timeout=1800)
    print("rehearsal with a queue, timings (s):", json.dumps({k: round(v) for k, v in timings.items()}))

"""Kueue on EKS admits what EKS can run (issue 55, 1; issue 57's survivor): the GPU node group is tainted
nvidia.com/gpu=true:NoSchedule (eksctl, doeks' ClusterConfig), EKS adds the toleration only when a pod is made, after
Kueue decided, and Kueue v0.19.2's Topology Aware Scheduling drops every node whose taint the job does not tolerate.
So the flavor and the job's pods tolerate it, and the ClusterQueue's quotas are what GPU_NODES_MAX nodes of the type
have, as the real moto server answers EC2's DescribeInstanceTypes (AWS's published data): a GPU type without EFA
gets its GPU quota, a type with EFA its EFA quota."""
from __future__ import annotations

import pytest
import yaml

from doeks.jobspec import GPU_TOLERATION

from . import moto_eks
from .conftest import invoke

# one node of each type as EC2 says: (GPUs, EFA interfaces, vCPUs, memory MiB)
NODE = {"g5.2xlarge": (1, 0, 8, 32768), "g6.xlarge": (1, 0, 4, 16384), "g5.12xlarge": (4, 1, 48, 196608),
        "g6e.24xlarge": (4, 2, 96, 786432), "p5en.48xlarge": (8, 16, 192, 2097152)}


@pytest.fixture
def account(state_dir, tmp_path):
    server = moto_eks.server(state_dir)
    server.start()
    yield {"TARGET": "eks", "AWS_ENDPOINT_URL": server.endpoint(), "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "DOEKS_CACHE": str(tmp_path / "cache"), "COLUMNS": "250"}
    server.stop()


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.mark.parametrize("instance", sorted(NODE))
def test_the_gpu_flavor_tolerates_the_taint_and_its_quotas_are_what_the_nodes_have(account, instance):
    gpus, efa, vcpus, memory = NODE[instance]
    plan = invoke("kueue.deploy", "--dry-run", env={**account, "GPU_INSTANCE_TYPE": instance, "GPU_NODES_MAX": "3"})
    assert plan.returncode == 0, plan.stderr[-2000:]
    found = docs(plan.stdout)
    flavor = next(d for d in found if d["kind"] == "ResourceFlavor")
    assert flavor["spec"]["tolerations"] == [GPU_TOLERATION]
    queue = next(d for d in found if d["kind"] == "ClusterQueue")
    quota = {r["name"]: r["nominalQuota"] for r in queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"]}
    assert quota == {"cpu": 3 * vcpus, "memory": f"{3 * memory}Mi", "nvidia.com/gpu": 3 * gpus,
                     "vpc.amazonaws.com/efa": 3 * efa}, quota


def test_what_the_user_sets_stands_and_offline_the_tables_answer(account):
    mine = invoke("kueue.deploy", "--dry-run", env={**account, "GPU_INSTANCE_TYPE": "g6.xlarge", "QUEUE_GPUS": "2"})
    queue = next(d for d in docs(mine.stdout) if d["kind"] == "ClusterQueue")
    quota = {r["name"]: r["nominalQuota"] for r in queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"]}
    assert quota["nvidia.com/gpu"] == 2 and quota["vpc.amazonaws.com/efa"] == 0
    offline = {k: v for k, v in account.items() if not k.startswith("AWS_")}
    plan = invoke("kueue.deploy", "--dry-run", env={**offline, "GPU_INSTANCE_TYPE": "g5.2xlarge", "AWS_PROFILE": "",
                                                    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                                                    "AWS_CONFIG_FILE": "/nonexistent"})
    assert plan.returncode == 0, plan.stderr[-2000:]
    queue = next(d for d in docs(plan.stdout) if d["kind"] == "ClusterQueue")
    quota = {r["name"]: r["nominalQuota"] for r in queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"]}
    assert quota["nvidia.com/gpu"] == 4 and quota["vpc.amazonaws.com/efa"] == 0  # GPU_NODES_MAX=4 x 1


@pytest.mark.parametrize("command", ["elasticjob.deploy", "kubeflow.trainjob.submit"])
def test_the_training_pods_tolerate_the_gpu_taint(account, command):
    plan = invoke(*command.split(), "--dry-run", env={**account, "GPU_INSTANCE_TYPE": "g6.xlarge", "QUEUE": "doeks"})
    assert plan.returncode == 0, plan.stderr[-2000:]
    pods = []
    for doc in docs(plan.stdout):
        if doc["kind"] == "PyTorchJob":
            pods += [spec["template"]["spec"] for spec in doc["spec"]["pytorchReplicaSpecs"].values()]
        if doc["kind"] == "TrainJob":
            pods += [p["spec"] for patch in doc["spec"].get("runtimePatches", [])
                     for job in patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {}).get(
                         "replicatedJobs", []) for p in [job["template"]["spec"]["template"]]]
    assert pods, plan.stdout[-2000:]
    for pod in pods:
        assert GPU_TOLERATION in pod.get("tolerations", []), pod


@pytest.mark.parametrize("instance", ["p5en.48xlarge", "g6.xlarge"])
def test_the_rehearsals_nodes_are_made_from_the_node_groups_eksctl_gets(account, instance):
    """One definition for both (doeks.eks.group_nodes): what eksctl's GPU group carries (its labels and taint, EFA
    where enabled) is what the rehearsal's GPU nodes carry, with EKS' own labels, EC2's topology layers where doeks'
    Kueue Topology places by them, and one node's GPUs and EFA from EC2's DescribeInstanceTypes (moto)."""
    from doeks import eks, instancetypes, kueue, rehearsal
    from doeks import settings as S
    from doeks.jobspec import GPU_TAINT

    s = S.load(environ={**account, "GPU_INSTANCE_TYPE": instance, "KUBE_NODES": "3"})
    config = eks.cluster_config(s, (["us-west-2a", "us-west-2b"], "us-west-2b"))
    gpu = next(g for g in config["managedNodeGroups"] if g["name"] == "gpu")
    roles = rehearsal.node_roles(s, config, "us-west-2b", ["doeks", "doeks-1", "doeks-2"])
    gpus, efa, _, _ = NODE[instance]
    assert instancetypes.node_facts(s, instance)["gpus"] == gpus
    for name in ("doeks-1", "doeks-2"):
        node = roles[name]
        assert node["taints"] == gpu["taints"] == [GPU_TAINT]
        assert gpu["labels"].items() <= node["labels"].items()
        assert node["labels"]["node.kubernetes.io/instance-type"] == instance
        assert node["labels"]["topology.kubernetes.io/zone"] == "us-west-2b"
        assert node["labels"]["topology.kubernetes.io/region"] == "us-west-2"
        assert node["labels"]["eks.amazonaws.com/nodegroup"] == "gpu"
        assert node["labels"]["eks.amazonaws.com/capacityType"] == "ON_DEMAND"
        assert node["labels"]["alpha.eksctl.io/nodegroup-name"] == "gpu"
        assert (node["labels"].get("vpc.amazonaws.com/efa.present") == "true") == bool(efa) == gpu.get("efaEnabled", False)
        assert all(k in node["labels"] for k in kueue.LAYERS) == kueue.has_topology(instance)
        assert node["capacity"] == {"nvidia.com/gpu": str(gpus), "vpc.amazonaws.com/efa": str(efa) if efa else None}
    system = roles["doeks"]
    assert system["labels"]["eks.amazonaws.com/nodegroup"] == "sys" and system["taints"] == []
    assert system["capacity"] == {"nvidia.com/gpu": None, "vpc.amazonaws.com/efa": None}

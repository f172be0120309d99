"""Queues without a cluster: the queue label and topology annotation on both job kinds (checked against their CRD
schemas), the kueue unit's plan on EKS (the contract: Kueue's release manifests with doeks' Configuration, a
ResourceFlavor of the GPU node type with EKS' topology, the ClusterQueue's quotas from .env, the LocalQueue), its
place in `up`/`down`, the Kueue/Trainer version rule `doctor` applies, and the simulated nodes' Node objects (checked
strictly against Kubernetes' own schema). Admission itself is real on doeks' cluster: tests/test_kubernetes_kueue.py.
"""
from __future__ import annotations

import jsonschema
import pytest
import yaml

from doeks import jobspec, kueue, trainjob
from doeks import settings as S
from doeks.cluster import simnodes

from .conftest import ROOT, invoke
from .test_jobspec import crd_schema, k8s_validate
from .test_trainjob import validate as validate_trainjob


def load(**env):
    return S.load(environ={k: str(v) for k, v in env.items()}, path=ROOT / ".env")


def test_queue_label_and_one_block_on_both_job_kinds():
    s = load(QUEUE="team-a", TOPOLOGY="required", GPU_INSTANCE_TYPE="p5.48xlarge")
    job = jobspec.pytorchjob(s)
    jsonschema.validate(job, crd_schema("kubeflow.org_pytorchjobs.crd.yaml", "v1"))
    assert job["metadata"]["labels"][kueue.QUEUE_LABEL] == "team-a"
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]
    assert worker["annotations"] == {"kueue.x-k8s.io/podset-required-topology": "topology.k8s.aws/network-node-layer-3"}
    assert jobspec.pytorchjob_fixed(s)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["annotations"]
    tj = trainjob.trainjob(s)
    validate_trainjob(tj)
    assert tj["metadata"]["labels"][kueue.QUEUE_LABEL] == "team-a"
    patch = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert patch["template"]["spec"]["template"]["metadata"]["annotations"] == {
        "kueue.x-k8s.io/podset-preferred-topology" if False else "kueue.x-k8s.io/podset-required-topology":
        "topology.k8s.aws/network-node-layer-3"}
    preferred = load(QUEUE="team-a", TOPOLOGY="preferred")
    assert "kueue.x-k8s.io/podset-preferred-topology" in \
        jobspec.pytorchjob(preferred)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["annotations"]


@pytest.mark.parametrize("env", [{}, {"TOPOLOGY": "required"}])
def test_without_a_queue_jobs_carry_nothing_of_kueue(env):
    s = load(**env)
    job, tj = jobspec.pytorchjob(s), trainjob.trainjob(s)
    assert kueue.QUEUE_LABEL not in job["metadata"]["labels"] and kueue.QUEUE_LABEL not in tj["metadata"]["labels"]
    assert "annotations" not in job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]
    assert "metadata" not in tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][
        "replicatedJobs"][0]["template"]["spec"]["template"]


@pytest.mark.parametrize("key,value", [("QUEUE", "Team_A"), ("QUEUE_CPU", "1.5"), ("QUEUE_MEMORY", "lots"),
                                       ("QUEUE_GPUS", "-1"), ("TOPOLOGY", "rack"), ("KUBE_SIM_NODES", "1001"),
                                       ("KUBE_SIM_NODE_TYPE", "p5")])
def test_bad_queue_settings_name_the_key(key, value):
    with pytest.raises(S.SettingsError, match=f"^{key}="):
        load(**{key: value})


def test_a_bad_queue_setting_is_one_line_from_the_cli(state_dir):
    result = invoke("kueue.deploy", "--dry-run", env={"TARGET": "eks", "QUEUE_CPU": "1.5"})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: QUEUE_CPU='1.5' is not accepted")


def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def test_eks_plan_is_the_release_with_doeks_configuration_and_the_gpu_type_queue(state_dir):
    env = {"TARGET": "eks", "QUEUE": "team-a", "GPU_INSTANCE_TYPE": "p5.48xlarge", "QUEUE_GPUS": "128",
           "QUEUE_EFA": "512", "QUEUE_CPU": "1500", "QUEUE_MEMORY": "16Ti", "NAMESPACE": "ml"}
    result = invoke("kueue.deploy", "--dry-run", env=env, check=True)
    docs = _docs(result.stdout)
    kinds = [d["kind"] for d in docs]
    assert kinds == ["Kustomization", "Configuration", "Topology", "ResourceFlavor", "ClusterQueue", "LocalQueue"]
    custom = docs[0]
    assert custom["resources"] == [kueue.RELEASE_MANIFESTS] and "images" not in custom
    config = docs[1]
    assert {"kubeflow.org/pytorchjob", "trainer.kubeflow.org/trainjob"} <= set(config["integrations"]["frameworks"])
    assert config["waitForPodsReady"]["timeout"] == kueue.PODS_READY_TIMEOUT
    assert [level["nodeLabel"] for level in docs[2]["spec"]["levels"]] == [
        "topology.k8s.aws/network-node-layer-1", "topology.k8s.aws/network-node-layer-2",
        "topology.k8s.aws/network-node-layer-3", "kubernetes.io/hostname"]
    assert docs[3]["spec"] == {"nodeLabels": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
                               "topologyName": "eks-network", "tolerations": [jobspec.GPU_TOLERATION]}
    quota = {r["name"]: r["nominalQuota"] for r in docs[4]["spec"]["resourceGroups"][0]["flavors"][0]["resources"]}
    assert quota == {"cpu": "1500", "memory": "16Ti", "nvidia.com/gpu": 128, "vpc.amazonaws.com/efa": 512}
    assert docs[5]["metadata"] == {"name": "team-a", "namespace": "ml", "labels": {"app.kubernetes.io/part-of": "doeks"}}
    assert "kubectl apply --server-side --field-manager=doeks --force-conflicts -k" in result.stderr
    gone = invoke("kueue.delete", "--dry-run", env=env, check=True)
    assert "kubectl delete localqueues --all" in gone.stderr and "-k" in gone.stderr


def test_a_gpu_type_without_eks_topology_gets_no_topology(state_dir):
    docs = _docs(invoke("kueue.deploy", "--dry-run", env={"TARGET": "eks", "GPU_INSTANCE_TYPE": "g5.12xlarge"},
                        check=True).stdout)
    assert "Topology" not in [d["kind"] for d in docs]
    flavor = next(d for d in docs if d["kind"] == "ResourceFlavor")
    assert "topologyName" not in flavor["spec"]
    quota = {r["name"]: r["nominalQuota"] for r in next(d for d in docs if d["kind"] == "ClusterQueue")["spec"][
        "resourceGroups"][0]["flavors"][0]["resources"]}
    assert quota["vpc.amazonaws.com/efa"] == 4  # g5.12xlarge has one EFA interface (EC2): GPU_NODES_MAX=4 of them
    assert quota["nvidia.com/gpu"] == 16


def test_kueue_comes_after_the_operators_and_before_the_job(state_dir):
    up = invoke("up", "--dry-run", "--full", env={"TARGET": "eks"}, check=True).stderr
    order = [line.split("== up: ")[1].strip() for line in up.splitlines() if "== up: " in line]
    assert order.index("kubeflow") < order.index("kueue") < order.index("elasticjob")
    down = invoke("down", "--dry-run", env={"TARGET": "eks"}, check=True).stderr
    order = [line.split("== down: ")[1].strip() for line in down.splitlines() if "== down: " in line]
    assert order.index("elasticjob") < order.index("kueue") < order.index("kubeflow")


def test_on_this_machine_there_is_no_queue(state_dir):
    result = invoke("kueue.deploy", env={"TARGET": "local"}, check=True)
    assert "TARGET=local: no cluster for Kueue" in result.stderr


def test_the_eks_rehearsal_queues_with_kueue_built_here_not_the_release_from_github(state_dir, tmp_path):
    """EKS' Kueue is the release's manifests.yaml from GitHub, which the rehearsal (doeks' cluster as EKS, nothing
    leaves this machine) cannot fetch: its `up` failed in the kueue unit. It uses doeks' cluster's Kueue, built here by
    `invoke setup --kueue`, or no queue."""
    script = tmp_path / "fit.py"
    script.write_text("print('a script of its own: no ImageNet data needed')\n")
    result = invoke("up", "--dry-run", "--full", env={"TARGET": "eks", "EKS_REHEARSAL": "true", "TRAIN_SCRIPT": str(script),
                                            "DOEKS_CACHE": str(tmp_path / "empty-cache")})
    plan = result.stderr.split("== up: kueue", 1)[1].split("== up: ", 1)[0]
    assert "github.com" not in plan and "no queue here" in plan, plan


def test_without_the_kueue_build_the_plan_says_there_is_no_queue(state_dir, tmp_path):
    """`up` on doeks' cluster skips Kueue when `invoke setup --kueue` has not built it: its dry run says the same, not
    a build (the plan once said it would build and import Kueue, which `up` never did)."""
    result = invoke("up", "--dry-run", "--full", env={"TARGET": "kubernetes", "DOEKS_CACHE": str(tmp_path / "empty-cache")})
    plan = result.stderr.split("== up: kueue", 1)[1].split("== up: ", 1)[0]
    assert "Kueue v0.19.2 is not built (`invoke setup --kueue` builds it and kwok): no queue here" in plan, plan
    assert "would build" not in plan and "would import" not in plan


@pytest.mark.parametrize("kueue_version,trainer,ok,said", [
    ("v0.19.2", "v2.3.0", True, "runtimePatches"),
    ("v0.19.2", "v2.2.1", True, "runtimePatches"),
    ("v0.19.2", "v2.1.0", False, "kueue#11931"),
    ("v0.16.9", "v2.1.0", True, "podTemplateOverrides"),
    ("v0.16.9", "v2.3.0", False, "use Kueue v0.17+"),
    ("v0.19.2", "v2.4.0", False, "newer"),
])
def test_doctor_rule_for_kueue_and_trainer(kueue_version, trainer, ok, said):
    agrees, why = kueue.versions_agree(kueue_version, trainer)
    assert agrees is ok and said in why
    assert "kueue#14836" in kueue.versions_agree("v0.19.2", "v2.3.0")[1]  # the release image: v2.2.1's library
    assert "kueue#14836" not in kueue.versions_agree("v0.19.2", "v2.3.0", library=kueue.TRAINER_LIBRARY)[1]


def test_simulated_p5_nodes_are_eks_shaped_and_spread_in_blocks():
    nodes = simnodes.manifests(64, "p5.48xlarge", "us-west-2", "us-west-2a", seed="doeks/p5.48xlarge")
    assert len(nodes) == 64 and len({n["metadata"]["name"] for n in nodes}) == 64
    for node in nodes[:2]:
        k8s_validate(node)
    first = nodes[0]
    assert first["status"]["capacity"]["nvidia.com/gpu"] == "8" and first["status"]["capacity"]["vpc.amazonaws.com/efa"] == "32"
    assert first["status"]["allocatable"]["cpu"] == "191450m"   # EKS' kube-reserved for 192 vCPUs: 550m
    assert first["metadata"]["labels"]["node.kubernetes.io/instance-type"] == "p5.48xlarge"
    assert first["spec"]["taints"] == [simnodes.TAINT]
    blocks: dict[str, int] = {}
    for node in nodes:
        labels = node["metadata"]["labels"]
        assert all(labels[layer].startswith("nn-") and len(labels[layer]) == 20 for layer in simnodes.LAYERS)
        blocks[labels[simnodes.LAYERS[2]]] = blocks.get(labels[simnodes.LAYERS[2]], 0) + 1
    assert len(blocks) >= 4 and all(count <= 16 for count in blocks.values())
    assert simnodes.manifests(64, "p5.48xlarge", "us-west-2", "us-west-2a", seed="doeks/p5.48xlarge") == nodes
    with pytest.raises(Exception, match="no shape"):
        simnodes.manifests(1, "x1.32xlarge", "us-west-2", "us-west-2a", seed="s")


def test_on_doeks_cluster_the_simulated_type_is_a_tas_flavor_beside_the_node():
    """Kueue v0.19 gives a job without a topology request a flavor with a Topology only in a queue whose every flavor
    has one: the real node gets a Topology of its own (the node level), so jobs reach either; the simulated type has
    no CPU or memory quota, so a job that trains here (it asks for CPU) never lands on nodes that run nothing.
    What doeks' cluster's `kueue.deploy` applies, rendered from the target's own flavors: Kueue's build is opt-in
    (`invoke setup --kueue`), and without it the plan is "no queue" (test below); applied for real in
    tests/test_kubernetes_kueue.py."""
    from doeks.cluster import operators
    from doeks.targets.kubernetes import KubernetesTarget

    custom = kueue.kustomization(str(operators.module_dir(operators.KUEUE) / operators.KUEUE.overlay), own=True)
    assert custom["resources"][0].endswith("config/default") and custom["images"][0]["newName"] == "registry.k8s.io/kueue/kueue"
    s = load(TARGET="kubernetes", KUBE_SIM_NODES=8, KUBE_SIM_NODE_TYPE="p5.48xlarge")
    docs = kueue.queue_manifests(s, KubernetesTarget(s).queue_flavors())
    topologies = {d["metadata"]["name"]: [level["nodeLabel"] for level in d["spec"]["levels"]]
                  for d in docs if d["kind"] == "Topology"}
    assert topologies == {"eks-network": [*kueue.LAYERS, "kubernetes.io/hostname"], "node": ["kubernetes.io/hostname"]}
    flavors = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "ResourceFlavor"}
    assert flavors["doeks-node"] == {"nodeLabels": {"kubernetes.io/hostname": "doeks"}, "topologyName": "node"}
    assert flavors["p5.48xlarge"]["tolerations"] == [simnodes.TOLERATION]
    queue = next(d for d in docs if d["kind"] == "ClusterQueue")["spec"]["resourceGroups"][0]["flavors"]
    quota = {f["name"]: {r["name"]: r["nominalQuota"] for r in f["resources"]} for f in queue}
    assert quota["p5.48xlarge"]["cpu"] == 0 and quota["p5.48xlarge"]["memory"] == 0
    assert quota["doeks-node"]["nvidia.com/gpu"] == 0 and quota["p5.48xlarge"]["nvidia.com/gpu"] == 64
    plain_s = load(TARGET="kubernetes")
    plain = kueue.queue_manifests(plain_s, KubernetesTarget(plain_s).queue_flavors())
    assert "Topology" not in [d["kind"] for d in plain]  # the node alone: no topology to place by

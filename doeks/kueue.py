"""Kueue (kubernetes-sigs/kueue) on the cluster: quotas per queue, all-or-nothing admission of a job's pods
(`waitForPodsReady`), and placement of a job's pods in one network block (Topology Aware Scheduling on EKS'
`topology.k8s.aws/network-node-layer-{1,2,3}` labels).

Which Kueue, and why (sources read: kueue v0.19.2, its main after PR #14504, kubeflow/trainer v2.2.1 and v2.3.0):
- Kueue's TrainJob integration follows Trainer's API. Trainer v2.2 replaced `podTemplateOverrides` with
  `runtimePatches` (kubeflow/trainer#3309); Kueue v0.17+ writes its node selectors, tolerations and scheduling gates
  into a runtime patch of its own (manager `kueue.x-k8s.io/manager`), so Kueue v0.17+ never admits a TrainJob of
  Trainer v2.1 or older ("kueue runtime patch not found", kueue#11931), and Kueue v0.16 or older none of v2.2+.
- Kueue v0.19.x was built against Trainer's library v2.2.1. Trainer v2.3.0's TrainJob has the same shape but one
  field (`runtimePatches[].trainingRuntimeSpec.template.spec.replicatedJobs[].template.spec.template.spec.
  terminationGracePeriodSeconds`), which Kueue v0.19's full-object Update of an admitted TrainJob drops (fixed on
  main by a merge patch, kueue#14836); doeks' TrainJob does not set it. Kueue's PR #14504 ("support Trainer v2.3",
  on main after v0.19.2) only raised the library to v2.3.0 (v2.3.0 merges runtime patches with strategic-merge
  semantics, which Kueue calls in-process to compute a TrainJob's pods).
- The Go module proxy serves v0.17.0, v0.17.1 and v0.19.0 to v0.19.2 only (v0.19.3+, v0.20.x and main's
  pseudo-versions, e.g. v0.20.0-devel.0.20260816183615-22553e5417b2 = PR #14504: 403 "This module version is not
  available"). So doeks builds v0.19.2 with Trainer's library raised to v2.3.0 in its own build module (minimum
  version selection, no replace: doeks.cluster.operators.KUEUE), which is what PR #14504 changed.
- The elastic PyTorchJob (training operator v1.9.4) goes through Kueue's `kubeflow.org/pytorchjob` integration,
  deprecated with the v1 operator and off in Kueue's default Configuration: doeks' Configuration turns it on.
  Kueue counts the Worker replicas the job has when it is queued; `elasticjob.scale` on a queued job changes them,
  and Kueue stops it and queues it again at the new size (it resumes from its checkpoint).

Where: doeks' own cluster runs the Kueue built here, from the module's own `config/default` (its webhooks serving
with the certificates Kueue's internal cert management makes, as its manifests arrange: no cert-manager), under the
image name its release manifests use; any other cluster (EKS, the user's) gets the release manifests. Both with
doeks' Configuration (upstream's defaults, PyTorchJob on, waitForPodsReady on).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import ui
from .errors import DoeksError

VERSION = "v0.19.2"
TRAINER_LIBRARY = "v2.3.0"            # the Trainer API library of the Kueue doeks builds (doeks.cluster.operators)
RELEASE_TRAINER_LIBRARY = "v2.2.1"    # ... and of the release image (kueue v0.19.2 go.mod)
IMAGE = f"registry.k8s.io/kueue/kueue:{VERSION}"                     # as the release manifests name it
MODULE_IMAGE = "us-central1-docker.pkg.dev/k8s-staging-images/kueue/kueue"  # as the module's config/default names it
RELEASE_MANIFESTS = f"https://github.com/kubernetes-sigs/kueue/releases/download/{VERSION}/manifests.yaml"
NAMESPACE = "kueue-system"
DEPLOYMENT = "kueue-controller-manager"
CONFIG_MAP = "kueue-manager-config"
CONFIG_KEY = "controller_manager_config.yaml"
API = "kueue.x-k8s.io/v1beta2"
from .jobspec import QUEUE_LABEL  # noqa: E402 - where the jobs are made (with TOPOLOGY's annotations)
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
CLUSTER_QUEUE = "doeks"
DEFAULT_QUEUE = "doeks"               # the LocalQueue's name when QUEUE is empty
TOPOLOGY = "eks-network"            # EKS' network layers, then the node
NODE_TOPOLOGY = "node"              # the node alone: for nodes without EKS' topology labels
LAYERS = tuple(f"topology.k8s.aws/network-node-layer-{n}" for n in (1, 2, 3))
HOSTNAME = "kubernetes.io/hostname"
RESOURCES = ("cpu", "memory", "nvidia.com/gpu", "vpc.amazonaws.com/efa")
# kueue v0.19.2 config/components/manager/controller_manager_config.yaml's integrations, plus the PyTorchJob
FRAMEWORKS = ("batch/job", "kubeflow.org/mpijob", "kubeflow.org/pytorchjob", "ray.io/rayjob", "ray.io/raycluster",
              "ray.io/rayservice", "jobset.x-k8s.io/jobset", "workload.codeflare.dev/appwrapper",
              "trainer.kubeflow.org/trainjob", "pod", "deployment", "statefulset",
              "leaderworkerset.x-k8s.io/leaderworkerset")
PODS_READY_TIMEOUT = "10m"   # a job's pods all ready within this after admission, else evicted and queued again


def queue_name(settings) -> str:
    return settings.queue or DEFAULT_QUEUE


# -- the Configuration and the manifests ---------------------------------------------------------------------------
def configuration() -> dict[str, Any]:
    """Kueue's Configuration (the manager's ConfigMap): v0.19.2's defaults, the PyTorchJob integration on and
    waitForPodsReady on (a job's pods all Running within PODS_READY_TIMEOUT of admission, else it is evicted and
    queued again; blockAdmission: the next job waits until the admitted one's pods are ready)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "health": {"healthProbeBindAddress": ":8081"}, "metrics": {"bindAddress": ":8443"},
        "webhook": {"port": 9443},
        "leaderElection": {"leaderElect": True, "resourceName": "c1f6bfd2.kueue.x-k8s.io"},
        "controller": {"groupKindConcurrency": {"Job.batch": 5, "Pod": 5, "Workload.kueue.x-k8s.io": 10,
                                                "LocalQueue.kueue.x-k8s.io": 5, "Cohort.kueue.x-k8s.io": 1,
                                                "ClusterQueue.kueue.x-k8s.io": 5, "ResourceFlavor.kueue.x-k8s.io": 1}},
        "clientConnection": {"qps": 300, "burst": 500},
        "waitForPodsReady": {"timeout": PODS_READY_TIMEOUT, "blockAdmission": True,
                             "requeuingStrategy": {"timestamp": "Eviction", "backoffBaseSeconds": 60,
                                                   "backoffMaxSeconds": 3600}},
        "integrations": {"frameworks": list(FRAMEWORKS)},
    }


def _block_yaml(data: Any) -> str:
    """YAML with multi-line strings as literal blocks (a ConfigMap's file reads as the file)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, value):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return yaml.dump(data, Dumper=Dumper, sort_keys=False)


def config_map() -> dict[str, Any]:
    """The manager's ConfigMap with doeks' Configuration (a kustomize patch of the one in Kueue's manifests)."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CONFIG_MAP, "namespace": NAMESPACE},
            "data": {CONFIG_KEY: _block_yaml(configuration())}}


CONFIG_PATCH = "configuration.yaml"


def kustomization(base: str, own: bool) -> dict[str, Any]:
    """Over Kueue's manifests (`base`: the module's config/default, or the release's manifests.yaml): doeks'
    Configuration (CONFIG_PATCH, and its hash on the pod template, so a changed one restarts the manager) and, from
    the module, the image named as the release names it. On doeks' own cluster also: the image is never pulled
    (IfNotPresent: it is imported, there is no registry), and no visibility APIService (an aggregated API, which
    doeks' API server is not set up to proxy: an APIService it cannot reach breaks discovery, and with it namespace
    deletion)."""
    import yaml

    digest = hashlib.sha256(_block_yaml(configuration()).encode()).hexdigest()[:12]
    patches: list[dict[str, Any]] = [
        {"path": CONFIG_PATCH},
        {"target": {"group": "apps", "version": "v1", "kind": "Deployment", "name": DEPLOYMENT},
         "patch": yaml.safe_dump([{"op": "add", "path": "/spec/template/metadata/annotations/doeks~1config",
                                   "value": digest}], sort_keys=False)},
    ]
    if own:
        patches.append({"target": {"group": "apps", "version": "v1", "kind": "Deployment", "name": DEPLOYMENT},
                        "patch": yaml.safe_dump([{"op": "replace", "path": "/spec/template/spec/containers/0/imagePullPolicy",
                                                  "value": "IfNotPresent"}], sort_keys=False)})
        for version in ("v1beta1", "v1beta2"):
            patches.append({"patch": yaml.safe_dump({"$patch": "delete", "apiVersion": "apiregistration.k8s.io/v1",
                                                     "kind": "APIService",
                                                     "metadata": {"name": f"{version}.visibility.kueue.x-k8s.io"}},
                                                    sort_keys=False)})
    out: dict[str, Any] = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": [base]}
    if not base.startswith("http"):
        out["images"] = [{"name": MODULE_IMAGE, "newName": IMAGE.split(":")[0], "newTag": VERSION}]
    out["patches"] = patches
    return out


@dataclass
class Flavor:
    """A node type as Kueue sees it (a ResourceFlavor): the nodes' labels, what one node has of GPUs and EFA (0: the
    queue gets no quota of it there), the Topology its nodes are placed by (TOPOLOGY where they carry EKS' network
    labels, NODE_TOPOLOGY for nodes alone, "" for none), and the tolerations Kueue adds to the pods it admits there.

    Kueue (v0.19) lets a job without a topology request use a flavor with a Topology only when every flavor of its
    ClusterQueue has one (it then places the job by the lowest level, the node): on a cluster with a node type of EKS'
    topology beside one without, the other gets NODE_TOPOLOGY, so every job can go to either."""

    name: str
    labels: dict[str, str]
    gpus: int | None = 0      # None: not known (the queue's QUEUE_GPUS stands)
    efa: int | None = 0
    topology: str = ""
    tolerations: list[dict[str, str]] = field(default_factory=list)
    cpu_memory: bool = True   # False: no CPU or memory quota here (simulated nodes: only jobs that ask for none)
    nodes: int = 0            # > 0: the node group's size; each quota is then what its nodes have (see quotas)
    vcpus: int | None = None  # one node's, where known
    memory_mib: int | None = None

    def quotas(self, settings) -> dict[str, Any]:
        """The ClusterQueue's nominal quota of each resource here: 0 of what the node type does not have; else
        QUEUE_CPU/MEMORY/GPUS/EFA, whose `auto` is, for a node group of known size (`nodes`), what its nodes have (one
        node's x nodes, EC2's DescribeInstanceTypes: a larger quota admits jobs whose pods never fit, a smaller one
        leaves nodes idle), and elsewhere (or where the amount is not known) AUTO_QUOTA's."""
        def amount(name: str, chosen, per_node):
            if per_node == 0:
                return 0
            if chosen != "auto":
                return chosen
            if not self.nodes or per_node is None:
                return AUTO_QUOTA[name]
            total = per_node * self.nodes
            return f"{total}Mi" if name == "memory" else total

        cpu_memory = {"cpu": amount("cpu", settings.queue_cpu, self.vcpus),
                      "memory": amount("memory", settings.queue_memory, self.memory_mib)}
        return {**(cpu_memory if self.cpu_memory else {"cpu": 0, "memory": 0}),
                "nvidia.com/gpu": amount("nvidia.com/gpu", settings.queue_gpus, self.gpus),
                "vpc.amazonaws.com/efa": amount("vpc.amazonaws.com/efa", settings.queue_efa, self.efa)}


# QUEUE_*=auto where no node group's size is known (doeks' own cluster, a user's): generous, as before auto
AUTO_QUOTA = {"cpu": "1000", "memory": "8Ti", "nvidia.com/gpu": 64, "vpc.amazonaws.com/efa": 256}


def node_type_flavor(instance_type: str, tolerations: list | None = None, facts: dict | None = None,
                     nodes: int = 0) -> Flavor:
    """EKS' nodes of an instance type, with EKS' topology labels where the type has them (the GPU and Trainium types
    EC2's instance topology covers). `facts`: one node's GPUs, EFA, vCPUs and memory (doeks.instancetypes.node_facts:
    EC2's answer); without them doeks' offline tables. `nodes`: the node group's size, which sizes the quotas."""
    from .catalog import offline_facts

    facts = facts or offline_facts(instance_type)
    return Flavor(instance_type, {"node.kubernetes.io/instance-type": instance_type}, facts.get("gpus"), facts.get("efa"),
                  topology=TOPOLOGY if has_topology(instance_type) else "",
                  tolerations=list(tolerations or []), nodes=nodes, vcpus=facts.get("vcpus"),
                  memory_mib=facts.get("memory_mib"))


TOPOLOGY_FAMILIES = ("p3dn", "p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "trn1", "trn1n", "trn2")


def has_topology(instance_type: str) -> bool:
    """Nodes of the type carry EC2's network-topology labels (LAYERS), which doeks' Topology places by."""
    return instance_type.split(".")[0] in TOPOLOGY_FAMILIES


def queue_manifests(settings, flavors: list[Flavor]) -> list[dict[str, Any]]:
    """The Topology (when a flavor has EKS' topology labels), a ResourceFlavor per node type, the ClusterQueue with
    QUEUE_CPU, QUEUE_MEMORY, QUEUE_GPUS and QUEUE_EFA of each, and the LocalQueue in NAMESPACE."""
    labels = {"app.kubernetes.io/part-of": "doeks"}
    out: list[dict[str, Any]] = []
    levels = {TOPOLOGY: LAYERS + (HOSTNAME,), NODE_TOPOLOGY: (HOSTNAME,)}
    for name in sorted({f.topology for f in flavors if f.topology}, key=list(levels).index):
        out.append({"apiVersion": API, "kind": "Topology", "metadata": {"name": name, "labels": labels},
                    "spec": {"levels": [{"nodeLabel": level} for level in levels[name]]}})
    for flavor in flavors:
        spec: dict[str, Any] = {"nodeLabels": dict(flavor.labels)}
        if flavor.topology:
            spec["topologyName"] = flavor.topology
        if flavor.tolerations:
            spec["tolerations"] = [dict(t) for t in flavor.tolerations]
        out.append({"apiVersion": API, "kind": "ResourceFlavor", "metadata": {"name": flavor.name, "labels": labels},
                    "spec": spec})
    out.append({"apiVersion": API, "kind": "ClusterQueue", "metadata": {"name": CLUSTER_QUEUE, "labels": labels},
                "spec": {"namespaceSelector": {},
                         "resourceGroups": [{"coveredResources": list(RESOURCES), "flavors": [
                             {"name": f.name, "resources": [{"name": name, "nominalQuota": f.quotas(settings)[name]}
                                                            for name in RESOURCES]}
                             for f in flavors]}]}})
    out.append({"apiVersion": API, "kind": "LocalQueue",
                "metadata": {"name": queue_name(settings), "namespace": settings.namespace, "labels": labels},
                "spec": {"clusterQueue": CLUSTER_QUEUE}})
    return out


# -- deploy / delete ------------------------------------------------------------------------------------------------
def folder(settings) -> Path:
    return settings.state_dir / "kueue"


def write_kustomization(settings, base: str, own: bool, write: bool = True) -> Path:
    import os

    import yaml

    where = folder(settings)
    if os.path.isabs(base):  # kustomize takes a local base by relative path only
        base = os.path.relpath(base, where)
    if write:
        where.mkdir(parents=True, exist_ok=True)
        (where / "kustomization.yaml").write_text(yaml.safe_dump(kustomization(base, own), sort_keys=False))
        (where / CONFIG_PATCH).write_text(_block_yaml(config_map()))
    return where


def deploy(settings, runner, base: str, flavors: list[Flavor], own: bool, attempts: int = 30, wait_s: float = 5) -> None:
    """Kueue from `base` with doeks' kustomization, the manager waited for, then the queue objects, applied until
    Kueue's webhooks serve them (its certificates are made by the manager once it runs)."""
    from . import kube

    where = write_kustomization(settings, base, own, write=not runner.dry_run)
    if runner.dry_run:
        runner.step(f"write {where}/kustomization.yaml and {CONFIG_PATCH} (Kueue's Configuration; both printed on "
                    f"stdout) over {base}", lambda: None)
        runner.emit([kustomization(base, own), configuration()])
    kube.run(runner, ["apply", "--server-side", "--field-manager=doeks", "--force-conflicts", "-k", str(where)])
    kube.run(runner, ["rollout", "status", "-n", NAMESPACE, f"deployment/{DEPLOYMENT}", "--timeout=300s"])
    manifests = queue_manifests(settings, flavors)
    if runner.dry_run:
        kube.apply(runner, manifests)
        return
    from .runner import to_yaml_stream

    last = ""
    for attempt in range(attempts):  # the webhooks serve once the manager has written its certificate
        result = runner.run([kube.kubectl(), "apply", "--server-side", "--field-manager=doeks", "--force-conflicts",
                             "-f", "-"], input=to_yaml_stream(manifests), check=False, capture=True)
        if result.returncode == 0:
            break
        last = (result.stderr.strip().splitlines() or ["?"])[-1]
        if attempt == 0:
            ui.say("  waiting for Kueue's webhooks to serve (its certificate is made when it starts)", style="dim")
        time.sleep(wait_s)
    else:
        raise DoeksError(f"Kueue's queues did not apply in {attempts * wait_s:.0f}s ({last[:300]}): "
                         f"`kubectl -n {NAMESPACE} logs deployment/{DEPLOYMENT}`")
    ui.say(f"Kueue {VERSION}: ClusterQueue {CLUSTER_QUEUE} ({', '.join(f.name for f in flavors)}), LocalQueue "
           f"{settings.namespace}/{queue_name(settings)}; jobs go to it with QUEUE={queue_name(settings)}")


KUEUE_KINDS = ("workloads", "localqueues", "clusterqueues", "resourceflavors", "topologies")
QUEUE_KINDS = KUEUE_KINDS[1:]


def delete(settings, runner, base: str, own: bool, timeout_s: int = 180) -> None:
    """The queue objects, then Kueue itself (controller, webhooks, CRDs, namespace), and a wait until its CRDs are
    gone. Kueue's objects carry its finalizers (a ClusterQueue while jobs use it, a Workload while its job runs); with
    the controller gone nothing removes them and the CRDs would hang in Terminating: what is still held after half
    the wait has them removed, and a job that was waiting in the queue is named (it stays suspended). Safe twice."""
    from . import kube

    where = write_kustomization(settings, base, own, write=not runner.dry_run)
    if not runner.dry_run and not _installed() and not _namespace():
        ui.say("Kueue is not deployed here: nothing to delete")
        return
    for kind in QUEUE_KINDS:
        kube.run(runner, ["delete", kind, "--all", "--ignore-not-found", "--wait=false"]
                 + (["--all-namespaces"] if kind == "localqueues" else []))
    kube.run(runner, ["delete", "--ignore-not-found", "--wait=false", "-k", str(where)])
    if runner.dry_run:
        runner.step(f"wait up to {timeout_s}s for Kueue's CRDs and namespace to go (Kueue finalizers left on its objects are removed "
                    "half-way)", lambda: None)
        return
    deadline = time.monotonic() + timeout_s
    stripped = False
    while _installed() or _namespace():
        if time.monotonic() > deadline:
            raise DoeksError(f"Kueue's CRDs or namespace {NAMESPACE} still terminating after {timeout_s}s: "
                             "`kubectl get crd | grep kueue`")
        if not stripped and time.monotonic() > deadline - timeout_s / 2:
            stripped = True
            left = _remaining()
            if left:
                ui.say(f"{len(left)} Kueue object(s) still held by Kueue's finalizers: removing them "
                       f"({', '.join(left[:4])}{', ...' if len(left) > 4 else ''})", style="yellow")
                for item in left:
                    kind, namespace, name = item.split("/", 2)
                    runner.run([kube.kubectl(), "patch", kind, name, "--type=merge", "-p", '{"metadata":{"finalizers":null}}']
                               + (["-n", namespace] if namespace else []), check=False, capture=True)
        time.sleep(2)
    ui.say(f"Kueue {VERSION} deleted")


def _installed() -> bool:
    import subprocess

    from . import kube

    result = subprocess.run([kube.kubectl(), "get", "crd", "clusterqueues.kueue.x-k8s.io"], capture_output=True, text=True)
    return result.returncode == 0


def _namespace() -> bool:
    import subprocess

    from . import kube

    return subprocess.run([kube.kubectl(), "get", "namespace", NAMESPACE], capture_output=True).returncode == 0


def _remaining() -> list[str]:
    """`kind/namespace/name` of every Kueue object left (none when its CRDs are gone)."""
    import subprocess

    from . import kube

    left = []
    for kind in KUEUE_KINDS:
        result = subprocess.run([kube.kubectl(), "get", kind, "--all-namespaces", "-o",
                                 "jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name}{\"\\n\"}{end}"],
                                capture_output=True, text=True)
        left += [f"{kind}/{line}" for line in result.stdout.split() if result.returncode == 0]
    return left


# -- what the queue says about a job ----------------------------------------------------------------------------------
def require_local_queue(settings) -> None:
    """QUEUE set: the LocalQueue must exist in NAMESPACE (else Kueue holds the job forever, or, without Kueue, the
    job would start unqueued): one line saying how to make it."""
    if not settings.queue:
        return
    import subprocess

    from . import kube

    result = subprocess.run([kube.kubectl(), "get", "localqueue", settings.queue, "-n", settings.namespace, "-o", "name"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        missing = "Kueue is not deployed" if "resource type" in result.stderr or "the server doesn't have" in result.stderr \
            else f"no LocalQueue {settings.queue} in namespace {settings.namespace}"
        raise DoeksError(f"QUEUE={settings.queue}: {missing}: `invoke kueue.deploy` makes it (with QUEUE={settings.queue})")


@dataclass
class Admission:
    """A queued job as Kueue's Workload says: its queue, whether it is admitted, and why it waits."""

    queue: str
    admitted: bool
    state: str       # waiting, admitted, finished, evicted
    why: str = ""    # Kueue's own words
    kind: str = ""   # quota, topology, pods-ready, other

    def line(self) -> str:
        text = f"queue {self.queue}: {self.state}"
        if self.why:
            text += f" ({self.kind}: {self.why})" if self.kind else f" ({self.why})"
        return text


def workload_of(namespace: str, uid: str) -> dict[str, Any] | None:
    """The Workload Kueue made for the job with this uid (label kueue.x-k8s.io/job-uid), or None."""
    from . import kube

    try:
        items = (kube.get_json(["workloads", "-n", namespace, "-l", f"{JOB_UID_LABEL}={uid}"]) or {}).get("items", [])
    except DoeksError:  # no Kueue on this cluster
        return None
    return items[0] if items else None


def admission(job: dict[str, Any]) -> Admission | None:
    """For a job carrying the queue label: its Workload's state and, while it waits, why (Kueue's QuotaReserved /
    Admitted / Evicted / PodsReady conditions). None for a job of no queue."""
    queue = job.get("metadata", {}).get("labels", {}).get(QUEUE_LABEL)
    if not queue:
        return None
    meta = job["metadata"]
    workload = workload_of(meta.get("namespace", "default"), meta.get("uid", ""))
    if workload is None:
        return Admission(queue, False, "waiting", "Kueue has made no Workload for it (is Kueue deployed? "
                                                  "`invoke kueue.status`)", "other")
    return admission_of(queue, workload)


def admission_of(queue: str, workload: dict[str, Any]) -> Admission:
    conditions = {c["type"]: c for c in workload.get("status", {}).get("conditions", [])}

    def true(kind: str) -> bool:
        return conditions.get(kind, {}).get("status") == "True"

    if true("Finished"):
        return Admission(queue, True, "finished", conditions["Finished"].get("message", ""))
    if true("Admitted"):
        ready = conditions.get("PodsReady")
        if ready and ready.get("status") == "False" and ready.get("reason") not in (None, "PodsReady"):
            return Admission(queue, True, "admitted, pods not ready", ready.get("message", ""), "pods-ready")
        return Admission(queue, True, "admitted")
    evicted = conditions.get("Evicted")
    why = conditions.get("QuotaReserved", {}).get("message", "") or conditions.get("Admitted", {}).get("message", "")
    if evicted and evicted.get("status") == "True":
        return Admission(queue, False, "evicted, waiting again", evicted.get("message", ""), reason_kind(evicted.get("message", "")))
    if true("QuotaReserved"):
        return Admission(queue, False, "quota reserved, waiting for admission checks", why)
    return Admission(queue, False, "waiting", why, reason_kind(why))


def reason_kind(message: str) -> str:
    """What a job waits for, from Kueue's words: quota ("insufficient unused quota", "insufficient quota"), topology
    ("topology ... doesn't allow to fit"), or the pods of the job before it (waitForPodsReady's blockAdmission)."""
    lowered = message.lower()
    if "insufficient" in lowered and "quota" in lowered:
        return "quota"
    if "topology" in lowered or "requested level" in lowered:
        return "topology"
    if "waiting for all admitted workloads to be in podsready" in lowered:
        return "pods-ready"
    return "other" if message else ""


def waiting_fix(found: Admission) -> str:
    return {"quota": "it starts when the queue's running jobs leave room; or raise the quota (QUEUE_CPU, QUEUE_MEMORY, "
                     "QUEUE_GPUS, QUEUE_EFA, then `invoke kueue.deploy`) or ask for less",
            "topology": "it starts when one network block has room for all its pods; or TOPOLOGY=preferred (one block "
                        "when there is room) or empty",
            "pods-ready": "it starts when the job admitted before it has all its pods ready (waitForPodsReady)",
            }.get(found.kind, "`invoke kueue.status` shows the queue")


# -- status -----------------------------------------------------------------------------------------------------------
def status_tables(settings) -> None:
    """The ClusterQueue's quota and usage per flavor, the LocalQueues, and every Workload with its admission."""
    from . import kube

    queues = (kube.get_json(["clusterqueues"]) or {}).get("items", [])
    if not queues:
        ui.say("Kueue has no ClusterQueue here: `invoke kueue.deploy` makes one")
        return
    rows = []
    for cq in queues:
        used = {f["name"]: {r["name"]: r.get("total", "0") for r in f.get("resources", [])}
                for f in cq.get("status", {}).get("flavorsUsage", [])}
        for group in cq["spec"].get("resourceGroups", []):
            for flavor in group.get("flavors", []):
                for resource in flavor.get("resources", []):
                    rows.append([cq["metadata"]["name"], flavor["name"], resource["name"],
                                 str(resource.get("nominalQuota", "")), str(used.get(flavor["name"], {}).get(resource["name"], "0"))])
    ui.table("Kueue ClusterQueues: quota and usage per node type", ["queue", "flavor", "resource", "quota", "used"], rows)
    workloads = (kube.get_json(["workloads", "--all-namespaces"]) or {}).get("items", [])
    wl_rows = []
    for wl in workloads:
        owner = next(iter(wl["metadata"].get("ownerReferences", [])), {})
        found = admission_of(wl["spec"].get("queueName", ""), wl)
        pods = sum(ps.get("count", 0) for ps in wl["spec"].get("podSets", []))
        wl_rows.append([f"{owner.get('kind', '?')}/{owner.get('name', wl['metadata']['name'])}",
                        wl["metadata"]["namespace"], found.queue, pods, found.state,
                        f"{found.kind}: {found.why}" if found.kind else found.why])
    if wl_rows:
        ui.table("Kueue workloads", ["job", "namespace", "queue", "pods", "admission", "why"], wl_rows)
    else:
        ui.say("no queued jobs")


# -- doctor: Kueue and Trainer agree ---------------------------------------------------------------------------------
def _minor(version: str) -> tuple[int, int]:
    import re

    found = re.match(r"v?(\d+)\.(\d+)", version or "")
    return (int(found.group(1)), int(found.group(2))) if found else (-1, -1)


def versions_agree(kueue: str, trainer: str, library: str = "") -> tuple[bool, str]:
    """Whether Kueue `kueue` admits TrainJobs of Trainer `trainer` (their TrainJob API), and why. `library`: the
    Trainer library the Kueue binary was built with, where known."""
    k, t = _minor(kueue), _minor(trainer)
    if k < (0, 17):
        ok = (2, 0) <= t < (2, 2)
        return ok, (f"Kueue {kueue} writes podTemplateOverrides, the TrainJob API of Trainer v2.0-v2.1"
                    + ("" if ok else f": Trainer {trainer} has runtimePatches instead; use Kueue v0.17+"))
    if t < (2, 2):
        return False, (f"Kueue {kueue} writes its own runtimePatches entry, which Trainer {trainer} does not have "
                       "(podTemplateOverrides): TrainJobs are never admitted (\"kueue runtime patch not found\", "
                       "kueue#11931); Trainer v2.2+ or Kueue v0.16")
    if t > (2, 3):
        return False, f"Trainer {trainer} is newer than any Trainer Kueue {kueue} knows (v2.2, v2.3)"
    built = library or (RELEASE_TRAINER_LIBRARY if k <= (0, 19) else "")
    if t == (2, 3) and _minor(built) < (2, 3):
        return True, (f"Kueue {kueue} (built with Trainer's library {built}) and Trainer {trainer}: the same "
                      "runtimePatches API; an admitted TrainJob loses terminationGracePeriodSeconds of its runtime "
                      "patches (kueue#14836), which doeks' TrainJob does not set")
    return True, f"Kueue {kueue}" + (f" (Trainer library {built})" if built else "") + f" and Trainer {trainer}: runtimePatches"


def deployed_versions() -> tuple[str, str]:
    """(Kueue's, Trainer's) version on the cluster, from their controllers' image tags ("" where not deployed)."""
    from . import kube

    kueue = trainer = ""
    try:
        deployments = (kube.get_json(["deployments", "--all-namespaces"]) or {}).get("items", [])
    except DoeksError:
        return "", ""
    for d in deployments:
        for c in d["spec"]["template"]["spec"].get("containers", []):
            image = c.get("image", "")
            if "/kueue/kueue:" in image:
                kueue = image.rsplit(":", 1)[1]
            if "trainer-controller-manager:" in image:
                trainer = image.rsplit(":", 1)[1]
    return kueue, trainer


def check(settings, library: str = "") -> tuple[str, bool, str, bool] | None:
    """doctor's row: Kueue and Trainer versions agree (needed when both run); None when Kueue is not deployed."""
    kueue, trainer = deployed_versions()
    if not kueue:
        if settings.queue:
            return ("Kueue deployed (QUEUE is set)", False, "not deployed: `invoke kueue.deploy`", True)
        return None
    if not trainer:
        return ("Kueue and Trainer versions agree", True, f"Kueue {kueue}; no Trainer deployed (TrainJobs need "
                                                           "`invoke kubeflow.trainer.deploy`)", False)
    ok, why = versions_agree(kueue, trainer, library)
    return ("Kueue and Trainer versions agree", ok, why, True)

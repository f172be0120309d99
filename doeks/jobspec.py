"""The elastic job, rendered once from settings: an etcd Deployment + Service (for etcd rendezvous) and a Kubeflow
training-operator PyTorchJob with `elasticPolicy` (kubeflow.org/v1; the archived TorchElastic ElasticJob CRD cannot be
installed on Kubernetes >= 1.22). On `eks` these manifests are applied; on `local` the same PyTorchJob is interpreted
by `doeks.local.jobs` (one torchrun agent per replica, PET_* environment as the operator sets it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ETCD_PORT = 2379
CONTAINER_SCRIPT = "/workspace/train.py"  # where the training image keeps doeks/workload/train.py (doeks.code)
RDZV_CONF = {"last_call_timeout": "1", "timeout": "600"}
# torchrun's --local-addr from the downward API. Without it rank 0's agent publishes its FQDN (the pod's name) as
# MASTER_ADDR, and the other ranks look it up in the cluster DNS, which caches answers (CoreDNS `cache 30` on EKS as on
# doeks' cluster): after a pod was replaced its name still gave the old pod's address for up to 30 s ("No route to
# host" retries; measured: 79 s from rendezvous to the first step once). A pod's IP is routable on any cluster (the VPC
# CNI gives pods VPC addresses on EKS).
POD_ADDRESS = {"name": "PET_LOCAL_ADDR", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}

from .catalog import EFA_ADAPTERS, GPUS  # noqa: E402,F401 - offline stand-ins (doeks.instancetypes asks EC2)


def idle_gpus_warning(settings) -> str:
    """One line when NPROC_PER_NODE does not match the GPUs of the nodes doeks sizes (GPU_INSTANCE_TYPE): GPUs left
    idle, or more processes than GPUs (the pods cannot be scheduled); "" when they match or the type is not known."""
    gpus = settings.node_gpus
    n = settings.nproc_per_node
    if gpus is None and settings.raw("NPROC_PER_NODE") == "auto":
        return (f"warning: the GPUs of a {settings.gpu_instance_type} node are not known yet ({settings.instance_facts}: "
                f"no AWS credentials to ask EC2): the plan asks for {n} per pod; set NPROC_PER_NODE to be sure")
    if gpus is None or n == gpus:
        return ""
    if n < gpus:
        return (f"warning: NPROC_PER_NODE={n} uses {n} of the {gpus} GPUs of each {settings.gpu_instance_type} node: "
                f"{gpus - n} idle (NPROC_PER_NODE=auto or {gpus} uses them all)")
    return (f"warning: NPROC_PER_NODE={n} asks for {n} GPUs per pod, but a {settings.gpu_instance_type} node has "
            f"{gpus}: the pods cannot be scheduled (NPROC_PER_NODE=auto or {gpus})")


def labels(settings) -> dict[str, str]:
    return {"app.kubernetes.io/part-of": "doeks", "doeks/job": settings.job_name}


# Kueue (doeks.kueue): the label that sends a job to a LocalQueue, and the pod-template annotations of its Topology
# Aware Scheduling asking for every pod of the job in one block of EKS' network topology (the layer-3 network node)
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
TOPOLOGY_ANNOTATIONS = {"required": "kueue.x-k8s.io/podset-required-topology",
                        "preferred": "kueue.x-k8s.io/podset-preferred-topology"}
BLOCK = "topology.k8s.aws/network-node-layer-3"


def queue_labels(settings) -> dict[str, str]:
    """QUEUE set: the label that sends the job to that LocalQueue (Kueue holds it until all its pods fit)."""
    return {QUEUE_LABEL: settings.queue} if settings.queue else {}


def topology_annotations(settings) -> dict[str, str]:
    """TOPOLOGY=required|preferred with a QUEUE: all the job's pods in one layer-3 block (Kueue places them)."""
    if not settings.queue or not settings.topology:
        return {}
    return {TOPOLOGY_ANNOTATIONS[settings.topology]: BLOCK}


def etcd_name(settings) -> str:
    """The job's etcd Deployment and Service (rdzvHost): <JOB_NAME>-etcd. One per job: two jobs in a namespace shared
    `etcd` / `etcd-service` before (the second's apply took the first's over, deleting either deleted the other's
    rendezvous, the Service chose among both jobs' etcd pods), and a job started right after another's was deleted
    looked up `etcd-service` in the cluster DNS' cache and sent its first connections to the deleted Service's address
    (no kube-proxy rule for it any more: toward the default interface, where doeks' guard dropped them)."""
    return f"{settings.job_name}-etcd"


def etcd_manifests(settings) -> list[dict[str, Any]]:
    """etcd for torch's etcd rendezvous: pinned image, v2 API on, one replica, a ClusterIP Service (etcd_name).

    It advertises the Service's URL, the one torch's client uses: python-etcd (allow_reconnect, as torch makes it)
    moves to the next advertised URL when a request fails and never back, so an etcd pod made again after its
    predecessor died left every agent on `http://0.0.0.0:2379` (its own pod) with "No more machines in the cluster"
    until the rendezvous timed out; with its own URL advertised there is no other to move to."""
    name = etcd_name(settings)
    meta = {"namespace": settings.namespace, "labels": {**labels(settings), "app": "etcd"}}
    selector = {"app": "etcd", "doeks/job": settings.job_name}  # this job's etcd pod only
    command = ["/usr/local/bin/etcd", "--data-dir", "/var/lib/etcd", "--enable-v2",
               f"--listen-client-urls=http://0.0.0.0:{ETCD_PORT}",
               f"--advertise-client-urls=http://{name}:{ETCD_PORT}", "--initial-cluster-state=new"]
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, **meta},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": selector},
                "spec": {"containers": [{
                    "name": "etcd", "image": settings.etcd_image, "command": command,
                    "ports": [{"name": "client", "containerPort": ETCD_PORT}],
                    "readinessProbe": {"httpGet": {"path": "/health", "port": ETCD_PORT}, "periodSeconds": 5},
                    "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                    "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
                }], "volumes": [{"name": "data", "emptyDir": {}}]},
            },
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, **meta},
        "spec": {"selector": selector, "ports": [{"name": "client", "port": ETCD_PORT, "targetPort": ETCD_PORT}]},
    }
    return [deployment, service]


def watchdog_env(settings) -> list[dict[str, Any]]:
    """What each replica's hang watchdog (doeks.pod.watchdog, in the image's torchrun) reads: the timeout, its pace, each rung's
    bound, and (on a cluster) the job, pod and node it acts on."""
    values = {"DOEKS_HANG_TIMEOUT": settings.hang_timeout, "DOEKS_HANG_PACE": settings.hang_pace,
              "DOEKS_HANG_RESTARTS": settings.hang_restarts,
              "DOEKS_HANG_REPLACEMENTS": settings.hang_replacements, "DOEKS_HANG_MOVES": settings.hang_moves,
              "DOEKS_HANG_JOB_RESTARTS": settings.hang_job_restarts, "DOEKS_JOB_NAME": settings.job_name}
    return [{"name": k, "value": str(v)} for k, v in values.items()] + [
        {"name": "DOEKS_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]


def watchdog_rbac(settings) -> list[dict[str, Any]]:
    """The job's pods' service account and what their watchdog may do through the API server: delete the job's pods
    (rungs 2 and 4), record Events (what `status` reads), and list and cordon nodes (rung 3)."""
    name = f"{settings.job_name}-watchdog"
    meta = {"namespace": settings.namespace, "labels": labels(settings)}
    cluster_name = f"doeks-watchdog-{settings.namespace}-{settings.job_name}"
    subject = [{"kind": "ServiceAccount", "name": name, "namespace": settings.namespace}]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, **meta}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": name, **meta},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "delete"]},
                   {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": name, **meta},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}, "subjects": subject},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": cluster_name, "labels": labels(settings)},
         "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": cluster_name, "labels": labels(settings)},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_name},
         "subjects": subject},
    ]


def train_args(settings, mount: str | None = None, code=None) -> list[str]:
    """The script's arguments: the built-in workload's ImageNet flags (only when it is the script), then TRAIN_ARGS.
    `code`: the job's, resolved once (doeks.code.resolve) by whoever holds the job."""
    from .code import resolve

    code = code or resolve(settings)
    return (imagenet_args(settings, mount) if code.builtin else []) + list(code.args)


def imagenet_args(settings, mount: str | None = None) -> list[str]:
    """The built-in workload's own flags (doeks/workload/train.py): data, model, schedule and output folders."""
    from .jobpaths import checkpoint_uri, job_folder

    mount = mount or settings.shared_mount
    crop = settings.crop  # CROP_SIZE, or by where the job trains (see Settings.crop)
    return ["--data", f"{mount}/data", "--arch", settings.arch, "--epochs", str(settings.epochs),
            "--batch-size", str(settings.batch_size), "--lr", str(settings.learning_rate),
            "--crop-size", str(crop),
            "--workers", str(settings.data_workers), "--checkpoint-every", str(settings.checkpoint_every),
            "--checkpoint-when-busy", settings.checkpoint_when_busy, "--checkpoint-dir", checkpoint_uri(settings, mount),
            "--metrics-dir", job_folder(settings, "metrics", mount)]


@dataclass
class Placement:
    """What each training pod asks for and where it may go, as a target's nodes have it (doeks.targets: each target
    answers `placement()`): `resources` (requests and limits), `selector` (nodeSelector), the GPUs and EFA adapters
    of one whole node (`node_gpus`, `node_efa`: what a test using every GPU asks for), `cpu` (its ranks run on CPU),
    `cloud` (a node type of EKS: NCCL on EFA, hugepages)."""

    resources: dict[str, Any]
    selector: dict[str, str]
    node_gpus: int = 0
    node_efa: int = 0
    cpu: bool = False
    cloud: bool = False
    tolerations: list[dict[str, Any]] = field(default_factory=list)  # taints of the nodes meant for training pods


# The taint of EKS' GPU node group (eksctl's, which doeks' ClusterConfig sets: doeks.eks) and its toleration. EKS' own
# admission adds the toleration to a pod that asks for nvidia.com/gpu, but only when the pod is made: Kueue decides
# before (a suspended job's pods do not exist yet), and its Topology Aware Scheduling drops every node whose taint the
# job's pods do not tolerate. So the job carries it, and so does the flavor (doeks.kueue).
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}
GPU_TOLERATION = {"key": GPU_TAINT["key"], "operator": "Exists", "effect": GPU_TAINT["effect"]}


def node_type_placement(settings) -> Placement:
    """EKS's GPU node group: NPROC_PER_NODE GPUs and EFA_PER_NODE EFA interfaces per pod (auto: all of the type's,
    as EC2's DescribeInstanceTypes says; none with GPU_EFA=false), on GPU_INSTANCE_TYPE (+ NODE_LABELS), tolerating
    the group's taint (GPU_TOLERATION). The manifests' default: what the job asks of EKS, also where this
    machine only interprets them."""
    instance = settings.gpu_instance_type
    gpus = settings.nproc_per_node
    resources: dict[str, Any] = {"limits": {"nvidia.com/gpu": gpus}, "requests": {"nvidia.com/gpu": gpus}}
    if settings.efa_per_node:  # the type's EFA interfaces (EFA_PER_NODE), none with GPU_EFA=false
        for part in ("limits", "requests"):
            resources[part]["vpc.amazonaws.com/efa"] = settings.efa_per_node
    return Placement(resources, {"node.kubernetes.io/instance-type": instance, **settings.node_labels},
                     node_gpus=settings.node_gpus or settings.nproc_per_node, node_efa=settings.efa_per_node,
                     cloud=True, tolerations=[dict(GPU_TOLERATION)])


def cluster_placement(settings) -> Placement:
    """A plain Kubernetes cluster's nodes: KUBE_GPUS GPUs, or a CPU share when it trains on CPU (doeks' own cluster:
    this machine's cores), KUBE_MEMORY as the limit and request, NODE_LABELS alone (no cloud labels), no EFA."""
    if settings.kube_gpus:
        resources = {"limits": {"nvidia.com/gpu": settings.kube_gpus}, "requests": {"nvidia.com/gpu": settings.kube_gpus}}
    else:
        resources = {"requests": {"cpu": "100m", "memory": "256Mi"}}
    if settings.kube_memory:  # KUBE_MEMORY: the limit, and the request (a request above a limit is refused)
        resources.setdefault("limits", {})["memory"] = settings.kube_memory
        resources["requests"]["memory"] = settings.kube_memory
    return Placement(resources, dict(settings.node_labels), node_gpus=settings.kube_gpus, cpu=not settings.kube_gpus)


def run_id() -> str:
    """A fresh rendezvous id suffix: a finished run closes its rendezvous in etcd, so each deploy needs its own."""
    import secrets
    import time

    return time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def pytorchjob(settings, extra_args: list[str] | None = None, run: str | None = None,
               image: str | None = None, placement: Placement | None = None, code=None) -> dict[str, Any]:
    """The elastic PyTorchJob (training-operator v1) for the job in `settings`; `image` is the training image the
    target resolved (doeks.trainimage.reference), TRAIN_IMAGE when not given; `placement` the target's (EKS's node
    type when not given)."""
    run = run or run_id()
    import copy

    placement = placement or node_type_placement(settings)
    resources = copy.deepcopy(placement.resources)
    elastic: dict[str, Any] = {
        "rdzvBackend": settings.rdzv_backend,
        "rdzvId": f"{settings.job_name}-{run}",
        "minReplicas": settings.min_replicas,
        "maxReplicas": settings.max_replicas,
        "maxRestarts": settings.max_restarts,
        "rdzvConf": [{"key": k, "value": v} for k, v in RDZV_CONF.items()],
    }
    if settings.rdzv_backend.startswith("etcd"):
        elastic.update(rdzvHost=etcd_name(settings), rdzvPort=ETCD_PORT)
    from .code import CODE_DIR, contract, env_list, host_names, resolve
    from .pod.torchrun import CLOSED_WAIT_S, END_WAIT_ENV

    code = code or resolve(settings)
    hosts = host_names(settings.job_name, settings.replicas)
    container = {
        "name": "pytorch",
        "image": image or _cluster_image(settings, code),
        "imagePullPolicy": "IfNotPresent",
        "command": code.launcher(),
        "args": train_args(settings, code=code) + list(extra_args or []),
        "workingDir": CODE_DIR,
        "env": [{"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"},
                {"name": "PYTHONUNBUFFERED", "value": "1"},
                {"name": "NCCL_DEBUG", "value": "INFO"},
                # after an error no restart cures the container stays this long (doeks.pod.torchrun.run_quietly), so the
                # follow reads why and ends the job before the kubelet or docker restarts it
                {"name": END_WAIT_ENV, "value": str(CLOSED_WAIT_S)}]
        + env_list(contract(settings, settings.shared_mount, f"{settings.job_name}-{run}", hosts))
        + [{"name": "SM_CURRENT_HOST", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           # the address each agent publishes through the rendezvous (torchrun --local-addr): the pod's own IP, so the
           # ranks reach rank 0's store by address, not by a pod name the cluster DNS may still answer with the
           # address of the pod it replaced (see POD_ADDRESS)
           POD_ADDRESS]
        + watchdog_env(settings),
        "resources": resources,
        "volumeMounts": [{"name": "shared", "mountPath": settings.shared_mount},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
        # a failed container's last log lines (80, 2 KB) kept in the pod's status (lastState.terminated.message): its
        # log file goes when the kubelet removes the container, and the error that ended a run must still be read
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": settings.shared_pvc}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }
    if placement.selector:
        pod_spec["nodeSelector"] = dict(placement.selector)
    if placement.tolerations:
        pod_spec["tolerations"] = copy.deepcopy(placement.tolerations)
    # the replicas on different nodes where there are enough (preferred, not required): a lost node takes one replica,
    # and the elastic job goes on with the others
    pod_spec["affinity"] = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                           "labelSelector": {"matchLabels": labels(settings)}}}]}}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": settings.job_name, "namespace": settings.namespace,
                     "labels": {**labels(settings), **queue_labels(settings)}},
        "spec": {
            "elasticPolicy": elastic,
            "nprocPerNode": str(settings.nproc_per_node),
            "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": max(10, 3 * settings.max_replicas)},
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": settings.replicas,
                    "restartPolicy": "OnFailure",
                    "template": {"metadata": _pod_metadata(settings), "spec": pod_spec},
                },
            },
        },
    }


def _pod_metadata(settings) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": labels(settings)}
    if topology_annotations(settings):
        meta["annotations"] = topology_annotations(settings)
    return meta


def _cluster_image(settings, code=None) -> str:
    from .trainimage import reference

    return reference(settings, on_this_machine=settings.own_cluster, code=code)


def pytorchjob_fixed(settings, extra_args: list[str] | None = None, run: str | None = None,
                     placement: Placement | None = None) -> dict[str, Any]:
    """The non-elastic PyTorchJob: no elasticPolicy, one Master + REPLICAS-1 Workers (REPLICAS nodes in all).

    Without elasticPolicy the training operator sets MASTER_ADDR / PET_MASTER_ADDR, RANK and PET_NODE_RANK only when
    the job has a Master replica (kubeflow/trainer v1.9.4 pkg/controller.v1/pytorch/envvar.go `setPodEnv`): a
    Worker-only job leaves torchrun on its default 127.0.0.1 and every pod waits for itself. PET_NNODES is the total
    of the replicas and PET_NPROC_PER_NODE comes from nprocPerNode, so the command is plain `torchrun SCRIPT`.
    """
    import copy

    job = pytorchjob(settings, extra_args, run, placement=placement)
    spec = job["spec"]
    del spec["elasticPolicy"]
    worker = spec["pytorchReplicaSpecs"]["Worker"]

    master = copy.deepcopy(worker)
    master["replicas"] = 1
    spec["pytorchReplicaSpecs"] = {"Master": master}
    if settings.replicas > 1:
        worker["replicas"] = settings.replicas - 1
        spec["pytorchReplicaSpecs"]["Worker"] = worker
    spec["runPolicy"]["backoffLimit"] = max(3, settings.replicas)
    return job


def manifests(settings, extra_args: list[str] | None = None, run: str | None = None,
              image: str | None = None, placement: Placement | None = None, code=None,
              account: bool = False) -> list[dict[str, Any]]:
    """Everything `elasticjob.deploy` applies, in apply order: etcd, the PyTorchJob; `account` (a cluster's API server
    is there for the watchdog to act through): with HANG_TIMEOUT set, the watchdog's service account before the job,
    whose pods run under it."""
    head = etcd_manifests(settings) if settings.rdzv_backend.startswith("etcd") else []
    job = pytorchjob(settings, extra_args, run, image, placement, code)
    if account and settings.hang_timeout:
        head += watchdog_rbac(settings)
        worker_pod(job)["serviceAccountName"] = f"{settings.job_name}-watchdog"
    return head + [job]


def worker_pod(job: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of a PyTorchJob's Worker replicas (its first container runs the script)."""
    return job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]


def pet_env(job: dict[str, Any], rdzv_endpoint: str) -> dict[str, str]:
    """The PET_* variables the training operator gives each worker (torchrun reads them as its defaults)."""
    spec = job["spec"]
    elastic = spec["elasticPolicy"]
    env = {
        "PET_NNODES": f"{elastic['minReplicas']}:{elastic['maxReplicas']}",
        "PET_NPROC_PER_NODE": str(spec.get("nprocPerNode", elastic.get("nProcPerNode", 1))),
        "PET_RDZV_BACKEND": elastic["rdzvBackend"],
        "PET_RDZV_ENDPOINT": rdzv_endpoint,
        "PET_RDZV_ID": elastic.get("rdzvId") or job["metadata"]["name"],
        "PET_MAX_RESTARTS": str(elastic.get("maxRestarts", 3)),
    }
    conf = elastic.get("rdzvConf") or []
    if conf:
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in conf)
    return env

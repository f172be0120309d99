"""The fixed-size job as a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1, Trainer v2.3.0) against the
`torch-distributed` ClusterTrainingRuntime.

What the runtime and the Trainer provide (kubeflow/trainer v2.3.0): the runtime's one replicated job `node` with the
container `node` (manifests/base/runtimes/torch_distributed.yaml); `trainer.numNodes` sets its count; the torch plugin
(pkg/runtime/framework/plugins/torch/torch.go) gives that container PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK
(the pod's completion index), PET_MASTER_ADDR (`<name>-node-0-0.<name>`) and PET_MASTER_PORT, which stock `torchrun`
reads, so the command is plain `torchrun SCRIPT` and the TrainJob must not set those variables itself
(TorchRunReservedEnvNames). The shared volume, /dev/shm and the node selector go in `runtimePatches` (the API that
replaced podTemplateOverrides in v2.3.0), keyed by our manager name. Trainer v2 has no elastic mode (ElasticPolicy was
removed in v2.2, kubeflow/trainer#3235): elastic jobs stay PyTorchJobs on the v1 operator (doeks.jobspec).
"""
from __future__ import annotations

from typing import Any

from . import trainimage
from .errors import DoeksError
from .jobspec import Placement, labels, node_type_placement, queue_labels, topology_annotations, train_args

API_VERSION = "trainer.kubeflow.org/v1alpha1"
TRAINER_VERSION = "v2.3.0"
RUNTIME = "torch-distributed"
RUNTIME_KIND = "ClusterTrainingRuntime"
REPLICATED_JOB = "node"   # torch_distributed.yaml: replicatedJobs[0].name
CONTAINER = "node"        # ... and its container's name (constants.Node)
MANAGER = "doeks.io/trainjob"
RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
# JobSet's pod selector label (sigs.k8s.io/jobset: jobset.sigs.k8s.io/jobset-name); the Trainer names the JobSet
# after the TrainJob.
POD_SELECTOR = "jobset.sigs.k8s.io/jobset-name={name}"


def trainjob(settings, name: str | None = None, extra_args: list[str] | None = None, nodes: int | None = None,
             placement: Placement | None = None) -> dict[str, Any]:
    """The TrainJob for the job in `settings`: REPLICAS nodes x NPROC_PER_NODE processes, TRAIN_IMAGE, SHARED_PVC;
    each node's resources and selector are the target's `placement` (EKS's node type when not given): its GPUs (=
    NPROC_PER_NODE) and, on an EFA instance type with GPU_EFA, all of its EFA adapters; on TARGET=kubernetes what its
    training pods ask for (KUBE_GPUS, or a CPU share)."""
    import copy

    placement = placement or node_type_placement(settings)
    name = name or settings.job_name
    nodes = nodes or settings.replicas
    if nodes < 1:
        raise DoeksError(f"a TrainJob needs at least one node (got {nodes})")
    from .code import contract, env_list, resolve

    code = resolve(settings)
    # the environment contract (doeks.code); JobSet's pod host names are <jobset>-<replicatedJob>-<job>-<pod>
    hosts = [f"{name}-{REPLICATED_JOB}-0-{i}" for i in range(nodes)]
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "NCCL_DEBUG", "value": "INFO"}] + env_list(
        contract(settings, settings.shared_mount, name, hosts))
    pod_spec: dict[str, Any] = {
        "nodeSelector": dict(placement.selector),
        "volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": settings.shared_pvc}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        "containers": [{"name": CONTAINER, "volumeMounts": [{"name": "shared", "mountPath": settings.shared_mount},
                                                            {"name": "dshm", "mountPath": "/dev/shm"}]}],
        # a node that stops answering: its pod is evicted after NODE_LOST_TIMEOUT s (Kubernetes' default toleration
        # is 300 s), and the Job makes it again on a node that answers (its Terminating predecessor does not hold
        # the index: Jobs replace terminating pods); the job resumes from its checkpoint on the remaining nodes
        "tolerations": [{"key": key, "operator": "Exists", "effect": "NoExecute",
                         "tolerationSeconds": settings.node_lost_timeout}
                        for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")]
        + copy.deepcopy(placement.tolerations),
    }
    pod_template: dict[str, Any] = {"spec": pod_spec}
    if topology_annotations(settings):  # Kueue reads it on the JobSet's pod template, which the runtime patch makes
        pod_template["metadata"] = {"annotations": topology_annotations(settings)}
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": settings.namespace, "labels": {**labels(settings), **queue_labels(settings)}},
        "spec": {
            "runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": RUNTIME_KIND, "name": RUNTIME},
            "trainer": {
                "image": trainimage.reference(settings, on_this_machine=settings.own_cluster),
                "command": code.launcher(),
                "args": train_args(settings) + list(extra_args or []),
                "env": env,
                "numNodes": nodes,
                "numProcPerNode": settings.nproc_per_node,
                "resourcesPerNode": copy.deepcopy(placement.resources),
            },
            "runtimePatches": [{
                "manager": MANAGER,
                "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{
                    "name": REPLICATED_JOB,
                    "template": {"spec": {"template": pod_template}},
                }]}}},
            }],
        },
    }


KUEUE_UNSUPPORTED = "unsupported runtime"  # kueue v0.19.2 pkg/controller/jobs/trainjob: its runtime cache lags


def apply(runner, job: dict[str, Any], attempts: int = 30, wait_s: float = 5) -> None:
    """The TrainJob applied (server-side). Kueue's TrainJob webhook refuses one whose runtime its cache has not read
    yet ("admission webhook "vtrainjob.kb.io" denied the request: unsupported runtime: ClusterTrainingRuntime...", right
    after Kueue or Trainer is deployed): that refusal is retried, at most attempts x wait_s (150 s), said once; any
    other error at once."""
    import time

    from . import kube, ui

    for attempt in range(attempts):
        try:
            kube.apply(runner, [job])
            return
        except DoeksError as refused:
            if runner.dry_run or KUEUE_UNSUPPORTED not in str(refused) or attempt == attempts - 1:
                raise
            if attempt == 0:
                ui.say(f"  Kueue does not know runtime {job['spec']['runtimeRef']['name']} yet (its webhook refuses the "
                       f"TrainJob until its cache has read it): trying again, at most {attempts * wait_s:.0f} s",
                       style="dim")
            time.sleep(wait_s)


def selector(name: str) -> str:
    return POD_SELECTOR.format(name=name)


def diagnose(settings, name: str | None = None):
    """Why the TrainJob is not training (a doeks.pod.reasons.Reason), or None: read through the API server from
    its conditions, its JobSet's events (JobSet records `JobCreationFailed` with the API server's refusal when the pod
    template it was given is invalid: sigs.k8s.io/jobset pkg/constants, `JobCreationFailedReason`), its pods' container
    states and their events."""
    from . import kube
    from .pod import reasons

    name = name or settings.job_name
    job = kube.get_json(["trainjob", name, "-n", settings.namespace])
    if job is None:
        return None
    conditions = [c for c in job.get("status", {}).get("conditions", []) if c.get("status") == "True"]
    if any(c["type"] == "Complete" for c in conditions):
        return None
    failed = [c.get("message", "") for c in conditions if c["type"] == "Failed"]
    pods = (kube.get_json(["pods", "-n", settings.namespace, "-l", selector(name)]) or {}).get("items", [])
    signals: list[str] = []
    exit_codes: list[int] = []
    messages: list[str] = list(failed)
    restarts = 0
    for pod in pods:
        for c in pod.get("status", {}).get("containerStatuses", []):
            restarts += c.get("restartCount", 0)
            signals.append(c.get("state", {}).get("waiting", {}).get("reason", ""))
            for when in ("state", "lastState") if "running" not in c.get("state", {}) else ("state",):
                ended = c.get(when, {}).get("terminated")
                if ended and ended.get("exitCode"):
                    exit_codes.append(ended["exitCode"])
                    signals.append(ended.get("reason", ""))
    names = {name} | {p["metadata"]["name"] for p in pods}
    events = [e for e in (kube.get_json(["events", "-n", settings.namespace]) or {}).get("items", [])
              if e.get("involvedObject", {}).get("name") in names and e.get("type") == "Warning"]
    refused = [e.get("message", "") for e in events if e.get("reason") == reasons.JOB_CREATION_FAILED]
    if refused:
        first = refused[-1].strip().splitlines()[0][:300]
        return reasons.Reason("refused", f"the JobSet cannot create its Jobs: {first}", reasons.REFUSED_FIX, True)
    return reasons.classify(messages + [e.get("message", "") for e in events], exit_codes,
                            signals + [e.get("reason", "") for e in events], restarts, failed=bool(failed))

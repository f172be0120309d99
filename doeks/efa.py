"""EFA on EKS: the AWS EFA Kubernetes device plugin (pinned, >= 0.5.10: older ones count NVLink devices as EFA),
the MPI operator (kubeflow.org/v2beta1) and the nccl-tests all_reduce_perf MPIJob that proves EFA is used.
"""
from __future__ import annotations

from typing import Any

from .catalog import EFA_ADAPTERS

DEVICE_PLUGIN_VERSION = "v0.5.10"
DEVICE_PLUGIN_REPOSITORY = "eks/aws-efa-k8s-device-plugin"  # in the region's EKS add-on registry (doeks.catalog)
# kubeflow/mpi-operator v0.8.0 (2026-02-18): deploy/v2beta1/mpi-operator.yaml holds the one MPIJob CRD on the cluster
# (mpijobs.kubeflow.org, v2beta1 served + storage); the training operator is deployed without its v1 copy
# (doeks.kubeflow.operator_kustomization), so the two never fight over storedVersions (kubeflow/trainer#1930).
MPI_OPERATOR_VERSION = "v0.8.0"
MPIJOB_CRD = "mpijobs.kubeflow.org"
MPI_OPERATOR_MANIFEST = f"https://raw.githubusercontent.com/kubeflow/mpi-operator/{MPI_OPERATOR_VERSION}/deploy/v2beta1/mpi-operator.yaml"
# aws-samples/awsome-distributed-training micro-benchmarks/nccl-tests/buildspec.yaml (commit bd491b3) pushes
# public.ecr.aws/hpc-cloud/nccl-tests:efa<EFA>-ofi<OFI>-nccl<NCCL>-tests<TESTS> and :latest (no `latest-efa`): pinned.
NCCL_TESTS_TAG = "efa1.34.0-ofiv1.11.0-aws-ncclv2.23.4-1-testsv2.13.10"
NCCL_TESTS_IMAGE = f"public.ecr.aws/hpc-cloud/nccl-tests:{NCCL_TESTS_TAG}"
MPI_OPERATOR_NAMESPACE = "mpi-operator"        # deploy/v2beta1/mpi-operator.yaml's namespace and Deployment name
MPI_OPERATOR_DEPLOYMENT = "mpi-operator"
DAEMONSET = "aws-efa-k8s-device-plugin-daemonset"  # doeks' own (labelled LABELS)
# eksctl's efaEnabled installs its own plugin (pkg/addons/assets/efa-device-plugin.yaml), named
# `aws-efa-k8s-device-plugin` since v0.204.0 (eksctl#8201; doeks pins v0.215.0), DAEMONSET's name before. It tolerates
# no nvidia.com/gpu taint, and beside doeks' on an untainted EFA node two plugins would advertise the same devices.
EKSCTL_DAEMONSETS = ("aws-efa-k8s-device-plugin", "aws-efa-k8s-device-plugin-daemonset")
LABELS = {"app.kubernetes.io/part-of": "doeks", "app.kubernetes.io/name": "aws-efa-k8s-device-plugin"}


def device_plugin_image(region: str) -> str:
    from .catalog import eks_addon_registry

    return f"{eks_addon_registry(region)}/{DEVICE_PLUGIN_REPOSITORY}:{DEVICE_PLUGIN_VERSION}"


def efa_types(settings) -> list[str]:
    """The instance types the device plugin runs on: the known EFA types and the GPU node group's when it has EFA."""
    return sorted(set(EFA_ADAPTERS) | ({settings.gpu_instance_type} if settings.efa_per_node else set()))


def device_plugin(settings) -> list[dict[str, Any]]:
    """The device-plugin DaemonSet, scheduled only on EFA instance types."""
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
        "matchExpressions": [{"key": "node.kubernetes.io/instance-type", "operator": "In", "values": efa_types(settings)}],
    }]}}}
    return [{
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": DAEMONSET, "namespace": "kube-system", "labels": LABELS},
        "spec": {
            "selector": {"matchLabels": {"name": "aws-efa-k8s-device-plugin"}},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {
                "metadata": {"labels": {"name": "aws-efa-k8s-device-plugin", **LABELS}},
                "spec": {
                    "priorityClassName": "system-node-critical",
                    "hostNetwork": True,
                    "affinity": affinity,
                    "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"},
                                    {"key": "aws.amazon.com/efa", "operator": "Exists", "effect": "NoSchedule"},
                                    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [{
                        "name": "aws-efa-k8s-device-plugin",
                        "image": device_plugin_image(settings.aws_region),
                        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                        "resources": {"requests": {"cpu": "10m", "memory": "20Mi"}, "limits": {"memory": "100Mi"}},
                        "volumeMounts": [{"name": "device-plugin", "mountPath": "/var/lib/kubelet/device-plugins"},
                                         {"name": "infiniband-volume", "mountPath": "/dev/infiniband/"}],
                    }],
                    "volumes": [{"name": "device-plugin", "hostPath": {"path": "/var/lib/kubelet/device-plugins"}},
                                {"name": "infiniband-volume", "hostPath": {"path": "/dev/infiniband/"}}],
                },
            },
        },
    }]




def mpi_operator_deploy(runner, manifest: str = MPI_OPERATOR_MANIFEST) -> None:
    """The MPI operator from its manifest (upstream's file on GitHub; doeks' own cluster, with no network, the same
    file inside the operator's Go module, its image built first), then its rollout: an MPIJob applied before the
    operator runs would wait, not fail, but `efa.test` should not start it against nothing."""
    from . import kube

    kube.run(runner, ["apply", "--server-side", "-f", manifest])
    kube.run(runner, ["rollout", "status", "-n", MPI_OPERATOR_NAMESPACE, f"deployment/{MPI_OPERATOR_DEPLOYMENT}",
                      "--timeout=300s"])


def mpi_operator_delete(runner, manifest: str = MPI_OPERATOR_MANIFEST) -> None:
    """Everything the manifest made (its namespace, the MPIJob CRD and so every MPIJob, the RBAC); safe twice."""
    from . import kube

    kube.delete_from(runner, "-f", manifest)


def replace_eksctl_plugin_argvs() -> list[list[str]]:
    """kubectl arguments deleting eksctl's EFA plugin DaemonSet under each name it has had, unless doeks made it
    (eksctl's carries no doeks label): one command a name (a field selector takes one)."""
    return [["delete", "daemonset", "-n", "kube-system", "--field-selector", f"metadata.name={name}",
             "-l", f"app.kubernetes.io/part-of!={LABELS['app.kubernetes.io/part-of']}", "--ignore-not-found"]
            for name in EKSCTL_DAEMONSETS]


def default_end(placement) -> str:
    """The largest message by default: 1G on GPUs, 1M on CPU (a test of the launcher/worker contract, not bandwidth)."""
    return "1M" if placement.cpu else "1G"


def nccl_mpijob(settings, nodes: int | None = None, name: str = "test-efa-nccl", begin: str = "8",
                end: str = "1G", placement=None) -> dict[str, Any]:
    """nccl-tests all_reduce_perf as an MPIJob: -np = nodes x GPUs, slotsPerWorker = GPUs.

    What the workers ask for is the target's `placement` (EKS's node type when not given): on a cloud node type every
    GPU and EFA adapter of the node, hugepages, its instance type; on a plain cluster what its training pods ask for
    (KUBE_GPUS GPUs or a CPU share, NODE_LABELS only), no EFA, no hugepages; on CPU one rank per worker and fewer
    iterations."""
    from . import jobspec

    placement = placement or jobspec.node_type_placement(settings)
    count, gpus, adapters = nodes or max(2, settings.gpu_nodes), placement.node_gpus, placement.node_efa
    slots = gpus or 1  # on CPU: one MPI rank per worker pod
    if placement.cloud:
        asks = {"nvidia.com/gpu": gpus, "hugepages-2Mi": "5120Mi", "memory": "32000Mi"}
        if adapters:
            asks["vpc.amazonaws.com/efa"] = adapters
        resources = {"limits": asks, "requests": dict(asks)}
        selector = {"node.kubernetes.io/instance-type": settings.gpu_instance_type}
    else:
        resources, selector = placement.resources, placement.selector
    exports = ["-x", "PATH", "-x", "LD_LIBRARY_PATH"]
    if gpus:
        exports += ["-x", "NCCL_DEBUG=INFO"]
    if placement.cloud:  # NCCL's OFI plugin on EFA (a node type without EFA falls back)
        exports += ["-x", "FI_PROVIDER=efa", "-x", "FI_EFA_USE_DEVICE_RDMA=1"]
    if gpus:
        exports += ["-x", "NCCL_PROTO=simple"]
    iterations = "100" if gpus else "20"
    command = ["/opt/amazon/openmpi/bin/mpirun", "--allow-run-as-root", "--tag-output", "-np", str(count * slots),
               "-bind-to", "none", "-map-by", "slot", *exports,
               "--mca", "pml", "^cm", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_exclude", "lo,docker0",
               "/opt/nccl-tests/build/all_reduce_perf", "-b", begin, "-e", end, "-f", "2", "-g", "1", "-c", "1", "-n",
               iterations]
    worker: dict[str, Any] = {"containers": [{"name": "worker", "image": NCCL_TESTS_IMAGE, "imagePullPolicy": "IfNotPresent",
                                              "resources": resources}]}
    if selector:
        worker["nodeSelector"] = selector
    if gpus:
        # workers get a RAM-backed /dev/shm (NCCL's shared-memory transport needs more than the container runtime's
        # 64 MiB); GPU nodes are tainted
        worker["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        worker["containers"][0]["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
        worker["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    # As upstream's kubernetes/nccl-tests.yaml: the launcher restarts OnFailure (and is only created once every worker
    # is Ready, mpi-operator's launcherCreationPolicy), so a launcher that reaches a worker before its sshd listens
    # tries again instead of failing the test for good. On CPU (doeks' cluster: local images, nothing slow to start)
    # two retries: a broken job fails in about a minute, not after the 10 minutes of six back-offs.
    return {
        "apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob",
        "metadata": {"name": name, "namespace": settings.namespace, "labels": {"app.kubernetes.io/part-of": "doeks"}},
        "spec": {
            "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": 6 if gpus else 2},
            "slotsPerWorker": slots,
            "mpiImplementation": "OpenMPI",
            "launcherCreationPolicy": "WaitForWorkersReady",
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "restartPolicy": "OnFailure", "template": {"spec": {
                    "containers": [{"name": "launcher", "image": NCCL_TESTS_IMAGE, "imagePullPolicy": "IfNotPresent",
                                    "command": command}]}}},
                "Worker": {"replicas": count, "template": {"spec": worker}},
            },
        },
    }


def launcher_selector(name: str) -> str:
    """The MPI operator's labels on the launcher's pod (v2beta1 defaultLabels)."""
    return f"training.kubeflow.org/job-name={name},training.kubeflow.org/job-role=launcher"


def wait_for_mpijob(name: str, namespace: str, timeout_s: float = 1800, poll_s: float = 5) -> tuple[str, str]:
    """Poll the MPIJob (reads only, not echoed) until it is Succeeded or Failed, at most `timeout_s`. Returns (state,
    what the launcher said last): state is Succeeded, Failed (with the condition's message) or "not finished after
    N s"; the launcher's last lines are read at each poll, because a failed launcher's pod is deleted with its logs
    when its Job gives up."""
    import json
    import subprocess
    import time

    from . import kube

    def read(*args: str) -> subprocess.CompletedProcess:
        try:
            return subprocess.run([kube.kubectl(), *args], capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(args, 1, "", "timed out")

    deadline = time.monotonic() + timeout_s
    said = ""
    while True:
        got = read("get", "mpijob", name, "-n", namespace, "-o", "json")
        tail = read("logs", "-n", namespace, "-l", launcher_selector(name), "--tail=20")
        if tail.returncode == 0 and tail.stdout.strip():
            said = tail.stdout.strip()
        if got.returncode == 0:
            conditions = json.loads(got.stdout).get("status", {}).get("conditions", [])
            done = [c for c in conditions if c.get("status") == "True" and c["type"] in ("Succeeded", "Failed")]
            if done:
                reason = f" ({done[0].get('message')})" if done[0]["type"] == "Failed" and done[0].get("message") else ""
                return done[0]["type"] + reason, said
        if time.monotonic() >= deadline:
            return f"not finished after {timeout_s:.0f}s", said
        time.sleep(poll_s)


def run_test(settings, runner, job: dict[str, Any], cpu: bool) -> None:
    """Run the nccl-tests MPIJob `job` on the cluster and report it: the previous run deleted first (a finished MPIJob
    is not run again by an apply; foreground, so the new launcher Job of the same name never meets the old one),
    waited for (at most 10 min on CPU, 30 on GPUs), its launcher's log saved and shown as a table and a chart;
    on GPUs it fails unless NCCL used EFA."""
    from . import kube, nccl, plots, ui

    name, namespace = job["metadata"]["name"], settings.namespace
    kube.run(runner, ["delete", "mpijob", name, "-n", namespace, "--ignore-not-found", "--cascade=foreground",
                      "--wait=true", "--timeout=300s"])
    kube.apply(runner, [job])
    if runner.dry_run:
        return
    wait_s = 600 if cpu else 1800
    ui.say(f"waiting for MPIJob {name} to succeed or fail (at most {wait_s // 60} min)")
    state, said = wait_for_mpijob(name, namespace, timeout_s=wait_s)
    logs = runner.run([kube.kubectl(), "logs", "-n", namespace, "-l", launcher_selector(name), "--tail=-1"],
                      mutating=False, capture=True, check=False)
    out_dir = settings.state_dir / "efa"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.txt").write_text(logs.stdout)
    ui.say(f"log: {out_dir / f'{name}.txt'}")
    if state != "Succeeded":
        from .errors import DoeksError

        tail = "\n".join((logs.stdout.strip() or said).splitlines()[-15:]) or "(none: no launcher ran)"
        raise DoeksError(f"MPIJob {name} {state}: the launcher's last lines:\n{tail}\n(`kubectl describe mpijob {name}`)")
    if cpu:
        nccl.report(logs.stdout, plots.plot_path(settings, f"{name}-busbw.png"),
                    f"{name}: MPI all-reduce on CPU over TCP (no EFA)", require_efa=False)
        ui.say("this ran on CPU over TCP with no EFA (and no GPU, no NCCL): it shows the MPIJob launcher/worker "
               "contract, not EFA bandwidth; `efa.report --require-efa` on this log fails", style="yellow")
        return
    nccl.report(logs.stdout, plots.plot_path(settings, f"{name}-busbw.png"), f"{name}: all_reduce_perf", require_efa=True)

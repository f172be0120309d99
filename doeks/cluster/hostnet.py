"""This machine's side of doeks' cluster: the bridge doeks0, the nodes' network namespaces and veth pairs, routes,
sysctls and cgroups; made before a node starts, removed after the last one stops."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from ..errors import DoeksError
from . import guard, versions
from .nodedef import CGROUP_ROOT, Node, mounts_under, pid


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise DoeksError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def bridge_exists() -> bool:
    return ip("link", "show", versions.BRIDGE, check=False).returncode == 0


def make_bridge() -> None:
    """doeks0 with the node's address before anything listens on it (the CNI bridge plugin then reuses it), and its
    own MAC (versions.bridge_mac: never that of a port, so a pod's veth coming or going leaves the gateway's MAC as
    every neighbour resolved it)."""
    _bridge_with_mac(versions.BRIDGE, versions.bridge_mac(0))
    prefix = versions.POD_CIDR.split("/")[1]
    if versions.NODE_IP not in ip("-4", "addr", "show", versions.BRIDGE).stdout:
        ip("addr", "add", f"{versions.NODE_IP}/{prefix}", "dev", versions.BRIDGE)
    ip("link", "set", versions.BRIDGE, "up")
    # the cluster's whole range unreachable but for the nodes' own routes (more specific): an address of no node (a
    # node removed, a pod range of a stopped one) is refused here, never routed to the default interface, where only
    # the guard would stop it (`up` with fewer nodes: the guard counted one packet, most likely to a removed node)
    ip("route", "replace", "unreachable", versions.CLUSTER_CIDR)


def _bridge_with_mac(bridge: str, mac: str, netns: str | None = None) -> None:
    """`bridge` (in `netns`, else here) made with `mac` as its own, or given it (a bridge made before doeks set one
    follows its ports' MACs)."""
    where = ["-n", netns] if netns else []
    shown = ip(*where, "link", "show", bridge, check=False)
    if shown.returncode != 0:
        ip(*where, "link", "add", bridge, "address", mac, "type", "bridge")
    elif f"link/ether {mac} " not in shown.stdout:
        ip(*where, "link", "set", bridge, "address", mac)


def _sysctl(key: str, value: str) -> None:
    path = Path("/proc/sys") / key.replace(".", "/")
    try:
        if path.read_text().strip() != value:
            path.write_text(value)
    except OSError as error:
        raise DoeksError(f"cannot set {key}={value} ({error.strerror}): the cluster needs it") from None


NETNS_DIR = Path("/run/netns")  # where containerd (and iproute2) bind-mount the network namespaces they keep


def make_netns_dir(path: Path = NETNS_DIR) -> None:
    """/run/netns made a mount point of its own, shared (as `ip netns add` makes it, the first time it runs on a
    machine), before containerd keeps a pod's network namespace there. Else the first `ip netns add` after the
    cluster started (an extra node's, a test's, anyone's) bind-mounts the folder over itself with the pods'
    namespaces copied in: a pod's teardown then unmounts the copy it sees, the original stays mounted underneath, the
    file cannot be removed (EBUSY), and containerd reports the sandbox's status as an error for ever: the pod stays
    Terminating and `down` waited on it (a fresh machine, CI: test_network_guard ran after the cluster started)."""
    path.mkdir(parents=True, exist_ok=True)
    if str(path) in mounts_under(path):  # a mount point already (iproute2's, or ours)
        return
    mount = shutil.which("mount") or "/bin/mount"
    for args in (["--rbind", str(path), str(path)], ["--make-rshared", str(path)]):
        result = subprocess.run([mount, *args], capture_output=True, text=True)
        if result.returncode != 0:
            raise DoeksError(f"cannot make {path} a mount point of its own (mount {' '.join(args)}): "
                             f"{(result.stderr.strip().splitlines() or ['?'])[-1]}")


def prepare_host() -> None:
    if not Path("/proc/sys/net/bridge").exists():
        modprobe = shutil.which("modprobe") or shutil.which("modprobe", path="/usr/sbin:/sbin")
        if modprobe:
            subprocess.run([modprobe, "br_netfilter"], capture_output=True)
        if not Path("/proc/sys/net/bridge").exists():
            raise DoeksError("the br_netfilter kernel module is not loaded and cannot be (modprobe br_netfilter): "
                             "Services between pods on the bridge need it")
    _sysctl("net.ipv4.ip_forward", "1")
    _sysctl("net.bridge.bridge-nf-call-iptables", "1")
    make_cgroups()
    if not pid("containerd"):  # with pods running, their namespaces would be copied over: left as they are
        make_netns_dir()


def make_cgroups(cgroup_root: str = CGROUP_ROOT) -> None:
    """The kubelet's cgroup root (/doeks; an extra node's /doeks/<name>) in every cgroup v1 hierarchy: the kubelet
    refuses a root that does not exist. A new cpuset cgroup has no CPUs or memory nodes until given its parent's."""
    root = Path("/sys/fs/cgroup")
    for hierarchy in sorted(root.iterdir()) if root.exists() else []:
        if not hierarchy.is_dir() or hierarchy.name == "unified" or not (hierarchy / "cgroup.procs").exists():
            continue
        parent = hierarchy
        for part in cgroup_root.strip("/").split("/"):
            mine = parent / part
            mine.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (mine / name).exists() and not (mine / name).read_text().strip():
                    (mine / name).write_text((parent / name).read_text())
            parent = mine


# -- the extra nodes' network ------------------------------------------------------------------------------------------
def _in(node: Node, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """A command in the node's network namespace."""
    result = subprocess.run(node.enter() + list(argv), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise DoeksError(f"{' '.join(argv)} in node {node.name} failed: {result.stderr.strip()}")
    return result


def netns_exists(node: Node) -> bool:
    return node.netns is not None and Path(f"/run/netns/{node.netns}").exists()


def make_node_network(node: Node) -> None:
    """The node's network namespace with its guard installed before anything else, its veth pair on the bridge at
    its address (default route: the host), and the host's route to its pod range. Idempotent; brings its link up."""
    if not netns_exists(node):
        ip("netns", "add", node.netns)
    guard.install_node(node.netns)  # first: nothing of the node has started, nothing has left it
    if ip("link", "show", node.veth, check=False).returncode != 0:
        ip("link", "add", node.veth, "type", "veth", "peer", "name", guard.NODE_INTERFACE, "netns", node.netns)
    ip("link", "set", node.veth, "master", versions.BRIDGE)
    ip("link", "set", node.veth, "up")
    prefix = versions.NODE_NET.split("/")[1]
    if f"{versions.NODE_NET_GATEWAY}/" not in ip("-4", "addr", "show", versions.BRIDGE).stdout:
        ip("addr", "add", f"{versions.NODE_NET_GATEWAY}/{prefix}", "dev", versions.BRIDGE)
    if f"{node.ip}/" not in ip("-n", node.netns, "-4", "addr", "show", guard.NODE_INTERFACE).stdout:
        ip("-n", node.netns, "addr", "add", f"{node.ip}/{prefix}", "dev", guard.NODE_INTERFACE)
    ip("-n", node.netns, "link", "set", "lo", "up")
    ip("-n", node.netns, "link", "set", guard.NODE_INTERFACE, "up")
    ip("-n", node.netns, "route", "replace", "default", "via", versions.NODE_NET_GATEWAY)
    ip("route", "replace", node.pod_cidr, "via", node.ip, "dev", versions.BRIDGE)
    # the node's pods' bridge, made here with its own MAC before the CNI bridge plugin (which reuses it) would make
    # one that follows its ports' MACs (see versions.bridge_mac)
    _bridge_with_mac("cni0", versions.bridge_mac(node.index), node.netns)
    sysctl = shutil.which("sysctl") or shutil.which("sysctl", path="/usr/sbin:/sbin") or "sysctl"
    for key in ("net.ipv4.ip_forward=1", "net.bridge.bridge-nf-call-iptables=1"):
        _in(node, sysctl, "-q", "-w", key)


def unplug(node: Node) -> None:
    """The node's link down: its address and pods are gone from the network, as a machine that is lost."""
    if ip("link", "show", node.veth, check=False).returncode == 0:
        ip("link", "set", node.veth, "down", check=False)


def remove_node_network(node: Node) -> None:
    """The node's route, link and network namespace removed; with the last extra node, the host's address on the
    nodes' network (NODE_NET_GATEWAY) too, and with it the bridge's route to NODE_NET (`up` with fewer nodes left it)."""
    ip("route", "del", node.pod_cidr, check=False)
    ip("link", "delete", node.veth, check=False)
    if netns_exists(node):
        ip("netns", "delete", node.netns, check=False)
    if not guard.node_namespaces():  # gone already is fine
        ip("addr", "del", f"{versions.NODE_NET_GATEWAY}/{versions.NODE_NET.split('/')[1]}", "dev", versions.BRIDGE,
            check=False)


# -- up / down -------------------------------------------------------------------------------------------------------

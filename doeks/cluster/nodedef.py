"""What a node of doeks' cluster is: its name, addresses, network namespace, folders, containerd socket and cgroup
(node 0 is this machine's own network; node i >= 1 a network namespace of its own, as kind runs its nodes)."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import MissingTool
from . import versions


RUN_DIR = Path("/run/doeks")
CONTAINERD_SOCKET = RUN_DIR / "containerd" / "containerd.sock"  # node 0's (Node.socket)
CGROUP_ROOT = "/doeks"
SERVER = f"https://{versions.NODE_IP}:{versions.API_PORT}"
# Start order; stop is the reverse (etcd last but one, containerd last).
COMPONENTS = ("containerd", "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy")
NODE_COMPONENTS = ("containerd", "kubelet", "kube-proxy")  # what an extra node runs (the control plane is node 0's)
APT_PACKAGES = {"containerd": "containerd", "runc": "runc", "ctr": "containerd", "iptables": "iptables",
                "ip": "iproute2", "conntrack": "conntrack", "busybox": "busybox-static"}
CNI_BIN = Path("/usr/lib/cni")


def d() -> Path:
    return versions.cluster_dir()


@dataclass(frozen=True)
class Node:
    """One node of doeks' cluster: 0 is the host's (control plane, bridge, node address 10.244.0.1); i >= 1 runs in a
    network namespace of its own (see the module's docstring)."""

    index: int = 0

    @property
    def name(self) -> str:
        return versions.node_name(self.index)

    @property
    def ip(self) -> str:
        return versions.node_ip(self.index)

    @property
    def pod_cidr(self) -> str:
        return versions.pod_cidr(self.index)

    @property
    def gateway(self) -> str:
        """The pods' gateway: the bridge's address on node 0, the node's own pod bridge elsewhere."""
        return versions.NODE_IP if self.index == 0 else f"10.244.{self.index}.1"

    @property
    def netns(self) -> str | None:
        return None if self.index == 0 else f"doeks-node-{self.index}"

    @property
    def veth(self) -> str:
        """The host's end of the node's veth pair (on the bridge); the node's end is its eth0."""
        return f"doeks-node{self.index}"

    @property
    def dir(self) -> Path:
        return d() if self.index == 0 else d() / "nodes" / self.name

    @property
    def run_dir(self) -> Path:
        return RUN_DIR if self.index == 0 else RUN_DIR / "nodes" / self.name

    @property
    def socket(self) -> Path:
        return self.run_dir / "containerd" / "containerd.sock"

    @property
    def containerd_root(self) -> Path:
        """Images stay between clusters (a cache); each node has its own store, as each machine has."""
        root = versions.cache_dir()
        return root / "containerd" if self.index == 0 else root / "containerd-nodes" / self.name

    @property
    def cgroup_root(self) -> str:
        return CGROUP_ROOT if self.index == 0 else f"{CGROUP_ROOT}/{self.name}"

    @property
    def components(self) -> tuple[str, ...]:
        return COMPONENTS if self.index == 0 else NODE_COMPONENTS

    def enter(self) -> list[str]:
        """What an extra node's processes are started under: its network namespace only."""
        if self.netns is None:
            return []
        return [shutil.which("nsenter") or "/usr/bin/nsenter", f"--net=/run/netns/{self.netns}", "--"]


NODE0 = Node(0)


def node_named(name: str) -> Node:
    """The node of that name (doeks, doeks-1, ...); ValueError for a name doeks does not give a node."""
    if name == versions.NODE_NAME:
        return NODE0
    prefix = f"{versions.NODE_NAME}-"
    index = name[len(prefix):] if name.startswith(prefix) else ""
    if not index.isdigit() or not 1 <= int(index) < versions.MAX_NODES or str(int(index)) != index:
        raise ValueError(name)
    return Node(int(index))


def bin_path(name: str) -> str:
    path = versions.bin_dir() / name
    if not path.exists():
        raise MissingTool(f"{name} is not built: run `invoke setup --kubernetes` (builds doeks' cluster once)")
    return str(path)


def host_tools_missing() -> list[str]:
    """Debian packages the node needs that are not installed."""
    missing = sorted({package for tool, package in APT_PACKAGES.items()
                      if not shutil.which(tool) and not shutil.which(tool, path="/usr/sbin:/sbin")})
    if not (CNI_BIN / "bridge").exists():
        missing.append("containernetworking-plugins")
    return missing


# -- configuration files ----------------------------------------------------------------------------------------------


def pid_file(component: str, node: Node = NODE0) -> Path:
    return node.dir / "run" / f"{component}.pid"


def log_file(component: str, node: Node = NODE0) -> Path:
    return node.dir / "logs" / f"{component}.log"


def pid(component: str, node: Node = NODE0) -> int | None:
    """The component's pid if it runs (the recorded pid, checked against /proc: a reused pid is not ours)."""
    try:
        value = int(pid_file(component, node).read_text().split()[0])
        cmdline = Path(f"/proc/{value}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, IndexError):
        return None
    expected = argv_name(component)
    return value if any(part.endswith(expected.encode()) for part in cmdline[:2]) else None


def argv_name(component: str) -> str:
    return {"containerd": "containerd", "etcd": "etcd"}.get(component, component)


def mounts_under(*roots: Path) -> list[str]:
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if any(point == str(r) or point.startswith(str(r) + "/") for r in roots):
            out.append(point)
    return sorted(out, key=len, reverse=True)

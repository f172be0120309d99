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
from dataclasses import dataclass
from pathlib import Path

from .. import ui
from ..errors import DoeksError, MissingTool
from . import build, guard, pki, versions

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


def _bin(name: str) -> str:
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
def containerd_config(node: Node = NODE0) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return "\n".join([
        "version = 2",
        f'root = "{node.containerd_root}"',   # images stay between clusters (a cache)
        f'state = "{node.run_dir / "containerd" / "state"}"',
        "[grpc]",
        f'  address = "{node.socket}"',
        "[ttrpc]",
        f'  address = "{node.socket}.ttrpc"',
        "[debug]",
        f'  address = "{node.run_dir / "containerd" / "debug.sock"}"',
        "[metrics]",
        '  address = ""',
        f"[{cri}]",
        f'  sandbox_image = "{versions.PAUSE_IMAGE}"',
        "  enable_cdi = false",
        # no CAP_SYS_RESOURCE here: a pod's oom_score_adj cannot go below this process's; keep the higher value
        "  restrict_oom_score_adj = true",
        f"[{cri}.containerd]",
        '  snapshotter = "overlayfs"',
        '  default_runtime_name = "runc"',
        f"[{cri}.containerd.runtimes.runc]",
        '  runtime_type = "io.containerd.runc.v2"',
        f"[{cri}.containerd.runtimes.runc.options]",
        "  SystemdCgroup = false",
        f"[{cri}.cni]",
        f'  bin_dir = "{CNI_BIN}"',
        f'  conf_dir = "{node.dir / "cni"}"',
        # registry host configuration (hosts.toml per registry name, read at each pull): empty unless the EKS
        # rehearsal maps its ECR name to the loopback registry (doeks.cluster.registry); any other name still goes
        # to the no-pull proxy below and fails at once
        f"[{cri}.registry]",
        f'  config_path = "{d() / "registry-hosts"}"',
        "",
    ])


def cni_config(node: Node = NODE0) -> dict:
    """Pods on the bridge doeks0 (node 0), or on a bridge inside the node's namespace (an extra node: the same
    plugin, run by its containerd in that namespace)."""
    bridge = versions.BRIDGE if node.index == 0 else "cni0"
    return {"cniVersion": "0.4.0", "name": "doeks", "plugins": [
        {"type": "bridge", "bridge": bridge, "isGateway": True, "ipMasq": False, "hairpinMode": True,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": node.pod_cidr, "gateway": node.gateway}]],
                  "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(node.dir / "cni-ipam")}},
    ]}


def kubelet_health_address(node: Node = NODE0) -> str:
    """Where the kubelet answers /healthz: loopback on node 0, the node's address elsewhere (the host checks it)."""
    return "127.0.0.1" if node.index == 0 else node.ip


def kubelet_config(node: Node = NODE0) -> dict:
    pki_dir = pki.pki_dir()
    serving = "kubelet-serving" if node.index == 0 else f"kubelet-serving-{node.name}"
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": node.ip, "port": 10250, "readOnlyPort": 0,
        "healthzBindAddress": kubelet_health_address(node), "healthzPort": 10248,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(pki_dir / "ca.crt")}},
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(pki_dir / f"{serving}.crt"), "tlsPrivateKeyFile": str(pki_dir / f"{serving}.key"),
        "cgroupDriver": "cgroupfs", "cgroupRoot": node.cgroup_root, "failCgroupV1": False, "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{node.socket}",
        "clusterDNS": [versions.DNS_SERVICE_IP], "clusterDomain": versions.CLUSTER_DOMAIN,
        "resolvConf": str(d() / "resolv.conf"),
        # a nearly full disk must not evict the job, nor garbage-collect the images imported here (no registry)
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "0%", "imagefs.available": "0%",
                         "nodefs.inodesFree": "0%", "imagefs.inodesFree": "0%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "podCIDR": node.pod_cidr, "maxPods": 110, "serializeImagePulls": False, "nodeLeaseDurationSeconds": 20,
        "protectKernelDefaults": False, "makeIPTablesUtilChains": True,
        "staticPodPath": "", "rotateCertificates": False, "serverTLSBootstrap": False,
        "localStorageCapacityIsolation": False,
    }
    if node.index:  # the kubelet removes pod log folders of pods it does not run: each node keeps its own
        config["podLogsDir"] = str(node.dir / "pod-logs")
        config["registerWithTaints"] = [dict(versions.WORKER_TAINT)]  # training pods only (versions.WORKER_TAINT)
    return config


def kube_proxy_health_address(node: Node = NODE0) -> str:
    return "127.0.0.1" if node.index == 0 else node.ip


def kube_proxy_config(node: Node = NODE0) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(d() / "kube-proxy.kubeconfig")},
        "mode": "iptables", "clusterCIDR": versions.CLUSTER_CIDR, "hostnameOverride": node.name,
        "healthzBindAddress": f"{kube_proxy_health_address(node)}:10256", "metricsBindAddress": "127.0.0.1:10249",
        "nodePortAddresses": [f"{node.ip}/32"],                   # NodePorts on the bridge only, never on eth0
        "conntrack": {"maxPerCore": 0, "min": 0},                 # leave the host's conntrack sysctls alone
    }


def argv(component: str, node: Node = NODE0) -> list[str]:
    if node.index:
        return node.enter() + _node_argv(component, node)
    p, c = pki.pki_dir(), d()
    binary = _bin("doeks-node")
    if component == "containerd":
        return [shutil.which("containerd") or "/usr/bin/containerd", "--config", str(c / "containerd.toml")]
    if component == "etcd":
        peer = f"http://127.0.0.1:{versions.ETCD_PEER_PORT}"
        client = f"http://127.0.0.1:{versions.ETCD_CLIENT_PORT}"
        return [_bin("etcd"), "--name", "doeks", "--data-dir", str(c / "etcd"), "--listen-client-urls", client,
                "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"doeks={peer}", "--listen-metrics-urls", "",
                # a throw-away single-node cluster on a small disk: no fsync, a small backend
                "--unsafe-no-fsync", "--quota-backend-bytes", str(2 * 1024 ** 3), "--log-level", "warn"]
    if component == "kube-apiserver":
        return [binary, "kube-apiserver", f"--etcd-servers=http://127.0.0.1:{versions.ETCD_CLIENT_PORT}",
                f"--bind-address={versions.NODE_IP}", f"--advertise-address={versions.NODE_IP}",
                f"--secure-port={versions.API_PORT}",
                f"--tls-cert-file={p / 'apiserver.crt'}", f"--tls-private-key-file={p / 'apiserver.key'}",
                f"--client-ca-file={p / 'ca.crt'}",
                f"--kubelet-client-certificate={p / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={p / 'apiserver-kubelet-client.key'}",
                f"--kubelet-certificate-authority={p / 'ca.crt'}", "--kubelet-preferred-address-types=InternalIP",
                f"--service-account-key-file={p / 'sa.pub'}", f"--service-account-signing-key-file={p / 'sa.key'}",
                f"--service-account-issuer=https://kubernetes.default.svc.{versions.CLUSTER_DOMAIN}",
                f"--service-cluster-ip-range={versions.SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=true", "--profiling=false", "--v=1"]
    kubeconfig = lambda name: str(c / f"{name}.kubeconfig")  # noqa: E731
    if component == "kube-controller-manager":
        k = kubeconfig("controller-manager")
        return [binary, "kube-controller-manager", f"--kubeconfig={k}", f"--authentication-kubeconfig={k}",
                f"--authorization-kubeconfig={k}", "--bind-address=127.0.0.1",
                f"--service-account-private-key-file={p / 'sa.key'}", f"--root-ca-file={p / 'ca.crt'}",
                f"--cluster-signing-cert-file={p / 'ca.crt'}", f"--cluster-signing-key-file={p / 'ca.key'}",
                "--use-service-account-credentials=true", "--controllers=*,bootstrapsigner,tokencleaner",
                "--allocate-node-cidrs=false", f"--service-cluster-ip-range={versions.SERVICE_CIDR}",
                # a node whose kubelet stopped is NotReady after 24 s (default 50 s): its kubelet renews its lease
                # every 5 s (nodeLeaseDurationSeconds 20), so four renewals are missed first
                "--node-monitor-grace-period=24s",
                "--leader-elect=false", "--profiling=false", "--v=1"]
    if component == "kube-scheduler":
        k = kubeconfig("scheduler")
        return [binary, "kube-scheduler", f"--kubeconfig={k}", f"--authentication-kubeconfig={k}",
                f"--authorization-kubeconfig={k}", "--bind-address=127.0.0.1", "--leader-elect=false",
                "--profiling=false", "--v=1"]
    if component == "kubelet":
        return [binary, "kubelet", f"--config={c / 'kubelet.yaml'}", f"--kubeconfig={kubeconfig('kubelet')}",
                f"--hostname-override={versions.NODE_NAME}", f"--node-ip={versions.NODE_IP}",
                f"--root-dir={c / 'kubelet'}", "--v=1"]
    if component == "kube-proxy":
        return [binary, "kube-proxy", f"--config={c / 'kube-proxy.yaml'}", "--v=1"]
    raise ValueError(component)


def _node_argv(component: str, node: Node) -> list[str]:
    """An extra node's containerd, kubelet (its own certificate, root folder and address) and kube-proxy."""
    folder = node.dir
    if component == "containerd":
        return [shutil.which("containerd") or "/usr/bin/containerd", "--config", str(folder / "containerd.toml")]
    if component == "kubelet":
        return [_bin("doeks-node"), "kubelet", f"--config={folder / 'kubelet.yaml'}",
                f"--kubeconfig={folder / 'kubelet.kubeconfig'}", f"--hostname-override={node.name}",
                f"--node-ip={node.ip}", f"--root-dir={folder / 'kubelet'}", "--v=1"]
    if component == "kube-proxy":
        return [_bin("doeks-node"), "kube-proxy", f"--config={folder / 'kube-proxy.yaml'}", "--v=1"]
    raise ValueError(component)


def _write(path: Path, text: str) -> None:
    """Write only a change: kube-proxy exits when its configuration file is rewritten, even with the same content."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def write_configs(node: Node = NODE0) -> None:
    import yaml

    c = node.dir
    for folder in ("cni", "logs", "run", "kubelet") + (("etcd",) if node.index == 0 else ()):
        (c / folder).mkdir(parents=True, exist_ok=True)
    _write(c / "containerd.toml", containerd_config(node))
    _write(c / "cni" / "10-doeks.conflist", json.dumps(cni_config(node), indent=2))
    _write(c / "kubelet.yaml", yaml.safe_dump(kubelet_config(node), sort_keys=False))
    _write(c / "kube-proxy.yaml", yaml.safe_dump(kube_proxy_config(node), sort_keys=False))
    # pods resolve through CoreDNS (ClusterFirst); the host's resolvers are never handed to them
    _write(d() / "resolv.conf", f"search {versions.CLUSTER_DOMAIN}\noptions ndots:5\n")


# -- processes ---------------------------------------------------------------------------------------------------------
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
def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise DoeksError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def bridge_exists() -> bool:
    return _ip("link", "show", versions.BRIDGE, check=False).returncode == 0


def make_bridge() -> None:
    """doeks0 with the node's address before anything listens on it (the CNI bridge plugin then reuses it), and its
    own MAC (versions.bridge_mac: never that of a port, so a pod's veth coming or going leaves the gateway's MAC as
    every neighbour resolved it)."""
    _bridge_with_mac(versions.BRIDGE, versions.bridge_mac(0))
    prefix = versions.POD_CIDR.split("/")[1]
    if versions.NODE_IP not in _ip("-4", "addr", "show", versions.BRIDGE).stdout:
        _ip("addr", "add", f"{versions.NODE_IP}/{prefix}", "dev", versions.BRIDGE)
    _ip("link", "set", versions.BRIDGE, "up")
    # the cluster's whole range unreachable but for the nodes' own routes (more specific): an address of no node (a
    # node removed, a pod range of a stopped one) is refused here, never routed to the default interface, where only
    # the guard would stop it (`up` with fewer nodes: the guard counted one packet, most likely to a removed node)
    _ip("route", "replace", "unreachable", versions.CLUSTER_CIDR)


def _bridge_with_mac(bridge: str, mac: str, netns: str | None = None) -> None:
    """`bridge` (in `netns`, else here) made with `mac` as its own, or given it (a bridge made before doeks set one
    follows its ports' MACs)."""
    where = ["-n", netns] if netns else []
    shown = _ip(*where, "link", "show", bridge, check=False)
    if shown.returncode != 0:
        _ip(*where, "link", "add", bridge, "address", mac, "type", "bridge")
    elif f"link/ether {mac} " not in shown.stdout:
        _ip(*where, "link", "set", bridge, "address", mac)


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
        _ip("netns", "add", node.netns)
    guard.install_node(node.netns)  # first: nothing of the node has started, nothing has left it
    if _ip("link", "show", node.veth, check=False).returncode != 0:
        _ip("link", "add", node.veth, "type", "veth", "peer", "name", guard.NODE_INTERFACE, "netns", node.netns)
    _ip("link", "set", node.veth, "master", versions.BRIDGE)
    _ip("link", "set", node.veth, "up")
    prefix = versions.NODE_NET.split("/")[1]
    if f"{versions.NODE_NET_GATEWAY}/" not in _ip("-4", "addr", "show", versions.BRIDGE).stdout:
        _ip("addr", "add", f"{versions.NODE_NET_GATEWAY}/{prefix}", "dev", versions.BRIDGE)
    if f"{node.ip}/" not in _ip("-n", node.netns, "-4", "addr", "show", guard.NODE_INTERFACE).stdout:
        _ip("-n", node.netns, "addr", "add", f"{node.ip}/{prefix}", "dev", guard.NODE_INTERFACE)
    _ip("-n", node.netns, "link", "set", "lo", "up")
    _ip("-n", node.netns, "link", "set", guard.NODE_INTERFACE, "up")
    _ip("-n", node.netns, "route", "replace", "default", "via", versions.NODE_NET_GATEWAY)
    _ip("route", "replace", node.pod_cidr, "via", node.ip, "dev", versions.BRIDGE)
    # the node's pods' bridge, made here with its own MAC before the CNI bridge plugin (which reuses it) would make
    # one that follows its ports' MACs (see versions.bridge_mac)
    _bridge_with_mac("cni0", versions.bridge_mac(node.index), node.netns)
    sysctl = shutil.which("sysctl") or shutil.which("sysctl", path="/usr/sbin:/sbin") or "sysctl"
    for key in ("net.ipv4.ip_forward=1", "net.bridge.bridge-nf-call-iptables=1"):
        _in(node, sysctl, "-q", "-w", key)


def unplug(node: Node) -> None:
    """The node's link down: its address and pods are gone from the network, as a machine that is lost."""
    if _ip("link", "show", node.veth, check=False).returncode == 0:
        _ip("link", "set", node.veth, "down", check=False)


def remove_node_network(node: Node) -> None:
    """The node's route, link and network namespace removed; with the last extra node, the host's address on the
    nodes' network (NODE_NET_GATEWAY) too, and with it the bridge's route to NODE_NET (`up` with fewer nodes left it)."""
    _ip("route", "del", node.pod_cidr, check=False)
    _ip("link", "delete", node.veth, check=False)
    if netns_exists(node):
        _ip("netns", "delete", node.netns, check=False)
    if not guard.node_namespaces():  # gone already is fine
        _ip("addr", "del", f"{versions.NODE_NET_GATEWAY}/{versions.NODE_NET.split('/')[1]}", "dev", versions.BRIDGE,
            check=False)


# -- up / down -------------------------------------------------------------------------------------------------------
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


def mounts_under(*roots: Path) -> list[str]:
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if any(point == str(r) or point.startswith(str(r) + "/") for r in roots):
            out.append(point)
    return sorted(out, key=len, reverse=True)


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
    for words in (line.split() for line in _ip("-4", "route", "show", check=False).stdout.splitlines()):
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
        subprocess.run([_bin("doeks-node"), "kube-proxy", "--cleanup"], capture_output=True, text=True)
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
        _ip("link", "delete", versions.BRIDGE, check=False)
    _ip("route", "del", "unreachable", versions.CLUSTER_CIDR, check=False)
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

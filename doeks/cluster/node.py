"""Start and stop doeks' single-node cluster: containerd (Debian's, with runc and the CNI plugins), etcd, the API
server, controller manager, scheduler, kubelet and kube-proxy (doeks' build), then CoreDNS as a Deployment.

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

RUN_DIR = Path("/run/doeks")
CONTAINERD_SOCKET = RUN_DIR / "containerd" / "containerd.sock"
CGROUP_ROOT = "/doeks"
SERVER = f"https://{versions.NODE_IP}:{versions.API_PORT}"
# Start order; stop is the reverse (etcd last but one, containerd last).
COMPONENTS = ("containerd", "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy")
APT_PACKAGES = {"containerd": "containerd", "runc": "runc", "ctr": "containerd", "iptables": "iptables",
                "ip": "iproute2", "conntrack": "conntrack", "busybox": "busybox-static"}
CNI_BIN = Path("/usr/lib/cni")


def d() -> Path:
    return versions.cluster_dir()


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
def containerd_config() -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return "\n".join([
        "version = 2",
        f'root = "{versions.cache_dir() / "containerd"}"',   # images stay between clusters (a cache)
        f'state = "{RUN_DIR / "containerd" / "state"}"',
        "[grpc]",
        f'  address = "{CONTAINERD_SOCKET}"',
        "[ttrpc]",
        f'  address = "{CONTAINERD_SOCKET}.ttrpc"',
        "[debug]",
        f'  address = "{RUN_DIR / "containerd" / "debug.sock"}"',
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
        f'  conf_dir = "{d() / "cni"}"',
        # registry host configuration (hosts.toml per registry name, read at each pull): empty unless the EKS
        # rehearsal maps its ECR name to the loopback registry (doeks.cluster.registry); any other name still goes
        # to the no-pull proxy below and fails at once
        f"[{cri}.registry]",
        f'  config_path = "{d() / "registry-hosts"}"',
        "",
    ])


def cni_config() -> dict:
    return {"cniVersion": "0.4.0", "name": "doeks", "plugins": [
        {"type": "bridge", "bridge": versions.BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": versions.POD_CIDR, "gateway": versions.NODE_IP}]],
                  "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(d() / "cni-ipam")}},
    ]}


def kubelet_config() -> dict:
    pki_dir = pki.pki_dir()
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": versions.NODE_IP, "port": 10250, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(pki_dir / "ca.crt")}},
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(pki_dir / "kubelet-serving.crt"), "tlsPrivateKeyFile": str(pki_dir / "kubelet-serving.key"),
        "cgroupDriver": "cgroupfs", "cgroupRoot": CGROUP_ROOT, "failCgroupV1": False, "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
        "clusterDNS": [versions.DNS_SERVICE_IP], "clusterDomain": versions.CLUSTER_DOMAIN,
        "resolvConf": str(d() / "resolv.conf"),
        # a nearly full disk must not evict the job, nor garbage-collect the images imported here (no registry)
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "0%", "imagefs.available": "0%",
                         "nodefs.inodesFree": "0%", "imagefs.inodesFree": "0%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "podCIDR": versions.POD_CIDR, "maxPods": 110, "serializeImagePulls": False,
        "protectKernelDefaults": False, "makeIPTablesUtilChains": True,
        "staticPodPath": "", "rotateCertificates": False, "serverTLSBootstrap": False,
        "localStorageCapacityIsolation": False,
    }


def kube_proxy_config() -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(d() / "kube-proxy.kubeconfig")},
        "mode": "iptables", "clusterCIDR": versions.POD_CIDR, "hostnameOverride": versions.NODE_NAME,
        "healthzBindAddress": "127.0.0.1:10256", "metricsBindAddress": "127.0.0.1:10249",
        "nodePortAddresses": [f"{versions.NODE_IP}/32"],          # NodePorts on the bridge only, never on eth0
        "conntrack": {"maxPerCore": 0, "min": 0},                 # leave the host's conntrack sysctls alone
    }


def argv(component: str) -> list[str]:
    p, c = pki.pki_dir(), d()
    node = _bin("doeks-node")
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
        return [node, "kube-apiserver", f"--etcd-servers=http://127.0.0.1:{versions.ETCD_CLIENT_PORT}",
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
        return [node, "kube-controller-manager", f"--kubeconfig={k}", f"--authentication-kubeconfig={k}",
                f"--authorization-kubeconfig={k}", "--bind-address=127.0.0.1",
                f"--service-account-private-key-file={p / 'sa.key'}", f"--root-ca-file={p / 'ca.crt'}",
                f"--cluster-signing-cert-file={p / 'ca.crt'}", f"--cluster-signing-key-file={p / 'ca.key'}",
                "--use-service-account-credentials=true", "--controllers=*,bootstrapsigner,tokencleaner",
                "--allocate-node-cidrs=false", f"--service-cluster-ip-range={versions.SERVICE_CIDR}",
                "--leader-elect=false", "--profiling=false", "--v=1"]
    if component == "kube-scheduler":
        k = kubeconfig("scheduler")
        return [node, "kube-scheduler", f"--kubeconfig={k}", f"--authentication-kubeconfig={k}",
                f"--authorization-kubeconfig={k}", "--bind-address=127.0.0.1", "--leader-elect=false",
                "--profiling=false", "--v=1"]
    if component == "kubelet":
        return [node, "kubelet", f"--config={c / 'kubelet.yaml'}", f"--kubeconfig={kubeconfig('kubelet')}",
                f"--hostname-override={versions.NODE_NAME}", f"--node-ip={versions.NODE_IP}",
                f"--root-dir={c / 'kubelet'}", "--v=1"]
    if component == "kube-proxy":
        return [node, "kube-proxy", f"--config={c / 'kube-proxy.yaml'}", "--v=1"]
    raise ValueError(component)


def _write(path: Path, text: str) -> None:
    """Write only a change: kube-proxy exits when its configuration file is rewritten, even with the same content."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def write_configs() -> None:
    import yaml

    c = d()
    for folder in ("cni", "logs", "run", "kubelet", "etcd"):
        (c / folder).mkdir(parents=True, exist_ok=True)
    _write(c / "containerd.toml", containerd_config())
    _write(c / "cni" / "10-doeks.conflist", json.dumps(cni_config(), indent=2))
    _write(c / "kubelet.yaml", yaml.safe_dump(kubelet_config(), sort_keys=False))
    _write(c / "kube-proxy.yaml", yaml.safe_dump(kube_proxy_config(), sort_keys=False))
    # pods resolve through CoreDNS (ClusterFirst); the host's resolvers are never handed to them
    _write(c / "resolv.conf", f"search {versions.CLUSTER_DOMAIN}\noptions ndots:5\n")


# -- processes ---------------------------------------------------------------------------------------------------------
def pid_file(component: str) -> Path:
    return d() / "run" / f"{component}.pid"


def log_file(component: str) -> Path:
    return d() / "logs" / f"{component}.log"


def pid(component: str) -> int | None:
    """The component's pid if it runs (the recorded pid, checked against /proc: a reused pid is not ours)."""
    try:
        value = int(pid_file(component).read_text().split()[0])
        cmdline = Path(f"/proc/{value}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, IndexError):
        return None
    expected = argv_name(component)
    return value if any(part.endswith(expected.encode()) for part in cmdline[:2]) else None


def argv_name(component: str) -> str:
    return {"containerd": "containerd", "etcd": "etcd"}.get(component, component)


_STARTED: dict[str, subprocess.Popen] = {}
# containerd pulls through this proxy, a loopback port nothing listens on: an image the node lacks fails at once with
# `proxyconnect tcp: dial tcp 127.0.0.1:9: connect: connection refused` (ErrImagePull) instead of a registry name being
# looked up and fetched through the default interface (Go's net/http asks no proxy for loopback registries only).
NO_PULL_PROXY = "http://127.0.0.1:9"
NO_PULL_ENV = {name: NO_PULL_PROXY for name in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy")} | {
    "NO_PROXY": "", "no_proxy": ""}


def start(component: str) -> int:
    running = pid(component)
    if running:
        return running
    command = argv(component)
    env = dict(os.environ)
    env["PATH"] = f"{CNI_BIN}:{env.get('PATH', '')}:/usr/sbin:/sbin"
    if component == "containerd":
        env.update(NO_PULL_ENV)  # a missing image must never be fetched from outside this machine
    with open(log_file(component), "ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, env=env, cwd=d())
    pid_file(component).write_text(f"{process.pid}\n")
    _STARTED[component] = process
    return process.pid


def _exited(component: str) -> bool:
    """The component this process started has ended (its Popen says so; right after the fork /proc still shows
    python's command line, so the pid file's check cannot tell yet)."""
    process = _STARTED.get(component)
    if process is not None:
        return process.poll() is not None
    return not pid(component)


def stop(component: str, timeout: float = 20) -> bool:
    running = pid(component)
    if not running:
        pid_file(component).unlink(missing_ok=True)
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
    pid_file(component).unlink(missing_ok=True)
    return True


def _zombie(value: int) -> bool:
    try:
        return Path(f"/proc/{value}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _wait(what: str, check, timeout: float, component: str | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if component and _exited(component):
            raise DoeksError(f"{component} exited while starting: {_last_lines(component)} (log: {log_file(component)})")
        time.sleep(0.5)
    where = f" (log: {log_file(component)}: {_last_lines(component)})" if component else ""
    raise DoeksError(f"{what} did not come up in {timeout:.0f}s{where}")


def _last_lines(component: str, count: int = 2) -> str:
    try:
        lines = [line for line in log_file(component).read_text(errors="replace").splitlines() if line.strip()]
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
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
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


# -- the bridge --------------------------------------------------------------------------------------------------------
def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise DoeksError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def bridge_exists() -> bool:
    return _ip("link", "show", versions.BRIDGE, check=False).returncode == 0


def make_bridge() -> None:
    """doeks0 with the node's address before anything listens on it (the CNI bridge plugin then reuses it)."""
    if not bridge_exists():
        _ip("link", "add", versions.BRIDGE, "type", "bridge")
    prefix = versions.POD_CIDR.split("/")[1]
    if versions.NODE_IP not in _ip("-4", "addr", "show", versions.BRIDGE).stdout:
        _ip("addr", "add", f"{versions.NODE_IP}/{prefix}", "dev", versions.BRIDGE)
    _ip("link", "set", versions.BRIDGE, "up")


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


def make_cgroups() -> None:
    """The kubelet's cgroup root (/doeks) in every cgroup v1 hierarchy: the kubelet refuses a root that does not exist.
    A new cpuset cgroup has no CPUs or memory nodes until given its parent's."""
    root = Path("/sys/fs/cgroup")
    for hierarchy in sorted(root.iterdir()) if root.exists() else []:
        if not hierarchy.is_dir() or hierarchy.name == "unified" or not (hierarchy / "cgroup.procs").exists():
            continue
        mine = hierarchy / CGROUP_ROOT.strip("/")
        mine.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if (mine / name).exists() and not (mine / name).read_text().strip():
                (mine / name).write_text((hierarchy / name).read_text())


# -- up / down -------------------------------------------------------------------------------------------------------
def running() -> dict[str, int | None]:
    return {component: pid(component) for component in COMPONENTS}


def up(runner) -> Path:
    """Start every component that is not running (in order, each checked healthy), the guard first."""
    steps = ["install the network guard (iptables mangle POSTROUTING chain DOEKS-GUARD on the default interface)",
             f"make bridge {versions.BRIDGE} {versions.NODE_IP}/24, net.ipv4.ip_forward=1, bridge-nf-call-iptables=1",
             "write certificates and kubeconfigs, containerd/kubelet/kube-proxy configuration, CNI bridge config"]
    steps += [f"start {component}: {' '.join(argv_preview(component))}" for component in COMPONENTS]
    if runner.dry_run:
        for step in steps:
            runner.step(step, lambda: None)
        return versions.kubeconfig()
    missing_tools = host_tools_missing()
    if missing_tools:
        raise MissingTool(f"the cluster needs {', '.join(missing_tools)}: apt-get install {' '.join(missing_tools)} "
                          "(invoke setup --kubernetes installs them)")
    missing_bins = build.missing()
    if missing_bins:
        raise MissingTool(f"{', '.join(missing_bins)} not built: run `invoke setup --kubernetes` first")
    started = time.monotonic()
    interface = guard.install()
    ui.say(f"network guard on {interface}: private ranges and the pod range cannot leave by it")
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
    ui.say(f"cluster components up in {time.monotonic() - started:.0f}s")
    return versions.kubeconfig()


def argv_preview(component: str) -> list[str]:
    try:
        return argv(component)
    except MissingTool:
        return [component, "(not built yet)"]


def ctr(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(["ctr", "--address", str(CONTAINERD_SOCKET), "--namespace", "k8s.io", *args],
                          capture_output=True, text=True, check=check)


def _netns_of_containers() -> set[str]:
    """The network namespaces containerd's pod sandboxes use (their bind mounts under /run/netns)."""
    found: set[str] = set()
    for cid in ctr("containers", "list", "-q").stdout.split():
        info = ctr("containers", "info", cid)
        try:
            spec = json.loads(info.stdout).get("Spec", {})
        except ValueError:
            continue
        for ns in spec.get("linux", {}).get("namespaces", []):
            if ns.get("type") == "network" and ns.get("path"):
                found.add(ns["path"])
    return found


def _remove_containers() -> set[str]:
    """Kill and remove every container and sandbox in containerd's k8s.io namespace; their netns paths."""
    if not pid("containerd"):
        return set()
    netns = _netns_of_containers()
    for task in ctr("tasks", "list", "-q").stdout.split():
        ctr("tasks", "kill", "-s", "SIGKILL", task)
    deadline = time.monotonic() + 20
    for task in ctr("tasks", "list", "-q").stdout.split():
        while time.monotonic() < deadline and ctr("tasks", "delete", task).returncode != 0:
            time.sleep(0.3)
    for cid in ctr("containers", "list", "-q").stdout.split():
        ctr("containers", "delete", cid)
    return netns


def mounts_under(*roots: Path) -> list[str]:
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if any(point == str(r) or point.startswith(str(r) + "/") for r in roots):
            out.append(point)
    return sorted(out, key=len, reverse=True)


def _cgroups() -> list[Path]:
    root = Path("/sys/fs/cgroup")
    return [p for p in (root.glob(f"*{CGROUP_ROOT}") if root.exists() else []) if p.is_dir()]


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


def _shims() -> list[str]:
    """Pids of the containerd shims of this node's containerd (they outlive it when it is killed)."""
    found = subprocess.run(["pgrep", "-f", f"containerd-shim.*{CONTAINERD_SOCKET}"], capture_output=True, text=True)
    return found.stdout.split()


def _mounts() -> list[str]:
    """What the node mounted: under its run folder, its state folder and containerd's root."""
    return mounts_under(RUN_DIR, d(), versions.cache_dir() / "containerd")


def leftovers() -> dict[str, list[str]]:
    """What a stopped cluster must not leave: processes, mounts, network namespaces, iptables chains, the bridge,
    cgroups. Empty lists when down is complete."""
    processes = [f"{component} (pid {value})" for component, value in running().items() if value]
    processes += [f"containerd-shim (pid {p})" for p in _shims()]
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
    return {"processes": processes, "mounts": _mounts(),
            "network namespaces": sorted(set(namespaces) | {n for n in ours if Path(n).exists()}),
            "iptables chains": chains, "bridge": [versions.BRIDGE] if bridge_exists() else [],
            "cgroups": [str(p) for p in _cgroups()]}


def down(runner, keep_state: bool = False) -> bool:
    """Stop everything `up` started and remove what it made; True if anything was running. Safe to run twice."""
    if runner.dry_run:
        for what in ["stop kube-proxy and remove its iptables rules (kube-proxy --cleanup)",
                     "stop kubelet, kube-scheduler, kube-controller-manager",
                     "kill and remove every pod container in containerd; delete their network namespaces",
                     "stop containerd, kube-apiserver, etcd; unmount what they mounted",
                     f"remove cgroups under {CGROUP_ROOT}, bridge {versions.BRIDGE}, the network guard",
                     f"remove {d()} (certificates, etcd data, logs)"]:
            runner.step(what, lambda: None)
        return False
    was_running = any(running().values())
    if not d().exists() and not was_running and not bridge_exists() and not guard.installed():
        return False
    ui.say("stopping doeks' cluster")
    stop("kube-proxy")
    if (versions.bin_dir() / "doeks-node").exists():
        subprocess.run([_bin("doeks-node"), "kube-proxy", "--cleanup"], capture_output=True, text=True)
    for component in ("kubelet", "kube-scheduler", "kube-controller-manager"):
        stop(component)
    netns = _remove_containers()
    stop("containerd")
    for shim in _shims():
        try:
            os.kill(int(shim), signal.SIGKILL)
        except ProcessLookupError:
            pass
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

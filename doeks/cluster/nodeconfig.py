"""Each node component's configuration and command line (containerd, CNI, kubelet, kube-proxy, etcd, the API server,
controller manager, scheduler), written as kind writes a node's and hack/local-up-cluster.sh starts its components."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from . import pki, versions
from .nodedef import CNI_BIN, NODE0, Node, bin_path, d


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
    binary = bin_path("doeks-node")
    if component == "containerd":
        return [shutil.which("containerd") or "/usr/bin/containerd", "--config", str(c / "containerd.toml")]
    if component == "etcd":
        peer = f"http://127.0.0.1:{versions.ETCD_PEER_PORT}"
        client = f"http://127.0.0.1:{versions.ETCD_CLIENT_PORT}"
        return [bin_path("etcd"), "--name", "doeks", "--data-dir", str(c / "etcd"), "--listen-client-urls", client,
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
        return [bin_path("doeks-node"), "kubelet", f"--config={folder / 'kubelet.yaml'}",
                f"--kubeconfig={folder / 'kubelet.kubeconfig'}", f"--hostname-override={node.name}",
                f"--node-ip={node.ip}", f"--root-dir={folder / 'kubelet'}", "--v=1"]
    if component == "kube-proxy":
        return [bin_path("doeks-node"), "kube-proxy", f"--config={folder / 'kube-proxy.yaml'}", "--v=1"]
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

"""What doeks' own single-node cluster runs, each at a pinned version, and where its builds and state live.

Kubernetes 1.35: the newest minor this machine's cgroups allow together with Debian bookworm's containerd.
- EKS support (2026-11-23): 1.34 leaves standard support on 2026-12-02, 1.35 stays in it until 2027-03-27.
- The hosts doeks is built on use cgroup v1. Since 1.35 the kubelet refuses cgroup v1 unless `failCgroupV1: false`
  (KEP-5573), which 1.35 still honours.
- 1.35 is the last minor that supports containerd 1.x (Debian bookworm ships 1.6 with runc 1.1 and the CNI plugins);
  1.36 needs containerd 2.
The component versions follow what Kubernetes 1.35 itself pins (cmd/kubeadm/app/constants): etcd 3.6 (kubeadm's
default 3.6.6; the newest 3.6 patch the Go proxy serves is used), pause 3.10.1. CoreDNS: kubeadm names v1.13.1, which
the Go module proxy does not serve as a module; v1.14.7 is the newest 1.14 it serves.
"""
from __future__ import annotations

from pathlib import Path

from ..cachedirs import cache_dir, cluster_dir, kubeconfig  # noqa: F401 (the cluster's code reads them here)

KUBERNETES = "1.35.4"
ETCD = "3.6.16"
COREDNS = "1.14.7"
PAUSE = "3.10.1"

# Images the cluster itself names (the kubelet's sandbox, the DNS Deployment): built here, imported under these names.
PAUSE_IMAGE = f"registry.k8s.io/pause:{PAUSE}"
COREDNS_IMAGE = f"registry.k8s.io/coredns/coredns:v{COREDNS}"
# What Kubeflow Trainer v2.3.0's torch-distributed runtime names (manifests/base/runtimes/torch_distributed.yaml): made
# here from doeks' CPU torch base, whose torch is the same 2.13.0 (doeks.cluster.runtimes).
TORCH_RUNTIME_IMAGE = "pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime"

# Addresses: all private, all on this machine (the bridge doeks makes), guarded from leaving by the default route.
BRIDGE = "doeks0"


def bridge_mac(index: int = 0) -> str:
    """A bridge's own, fixed MAC address (locally administered: 02:..., "doek" then the node's index): doeks0's for
    node 0, an extra node's cni0 inside its namespace for the others. A Linux bridge left without one takes the lowest
    MAC of its ports and changes it as ports come and go (a pod's veth added or deleted): every neighbour that had
    resolved the gateway to the old one then sends into nothing until its ARP entry expires (up to a minute: a node's
    kubelet lost the API server 60 s right after `up`, its node NotReady, the job's pods placed on the others)."""
    return f"02:64:6f:65:6b:{index:02x}"


POD_CIDR = "10.244.0.0/24"
NODE_IP = "10.244.0.1"            # the bridge's own address: API server, kubelet and pods' gateway
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"
DNS_SERVICE_IP = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"
API_PORT = 6443
ETCD_CLIENT_PORT = 12379          # loopback only (not 2379: the local target's etcd may be there)
ETCD_PEER_PORT = 12380
NODE_NAME = "doeks"
# More nodes (KUBE_NODES=N), as kind runs them: node i >= 1 is a network namespace of its own joined to the bridge by a
# veth pair, at NODE_NET's address i, with its own containerd, kubelet and kube-proxy and the pod range 10.244.i.0/24
# on a bridge inside it; the host routes each node's pod range to the node. Everything stays inside CLUSTER_CIDR,
# which the guard keeps from leaving by the default interface.
CLUSTER_CIDR = "10.244.0.0/16"    # every node's pods and the extra nodes' own addresses
NODE_NET = "10.244.255.0/24"      # the extra nodes' addresses on the bridge (node i: 10.244.255.i)
NODE_NET_GATEWAY = "10.244.255.254"  # the host's address on it: the extra nodes' default route
MAX_NODES = 16
# The extra nodes are for the training jobs' pods, as an EKS GPU node group is (tainted nvidia.com/gpu there): they
# register with this taint, which doeks' job pods tolerate on doeks' cluster (KubernetesTarget.placement), so the
# cluster's own services (CoreDNS, the operators, a job's etcd) stay on node `doeks`, and losing an extra node takes
# only what a training job can do without (one of its replicas).
WORKER_TAINT = {"key": "doeks/training", "value": "true", "effect": "NoSchedule"}


def node_name(index: int) -> str:
    return NODE_NAME if index == 0 else f"{NODE_NAME}-{index}"


def node_ip(index: int) -> str:
    return NODE_IP if index == 0 else f"10.244.255.{index}"


def pod_cidr(index: int) -> str:
    return f"10.244.{index}.0/24"


NODE_NETNS_PREFIX = "doeks-node-"


def node_netns(index: int) -> str | None:
    """The network namespace of an extra node (/run/netns/<name>); node 0 runs in the host's."""
    return None if index == 0 else f"{NODE_NETNS_PREFIX}{index}"


def build_dir() -> Path:
    return cache_dir() / f"kubernetes-v{KUBERNETES}"


def bin_dir() -> Path:
    return build_dir() / "bin"

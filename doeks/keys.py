"""Every `.env` key doeks reads, declared once: its unit, default, help and the parser that checks a value and says
what is accepted (`KEYS`; `.env` documents the same keys and a test keeps them in step). TARGET's values come from the
table of targets here (BUILTIN_TARGETS, or DOEKS_TARGETS for one of yours)."""
from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from . import catalog as _catalog
from .errors import SettingsError

# TARGET -> (module, class): the places to run doeks ships, in the order docs list them. The EKS rehearsal is the eks
# target's variant (EKS_REHEARSAL, doeks.targets.get), not a TARGET of its own.
BUILTIN_TARGETS = {
    "local": ("doeks.targets.local", "LocalTarget"),
    "docker": ("doeks.targets.docker", "DockerTarget"),
    "kubernetes": ("doeks.targets.kubernetes", "KubernetesTarget"),
    "eks": ("doeks.targets.eks", "EksTarget"),
    "sagemaker": ("doeks.targets.sagemaker", "SageMakerTarget"),
}
REHEARSAL_TARGET = ("doeks.targets.rehearsal", "RehearsalTarget")
TARGETS = tuple(BUILTIN_TARGETS)
TARGETS_ENV = "DOEKS_TARGETS"  # importable modules that each define a target class of one's own (comma-separated)


def target_classes() -> dict[str, tuple[str, str]]:
    """TARGET name -> (module, class): the built-in table, then each module named in DOEKS_TARGETS (a place to run of
    your own: one importable file; its Target subclasses with a `name`), without importing the built-in ones."""
    import importlib

    found = dict(BUILTIN_TARGETS)
    for module_name in filter(None, (m.strip() for m in os.environ.get(TARGETS_ENV, "").split(","))):
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise SettingsError(f"{TARGETS_ENV}={module_name!r}: cannot import it ({error})") from None
        for cls in vars(module).values():  # doeks.targets.base.Target's subclasses (settings is below targets)
            if (isinstance(cls, type) and cls.__module__ == module.__name__ and isinstance(getattr(cls, "name", None), str)
                    and any(f"{b.__module__}.{b.__name__}" == "doeks.targets.base.Target" for b in cls.__mro__[1:])):
                found[cls.name] = (module.__name__, cls.__name__)
    return found


def target_names() -> tuple[str, ...]:
    """The TARGET values accepted: the built-in ones in their usual order, then any other found."""
    found = target_classes()
    return tuple(n for n in TARGETS if n in found) + tuple(sorted(n for n in found if n not in TARGETS))
RDZV_BACKENDS = ("etcd", "etcd-v2", "c10d")
ARCHES = ("resnet18", "resnet34", "resnet50", "efficientnet_b0", "efficientnet_b7", "mobilenet_v3_small")
EKS_VERSIONS = tuple(_catalog.EKS_SUPPORT)  # the calendar doeks knows; newer 1.NN are accepted, `invoke up` asks EKS
AMI_FAMILIES = ("AmazonLinux2023", "AmazonLinux2", "Bottlerocket", "Ubuntu2204", "Ubuntu2404")
VOLUME_TYPES = ("gp2", "gp3", "io1", "io2")
SECRET_WORDS = ("SECRET", "PASSWORD", "TOKEN")

_REGION = re.compile(r"^(us|eu|ap|sa|ca|me|af|il|mx|cn)(-gov|-iso|-isob)?-(north|south|east|west|central|northeast|northwest|southeast|southwest)-\d$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_CLUSTER_NAME = re.compile(r"^[a-zA-Z][-a-zA-Z0-9]{0,99}$")
_INSTANCE_TYPE = re.compile(r"^[a-z][a-z0-9-]*\.(nano|micro|small|medium|large|metal|\d*xlarge)(-\d+xl)?$")
_IMAGE_NAME = re.compile(r"^[a-z0-9]+([._-][a-z0-9]+)*(/[a-z0-9]+([._-][a-z0-9]+)*)*$")
_IMAGE_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_IMAGE_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")
_CAPACITY_RESERVATION = re.compile(r"^cr-[0-9a-f]{8,17}$")


@dataclass(frozen=True)
class Key:
    name: str
    unit: str
    default: str
    help: str
    parse: Callable[[str], Any]
    accepted: str

    @property
    def secret(self) -> bool:
        return any(word in self.name for word in SECRET_WORDS)


class BadValue(ValueError):
    """Raised by a parser; the message says what is accepted."""


def _choice(options):
    """One of `options` (a tuple, or a function giving it when a value is read, as the targets found then)."""
    def listed() -> tuple[str, ...]:
        return options() if callable(options) else options

    def parse(raw: str) -> str:  # read case-insensitively (TARGET=EKS is eks), given back as the option is spelled
        canonical = {option.lower(): option for option in listed()}.get(raw.lower())
        if canonical is None:
            raise BadValue(f"one of {', '.join(listed())}")
        return canonical

    return parse, f"one of {', '.join(TARGETS if callable(options) else options)}"


def _eks_version(raw: str) -> str:
    accepted = (f"a Kubernetes version EKS offers: {', '.join(EKS_VERSIONS)} or a newer 1.NN "
                f"(`invoke up` checks it with EKS)")
    if not re.fullmatch(r"1\.\d{2}", raw) or _catalog.version_key(raw) < _catalog.version_key(EKS_VERSIONS[0]):
        raise BadValue(accepted)
    return raw


_EKS_VERSION = (_eks_version, f"a Kubernetes version EKS offers: {', '.join(EKS_VERSIONS)} or a newer 1.NN")


def _int(low: int, high: int):
    def parse(raw: str) -> int:
        if not re.fullmatch(r"[+]?\d+", raw.strip()):
            raise BadValue(f"an integer from {low} to {high}")
        value = int(raw)
        if not low <= value <= high:
            raise BadValue(f"an integer from {low} to {high}")
        return value

    return parse, f"an integer from {low} to {high}"


def _auto_int(low: int, high: int):
    whole, accepted = _int(low, high)

    def parse(raw: str):
        return "auto" if raw.strip() == "auto" else whole(raw)

    return parse, f"auto or {accepted}"


def _float(low: float, high: float):
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise BadValue(f"a number from {low} to {high}") from None
        if not (low <= value <= high):  # also rejects nan
            raise BadValue(f"a number from {low} to {high}")
        return value

    return parse, f"a number from {low} to {high}"


def _bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise BadValue("true or false")


def _pattern(regex: re.Pattern, accepted: str, optional: bool = False):
    def parse(raw: str) -> str:
        if optional and raw == "":
            return ""
        if not regex.fullmatch(raw):
            raise BadValue(accepted)
        return raw

    return parse, accepted + (" (or empty)" if optional else "")


def _dns_label(max_len: int = 63):
    accepted = f"a Kubernetes name: lower-case letters, digits and '-', starting and ending alphanumeric, at most {max_len} characters"

    def parse(raw: str) -> str:
        if len(raw) > max_len or not _DNS1123_LABEL.fullmatch(raw):
            raise BadValue(accepted)
        return raw

    return parse, accepted


_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _dns1035_label(max_len: int, optional: bool = False):
    """A name that becomes Service and pod names (a PyTorchJob's `<name>-worker-<i>`, a TrainJob's JobSet
    `<name>-node-0-<i>`): DNS-1035, a letter first, short enough for what the operators append (63 in all)."""
    accepted = (f"a Kubernetes DNS-1035 name: a lower-case letter first, then lower-case letters, digits and '-', "
                f"ending alphanumeric, at most {max_len} characters" + (", or empty" if optional else ""))

    def parse(raw: str) -> str:
        if optional and not raw:
            return raw
        if len(raw) > max_len or not _DNS1035_LABEL.fullmatch(raw):
            raise BadValue(accepted)
        return raw

    return parse, accepted


def _cidr(raw: str) -> str:
    try:
        net = ipaddress.IPv4Network(raw, strict=True)
    except ValueError:
        raise BadValue("an IPv4 network in CIDR form with a prefix of /16 to /24, e.g. 192.168.0.0/16") from None
    if not 16 <= net.prefixlen <= 24 or "/" not in raw:
        raise BadValue("an IPv4 network in CIDR form with a prefix of /16 to /24, e.g. 192.168.0.0/16")
    return str(net)


def _url(raw: str) -> str:
    if raw == "":
        return ""
    if not re.fullmatch(r"https?://[A-Za-z0-9.\-\[\]:]+(:\d{1,5})?/?", raw):
        raise BadValue("empty (real AWS) or an http(s)://host:port URL")
    return raw.rstrip("/")


def _zones(raw: str) -> tuple[str, ...]:
    if raw == "":
        return ()
    zones = tuple(z.strip() for z in raw.split(","))
    if any(not re.fullmatch(r"[a-z]{2}(-gov)?-[a-z]+-\d[a-z]", z) for z in zones) or len(set(zones)) != len(zones):
        raise BadValue("empty (eksctl picks) or distinct availability zones separated by commas, e.g. us-west-2a,us-west-2b")
    return zones


def _path(optional: bool = True):
    def parse(raw: str) -> str:
        if "\x00" in raw or "\n" in raw:
            raise BadValue("a file system path")
        return raw

    return parse, "a file system path" + (" (or empty)" if optional else "")


def _store_uri(raw: str) -> str:
    """s3://bucket/prefix or an absolute folder (or empty): where checkpoints and models go."""
    if raw == "":
        return ""
    if raw.startswith("s3://"):
        if not re.fullmatch(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[A-Za-z0-9!_.*'()/-]*)?", raw):
            raise BadValue("empty, s3://bucket/prefix (a bucket name of 3-63 lower-case letters, digits, '.', '-') or an absolute folder")
        return raw.rstrip("/")
    if not raw.startswith("/") or "\x00" in raw or "\n" in raw or "://" in raw:
        raise BadValue("empty, s3://bucket/prefix or an absolute folder")
    return raw.rstrip("/") or "/"


_STORE_URI = (_store_uri, "empty, s3://bucket/prefix or an absolute folder")


def _memory(raw: str) -> str:
    """A Kubernetes memory quantity with a binary or decimal suffix (512Mi, 16Gi, 2G), or empty."""
    if raw and not re.fullmatch(r"[1-9]\d*(Ki|Mi|Gi|Ti|K|M|G|T)", raw):
        raise BadValue("a memory size such as 512Mi or 16Gi (or empty)")
    return raw


_MEMORY = (_memory, "a memory size such as 512Mi or 16Gi (or empty)")


def _quantity(raw: str) -> str:
    """A CPU quantity as Kubernetes writes one: whole CPUs (64) or millicores (500m)."""
    if not re.fullmatch(r"[1-9]\d{0,6}m?|0", raw):
        raise BadValue("a number of CPUs such as 64, or millicores such as 500m")
    return raw


_QUANTITY = (_quantity, "a number of CPUs such as 64, or millicores such as 500m")


def _or_auto(kind):
    """`kind`, or auto (doeks.kueue.Flavor.quotas: what the node group's nodes have)."""
    parse, accepted = kind

    def either(raw: str):
        return "auto" if raw.strip() == "auto" else parse(raw)

    return either, f"auto or {accepted}"


def _memory_quota(raw: str) -> str:
    if not re.fullmatch(r"[1-9]\d*(Ki|Mi|Gi|Ti|K|M|G|T)|0", raw):
        raise BadValue("a memory size such as 512Mi or 16Ti")
    return raw


_MEMORY_QUOTA = (_memory_quota, "a memory size such as 512Mi or 16Ti")


def _topology(raw: str) -> str:
    if raw.lower() not in ("", "required", "preferred"):
        raise BadValue("empty, required or preferred")
    return raw.lower()


_TOPOLOGY = (_topology, "empty, required or preferred")


def _text(raw: str) -> str:
    if "\n" in raw or "\x00" in raw:
        raise BadValue("one line of text")
    return raw


def _registry(raw: str) -> str:
    if raw in ("", "default"):
        return raw
    if not re.fullmatch(r"[A-Za-z0-9.-]+(:\d+)?(/[a-z0-9._/-]+)?", raw):
        raise BadValue("empty (local only), 'default' (the account's ECR) or a registry host such as 123.dkr.ecr.us-west-2.amazonaws.com")
    return raw


def _labels(raw: str) -> dict[str, str]:
    if raw == "":
        return {}
    labels = {}
    for item in raw.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or not re.fullmatch(r"([a-z0-9.-]+/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", key) or not re.fullmatch(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?", value):
            raise BadValue("empty or comma-separated Kubernetes labels key=value")
        labels[key] = value
    return labels


def _key(name, unit, default, help, parser) -> Key:
    parse, accepted = parser if isinstance(parser, tuple) else (parser, "")
    if not accepted:
        accepted = {_bool: "true or false", _cidr: "an IPv4 CIDR /16../24", _url: "empty or an http(s)://host:port URL",
                    _zones: "empty or comma-separated availability zones", _text: "one line of text",
                    _registry: "empty, 'default' or a registry host", _labels: "comma-separated key=value labels"}.get(parse, "")
    return Key(name, unit, default, help, parse, accepted)


KEYS: tuple[Key, ...] = (
    # core
    _key("TARGET", "core", "local", "Where jobs run: local (processes on this machine), docker (containers of the training image on this machine), kubernetes (the cluster in KUBECONFIG, or doeks' own on this machine), eks (the EKS cluster) or sagemaker (or a target of your own: DOEKS_TARGETS)", _choice(target_names)),
    _key("AWS_REGION", "core", "us-west-2", "AWS region for every AWS call", _pattern(_REGION, "an AWS region name such as us-west-2")),
    _key("AWS_PROFILE", "core", "", "Named profile from ~/.aws to use (empty = default credentials chain)", _text),
    _key("AWS_ENDPOINT_URL", "core", "", "AWS-API endpoint for every boto3 client (empty = real AWS; on TARGET=local the toolkit's moto server)", _url),
    _key("STATE_DIR", "core", ".doeks", "Folder for local state: etcd data, moto server, job logs, volumes (relative to the project)", _path(False)),
    # management container
    _key("IMAGE_NAME", "container", "doeks", "Management container image name", _pattern(_IMAGE_NAME, "a docker image name: lower-case letters, digits, '.', '_', '-', '/'")),
    _key("IMAGE_TAG", "container", "latest", "Management container image tag", _pattern(_IMAGE_TAG, "a docker tag: letters, digits, '_', '.', '-', at most 128")),
    _key("DOEKS_CONTAINER_NAME", "container", "doeks", "Name of the running management container (not CONTAINER_NAME, which shells often set)", _pattern(re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]*"), "letters, digits, '_', '.', '-'")),
    _key("REGISTRY", "container", "", "Where push/pull go: empty = local only, 'default' = this account's ECR, or a registry host", _registry),
    _key("BASE_IMAGE", "container", "debian:bookworm-slim", "Base image of the management container (build arg)", _pattern(_IMAGE_REF, "an image reference")),
    _key("CONTAINER_DOWNLOADS", "container", "true", "Download aws cli, eksctl, kubectl, helm, kubectx during the build (false = offline build)", _bool),
    # eks
    # kubernetes (TARGET=kubernetes: any conformant cluster, or doeks' own single-node cluster on this machine)
    _key("KUBECONFIG", "kubernetes", "", "Kubeconfig of the cluster TARGET=kubernetes uses (empty = doeks' own single-node cluster, started by `invoke up`)", _path(True)),
    _key("KUBE_CONTEXT", "kubernetes", "", "Context in KUBECONFIG to use (empty = its current context)", _text),
    _key("STORAGE_CLASS", "kubernetes", "", "StorageClass of SHARED_PVC on TARGET=kubernetes (empty = on doeks' cluster a volume in a folder of this machine; elsewhere the cluster's default class)", _text),
    _key("KUBE_GPUS", "kubernetes", "0", "nvidia.com/gpu each training pod asks for on TARGET=kubernetes (0 = train on CPU)", _int(0, 64)),
    _key("KUBE_NODES", "kubernetes", "1", "Nodes of doeks' own cluster (TARGET=kubernetes, KUBECONFIG empty; and the EKS rehearsal, where node doeks is then the sys node group's and each more a GPU node group's, tainted as EKS' are): 1 = the host's; each more is a kubelet with its own containerd, network namespace and pod range on the same bridge, as kind runs nodes (`invoke cluster.node-stop NAME` loses one)", _int(1, 16)),
    _key("KUBE_MEMORY", "kubernetes", "", "Memory limit of each training pod on TARGET=kubernetes, also its request (empty = no limit); a pod over it is OOM-killed", _MEMORY),
    _key("KUBE_SIM_NODES", "kubernetes", "0", "Simulated nodes added to doeks' own cluster (kwok: nodes and pods that exist only in the API server), labelled and sized as EKS labels a KUBE_SIM_NODE_TYPE node; tainted so only jobs that tolerate them go there (0 = none; `down` removes them)", _int(0, 1000)),
    _key("KUBE_SIM_NODE_TYPE", "kubernetes", "", "Instance type of the simulated nodes: its GPUs, EFA adapters, CPUs and memory, and EKS' labels (empty = GPU_INSTANCE_TYPE)", _pattern(_INSTANCE_TYPE, "an EC2 instance type such as p5.48xlarge", optional=True)),
    _key("CLUSTER_NAME", "eks", "doeks", "EKS cluster name", _pattern(_CLUSTER_NAME, "a cluster name: a letter, then letters, digits and '-', at most 100")),
    _key("EKS_VERSION", "eks", "1.35", "Kubernetes version of the cluster (default: the newest in EKS standard support; older ones cost 6x in extended support)", _EKS_VERSION),
    _key("EKS_ZONES", "eks", "", "Availability zones for the cluster (empty = eksctl picks)", _zones),
    _key("VPC_CIDR", "eks", "192.168.0.0/16", "CIDR of the cluster VPC", _cidr),
    _key("EKS_YAML", "eks", "", "Path of a hand-written eksctl ClusterConfig to use as-is instead of rendering one (empty = render)", _path()),
    _key("AMI_FAMILY", "eks", "AmazonLinux2023", "AMI family of the node groups", _choice(AMI_FAMILIES)),
    _key("NODE_VOLUME_SIZE", "eks", "200", "Root volume size of each node in GiB", _int(20, 16384)),
    _key("NODE_VOLUME_TYPE", "eks", "gp3", "Root volume type of each node", _choice(VOLUME_TYPES)),
    _key("NODE_VOLUME_ENCRYPTED", "eks", "true", "Encrypt node root volumes", _bool),
    _key("NODE_PRIVATE_NETWORKING", "eks", "true", "Put nodes in private subnets", _bool),
    _key("SYSTEM_INSTANCE_TYPE", "eks", "c5.2xlarge", "Instance type of the system node group", _pattern(_INSTANCE_TYPE, "an EC2 instance type such as c5.2xlarge")),
    _key("SYSTEM_NODES_MIN", "eks", "1", "System node group minimum size", _int(0, 100)),
    _key("SYSTEM_NODES", "eks", "1", "System node group desired size", _int(0, 100)),
    _key("SYSTEM_NODES_MAX", "eks", "3", "System node group maximum size", _int(1, 100)),
    _key("CPU_INSTANCE_TYPE", "eks", "c5.4xlarge", "Instance type of the CPU node group", _pattern(_INSTANCE_TYPE, "an EC2 instance type such as c5.4xlarge")),
    _key("CPU_NODES_MIN", "eks", "0", "CPU node group minimum size", _int(0, 1000)),
    _key("CPU_NODES", "eks", "0", "CPU node group desired size (0 with min and max 0 = no CPU group)", _int(0, 1000)),
    _key("CPU_NODES_MAX", "eks", "2", "CPU node group maximum size", _int(0, 1000)),
    _key("GPU_INSTANCE_TYPE", "eks", "p4d.24xlarge", "Instance type of the GPU node group", _pattern(_INSTANCE_TYPE, "an EC2 instance type such as p4d.24xlarge")),
    _key("GPU_NODES_MIN", "eks", "0", "GPU node group minimum size", _int(0, 1000)),
    _key("GPU_NODES", "eks", "0", "GPU nodes `up` starts (0 = none: a job's deploy grows the GPU node group to its REPLICAS, at most GPU_NODES_MAX, so GPU nodes bill only once a job needs them)", _int(0, 1000)),
    _key("GPU_NODES_MAX", "eks", "4", "GPU node group maximum size", _int(0, 1000)),
    _key("GPU_EFA", "eks", "true", "Enable EFA on the GPU node group (only for EFA-capable instance types)", _bool),
    _key("EKS_REHEARSAL", "eks", "false", "With TARGET=eks: rehearse on this machine (doeks' own cluster as the EKS cluster, its moto server with IAM enforced as AWS, a registry built here as ECR; docs/testing.md)", _bool),
    _key("EFA_PER_NODE", "eks", "auto", "EFA interfaces each GPU pod asks for (auto = all of a GPU_INSTANCE_TYPE node's, as EC2's DescribeInstanceTypes says; 0 with GPU_EFA=false)", _auto_int(0, 64)),
    _key("GPU_SPOT", "eks", "false", "Use spot capacity for the GPU node group", _bool),
    _key("PLACEMENT_GROUP", "eks", "", "Existing cluster placement group for the GPU nodes (empty = none)", _text),
    _key("CAPACITY_RESERVATION_ID", "eks", "", "EC2 capacity reservation for the GPU nodes (empty = none)", _pattern(_CAPACITY_RESERVATION, "cr- and 8 to 17 hex digits", optional=True)),
    # elastic job
    _key("JOB_NAME", "elasticjob", "", "Name of the training job: its pods (<name>-worker-<i>), runs, checkpoints, metrics and model folders (empty = from the code: imagenet for the built-in workload, else the script's name, or its folder's for train.py/main.py)", _dns1035_label(50, optional=True)),
    _key("NAMESPACE", "elasticjob", "default", "Kubernetes namespace for jobs", _dns_label(63)),
    _key("REPLICAS", "elasticjob", "2", "Number of nodes (worker replicas) to start with", _int(1, 1000)),
    _key("MIN_REPLICAS", "elasticjob", "1", "Fewest nodes the job keeps training with", _int(1, 1000)),
    _key("MAX_REPLICAS", "elasticjob", "3", "Most nodes the job can grow to", _int(1, 1000)),
    _key("NPROC_PER_NODE", "elasticjob", "auto", "Processes per node (auto = on eks the GPUs of a GPU_INSTANCE_TYPE node, as EC2's DescribeInstanceTypes says, e.g. 8 on p4d.24xlarge, 1 on g5.2xlarge; else 2)", _auto_int(1, 64)),
    _key("MAX_RESTARTS", "elasticjob", "10", "Restarts each node may take before the job fails: torchrun's restarts of its training processes and the node's own (a pod, a container, a local agent) together", _int(0, 1000)),
    _key("RDZV_BACKEND", "elasticjob", "etcd", "Rendezvous backend: etcd (an etcd server) or c10d (no extra server)", _choice(RDZV_BACKENDS)),
    _key("ETCD_ENDPOINT", "elasticjob", "", "External etcd (http://host:port, v2 API) for local rendezvous (empty = doeks starts its own)", _url),
    _key("ETCD_PORT", "elasticjob", "0", "Port of the local etcd doeks starts (0 = any free port)", _int(0, 65535)),
    _key("LOCAL_PRELOAD", "elasticjob", "true", "Local target: start workers as forks of a process that has already imported torch and torchvision (false = a fresh interpreter per worker, as plain torchrun)", _bool),
    _key("HANG_TIMEOUT", "elasticjob", "300", "Seconds without progress (a step, doeks.report) after which a replica's watchdog names the rank that holds the job, dumps its stacks and climbs the ladder below (0 = no watchdog; HyperPod's hang rule waits 300)", _int(0, 86400)),
    _key("HANG_PACE", "elasticjob", "10", "A rank that is stopped, or outside every collective while its peers wait in one, is taken as hung once its replica's newest progress is this many times the job's median step time old (at least 10 s, at most HANG_TIMEOUT); anything less certain waits HANG_TIMEOUT (0 = HANG_TIMEOUT alone)", _int(0, 1000)),
    _key("HANG_RESTARTS", "elasticjob", "1", "Watchdog rung 1: times a hung rank's processes are restarted before its pod is replaced", _int(0, 100)),
    _key("HANG_REPLACEMENTS", "elasticjob", "1", "Watchdog rung 2: times a hung replica's pod is replaced (local: its node restarted; docker: its container) before rung 3", _int(0, 100)),
    _key("HANG_MOVES", "elasticjob", "1", "Watchdog rung 3 (Kubernetes, with another node): times a hung replica's node is cordoned and its pod replaced elsewhere before rung 4", _int(0, 100)),
    _key("HANG_JOB_RESTARTS", "elasticjob", "1", "Watchdog rung 4: times the whole job is restarted from its checkpoint (every pod replaced; local: every node) before the watchdog gives up", _int(0, 100)),
    _key("NODE_LOST_TIMEOUT", "elasticjob", "60", "Seconds a fixed-size job's pod (a TrainJob) stays bound to a node that stopped answering (NotReady) before it is evicted and made again on a node that answers (Kubernetes' default toleration: 300)", _int(0, 86400)),
    _key("ARCH", "elasticjob", "resnet18", "torchvision model to train", _choice(ARCHES)),
    _key("EPOCHS", "elasticjob", "4", "Training epochs", _int(1, 10000)),
    _key("BATCH_SIZE", "elasticjob", "16", "Batch size per process", _int(1, 4096)),
    _key("LEARNING_RATE", "elasticjob", "0.1", "Peak learning rate for a global batch of 256, scaled linearly with the global batch (also after an elastic resize); linear warmup then cosine decay (SGD, nesterov)", _float(1e-6, 10.0)),
    _key("CROP_SIZE", "elasticjob", "0", "Training crop / val center-crop side in pixels (0 = 224 where GPUs train: eks, SageMaker; 32 where this machine trains: local, docker, SageMaker local mode, so the demo takes about a minute)", _int(0, 1024)),
    _key("CHECKPOINT_EVERY", "elasticjob", "10", "Write a checkpoint every N optimizer steps", _int(1, 1000000)),
    _key("CHECKPOINT_WHEN_BUSY", "elasticjob", "wait", "A periodic checkpoint due while the last one is still being written: wait (the step stalls until that write ends: a checkpoint every CHECKPOINT_EVERY steps, always) or skip (training goes on and the next due one is taken: no stall where storage is slower than CHECKPOINT_EVERY, said once in the log and counted at the end)", _choice(("wait", "skip"))),
    _key("CHECKPOINT_URI", "elasticjob", "", "Where the job's checkpoints go, under <it>/<JOB_NAME>/step-N/ (PyTorch Distributed Checkpoint, `latest` written last): s3://bucket/prefix, or a folder the training processes see (empty = the shared volume's checkpoints/<JOB_NAME>; eks: s3://S3_BUCKET/doeks/checkpoints, since `down` deletes its volume; SageMaker: its checkpoint channel, synced to s3://S3_BUCKET/doeks/<JOB_NAME>/checkpoints). On local and docker s3:// is doeks' moto server (or AWS_ENDPOINT_URL)", _STORE_URI),
    _key("KEEP_CHECKPOINTS", "elasticjob", "3", "Complete checkpoints kept per job (older ones are removed once a newer one is complete)", _int(1, 1000)),
    _key("MODEL_URI", "elasticjob", "", "Where the final model goes when the job ends, as <it>/<JOB_NAME>/model.pt: s3://bucket/prefix, or a folder the training processes see (empty = the shared volume's models/<JOB_NAME>; eks: s3://S3_BUCKET/doeks/models, since `down` deletes its volume; SageMaker: model.tar.gz in its output path)", _STORE_URI),
    _key("DATA_WORKERS", "elasticjob", "auto", "DataLoader worker processes per training process (auto = the node's CPUs / processes per node - 1, at most 16)", _pattern(re.compile(r"auto|[0-9]|[1-5][0-9]|6[0-4]"), "auto or an integer from 0 to 64")),
    _key("DATA_CLASSES", "elasticjob", "4", "Classes (WordNet-id folders) in the generated ImageNet-shaped data set", _int(2, 1000)),
    _key("DATA_TRAIN_PER_CLASS", "elasticjob", "400", "Generated training images per class", _int(1, 100000)),
    _key("DATA_VAL_PER_CLASS", "elasticjob", "50", "Generated validation images per class", _int(1, 100000)),
    _key("DATA_IMAGE_SIZE", "elasticjob", "48", "Typical short side of generated images in pixels (each is 0.75-1.5x that, aspect ratio up to 5:3)", _int(16, 512)),
    # the job's code (doeks.code): empty TRAIN_SCRIPT = doeks' own ImageNet workload (doeks/workload/train.py)
    _key("TRAIN_SCRIPT", "elasticjob", "", "Your training script: a .py file, or -m package.module (empty = doeks' built-in ImageNet workload); relative paths are relative to the project", _text),
    _key("TRAIN_SOURCE", "elasticjob", "", "Folder of your code, copied into the training image and run from (empty = TRAIN_SCRIPT's folder; for -m: the project)", _path()),
    _key("TRAIN_ARGS", "elasticjob", "", "Arguments for your script, passed verbatim (shell-quoted; on SageMaker as hyperparameters, given back as --key value)", _text),
    _key("TRAIN_REQUIREMENTS", "elasticjob", "", "A pip requirements file installed into the training image with your code (empty = TRAIN_SOURCE/requirements.txt if there is one)", _path()),
    _key("TRAIN_IMAGE", "elasticjob", "", "Image of the training containers and pods (empty = the image `invoke elasticjob.build` makes: doeks-train:<content hash>, in REGISTRY or this account's ECR when it runs on a cluster)", _pattern(_IMAGE_REF, "an image reference", optional=True)),
    _key("TRAIN_BASE_IMAGE", "elasticjob", "", "Base of the training image (empty = by target: a CPU torch base made here for docker and SageMaker local mode; the AWS PyTorch training container with NCCL, EFA and aws-ofi-nccl for eks)", _pattern(_IMAGE_REF, "an image reference", optional=True)),
    _key("ETCD_IMAGE", "elasticjob", "quay.io/coreos/etcd:v3.4.35", "Pinned etcd image for the rendezvous server on EKS (v3.4: v2 API)", _pattern(_IMAGE_REF, "an image reference")),
    _key("SHARED_PVC", "elasticjob", "fsx-pvc", "PersistentVolumeClaim with data and checkpoints (EKS); a local folder under STATE_DIR on local", _dns_label(63)),
    _key("SHARED_MOUNT", "elasticjob", "/fsx-shared", "Where the shared volume is mounted in training pods", _pattern(re.compile(r"/[A-Za-z0-9._/-]*"), "an absolute path")),
    _key("NODE_LABELS", "elasticjob", "", "Extra node selector labels for training pods (key=value,...)", _labels),
    # csi (shared storage)
    _key("FSX_DEPLOYMENT_TYPE", "csi", "PERSISTENT_2", "FSx for Lustre deployment type", _choice(("PERSISTENT_2", "PERSISTENT_1", "SCRATCH_2"))),
    _key("FSX_STORAGE_CAPACITY", "csi", "1200", "FSx capacity in GiB (1200, 2400, then steps of 2400)", _int(1200, 524400)),
    _key("FSX_THROUGHPUT", "csi", "250", "FSx throughput per TiB (MB/s): PERSISTENT_2 125/250/500/1000, PERSISTENT_1 50/100/200", _int(0, 1000)),
    _key("FSX_COMPRESSION", "csi", "LZ4", "FSx data compression", _choice(("LZ4", "NONE"))),
    _key("FSX_SUBNET_ID", "csi", "", "Subnet for FSx (empty = the private subnet of the GPU nodes' AZ)", _pattern(re.compile(r"subnet-[0-9a-f]{8,17}"), "a subnet id such as subnet-0123456789abcdef0", optional=True)),
    _key("FSX_FILE_SYSTEM_ID", "csi", "", "Use this existing FSx file system (static PV) instead of provisioning one", _pattern(re.compile(r"fs-[0-9a-f]{8,17}"), "an FSx id such as fs-0123456789abcdef0", optional=True)),
    _key("FSX_IMPORT_PATH", "csi", "", "S3 path linked to FSx with a data repository association (empty = none)", _pattern(re.compile(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?"), "an s3://bucket/prefix path", optional=True)),
    _key("STAGE_THREADS", "csi", "64", "Parallel downloads when staging data from S3", _int(1, 512)),
    # sagemaker / kubeflow
    _key("S3_BUCKET", "sagemaker", "doeks-training", "S3 bucket for code, data, checkpoints and models", _pattern(re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"), "an S3 bucket name: 3-63 lower-case letters, digits, '.', '-'")),
    _key("DATA_S3_PREFIX", "sagemaker", "data/imagenet", "Prefix of the training data in S3_BUCKET (train/ and val/ under it)", _pattern(re.compile(r"[A-Za-z0-9!_.*'()/-]+"), "an S3 key prefix")),
    _key("SAGEMAKER_ROLE_NAME", "sagemaker", "", "IAM execution role for SageMaker training jobs (empty = doeks-sagemaker-execution-<AWS_REGION>: IAM is global, and the role's policy names the region's logs)", _pattern(re.compile(r"[\w+=,.@-]{1,64}"), "an IAM role name", optional=True)),
    _key("SAGEMAKER_IMAGE", "sagemaker", "", f"Training image (empty = the PyTorch Deep Learning Container pytorch-training:{_catalog.SAGEMAKER_DLC_TAG} in AWS_REGION's DLC registry: SageMaker pulls from its own region)", _pattern(_IMAGE_REF, "an image reference", optional=True)),
    _key("SAGEMAKER_INSTANCE_TYPE", "sagemaker", "ml.g5.12xlarge", "Instance type of SageMaker training", _pattern(re.compile(r"ml\.[a-z0-9]+\.[a-z0-9]+"), "a SageMaker instance type such as ml.g5.12xlarge")),
    _key("SAGEMAKER_INSTANCE_COUNT", "sagemaker", "2", "Instances in the SageMaker training job", _int(1, 100)),
    _key("SAGEMAKER_LOCAL", "sagemaker", "false", "TARGET=sagemaker: run the training job here, one container of the training image per instance, with SageMaker's contract (/opt/ml, SM_* environment, hyperparameters, model.tar.gz)", _bool),
    _key("SAGEMAKER_SPOT", "sagemaker", "false", "Use managed spot training (checkpoints in S3)", _bool),
    _key("SAGEMAKER_MAX_RUN", "sagemaker", "86400", "Longest a training job may run, seconds", _int(60, 2419200)),
    _key("SAGEMAKER_MAX_WAIT", "sagemaker", "172800", "Longest to wait for spot capacity plus run, seconds (>= SAGEMAKER_MAX_RUN)", _int(60, 2419200)),
    _key("SAGEMAKER_SUBNETS", "sagemaker", "", "Subnets for VPC training (needed with EFS data), comma-separated", _pattern(re.compile(r"(subnet-[0-9a-f]{8,17})(,subnet-[0-9a-f]{8,17})*"), "subnet ids separated by commas", optional=True)),
    _key("SAGEMAKER_SECURITY_GROUPS", "sagemaker", "", "Security groups for VPC training, comma-separated", _pattern(re.compile(r"(sg-[0-9a-f]{8,17})(,sg-[0-9a-f]{8,17})*"), "security group ids separated by commas", optional=True)),
    _key("EFS_FILE_SYSTEM_ID", "sagemaker", "", "Read training data from this EFS file system instead of S3 (needs SAGEMAKER_SUBNETS)", _pattern(re.compile(r"fs-[0-9a-f]{8,17}"), "an EFS id such as fs-0123456789abcdef0", optional=True)),
    _key("KFP_ENDPOINT", "kubeflow", "", "Kubeflow Pipelines API for kubeflow.pipeline.run: http://localhost:8080/pipeline through the Istio gateway (`invoke kubeflow.expose`, with KFP_SESSION_TOKEN) or http://localhost:8888 for a port-forwarded svc/ml-pipeline (with KFP_TOKEN)", _pattern(re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+(:\d{1,5})?(/[A-Za-z0-9._~/-]*)?"), "an http(s)://host:port URL with an optional path", optional=True)),
    _key("KFP_NAMESPACE", "kubeflow", "kubeflow-user-example-com", "Kubeflow profile namespace the pipeline runs in; its kubernetes branch creates the job there (the profile of user@example.com in the platform's example)", _dns_label()),
    _key("KFP_SERVICE_ACCOUNT", "kubeflow", "default-editor", "Service account of the pipeline's pods in KFP_NAMESPACE (multi-user KFP runs them as default-editor); kubeflow.pipeline.deploy gives it RBAC on PyTorchJobs/TrainJobs and a Pod Identity role for SageMaker", _dns_label()),
    _key("PIPELINE_JOB_KIND", "kubeflow", "trainjob", "What the pipeline's kubernetes branch submits: a Trainer v2 TrainJob or a fixed-size PyTorchJob (training operator v1)", _choice(("trainjob", "pytorchjob"))),
    # kueue (queues, quotas, topology)
    _key("QUEUE", "kueue", "", "Kueue LocalQueue the jobs go to (elasticjob.deploy, kubeflow.trainjob.submit, kubeflow.pytorchjob.submit): they carry the label kueue.x-k8s.io/queue-name and wait until Kueue admits all their pods at once (empty = no queue: they start at once); `invoke kueue.deploy` makes this queue (empty: one named doeks)", _pattern(_DNS1123_LABEL, "a Kubernetes name: lower-case letters, digits and '-'", optional=True)),
    _key("QUEUE_CPU", "kueue", "auto", "CPUs the queue's ClusterQueue may use on each node type (its nominal quota per ResourceFlavor; auto = on eks what GPU_NODES_MAX nodes of GPU_INSTANCE_TYPE have, as EC2's DescribeInstanceTypes says; elsewhere 1000)", _or_auto(_QUANTITY)),
    _key("QUEUE_MEMORY", "kueue", "auto", "Memory the queue's ClusterQueue may use on each node type (auto = on eks what GPU_NODES_MAX nodes of the type have; elsewhere 8Ti)", _or_auto(_MEMORY_QUOTA)),
    _key("QUEUE_GPUS", "kueue", "auto", "nvidia.com/gpu the queue's ClusterQueue may use on each node type that has GPUs (0 on one without; auto = on eks what GPU_NODES_MAX nodes of the type have; elsewhere 64)", _auto_int(0, 100000)),
    _key("QUEUE_EFA", "kueue", "auto", "vpc.amazonaws.com/efa adapters the queue's ClusterQueue may use on each node type that has EFA (0 on one without; auto = on eks what GPU_NODES_MAX nodes of the type have; elsewhere 256)", _auto_int(0, 100000)),
    _key("TOPOLOGY", "kueue", "", "Put all of a queued job's pods in one network block (EKS' topology.k8s.aws/network-node-layer-3): required (wait until one block has room) or preferred (one block when one has room; empty = anywhere)", _TOPOLOGY),
    # secrets (masked in every output)
    _key("AWS_ACCESS_KEY_ID", "secrets", "", "Access key id (empty = default credentials chain)", _text),
    _key("AWS_SECRET_ACCESS_KEY", "secrets", "", "Secret access key (masked in all output)", _text),
    _key("AWS_SESSION_TOKEN", "secrets", "", "Session token (masked in all output)", _text),
    _key("KFP_TOKEN", "secrets", "", "Bearer token for a multi-user Kubeflow Pipelines API, e.g. `kubectl -n KFP_NAMESPACE create token default-editor --audience=pipelines.kubeflow.org` (masked in all output)", _text),
    _key("KFP_SESSION_TOKEN", "secrets", "", "Value of the Kubeflow login cookie oauth2_proxy_kubeflow, for KFP through the Istio gateway (masked in all output)", _text),
    _key("KUBEFLOW_PASSWORD", "secrets", "", "Kubeflow dashboard password for user@example.com (empty = generated into STATE_DIR/kubeflow/password)", _text),
)

KEY_BY_NAME = {k.name: k for k in KEYS}

"""Facts about AWS that change with time or region, in one place: EKS's Kubernetes versions and their support
windows, and the accounts of the region-bound registries doeks pulls from (EKS add-on images, Deep Learning
Containers). Everything else derives its names from here; tests cover each region family.

Sources (read 2026-11): the EKS user guide's "Kubernetes versions on standard/extended support" (release calendar)
and "View Amazon container image registries for Amazon EKS add-ons"; aws/deep-learning-containers available_images.md.
"""
from __future__ import annotations

import datetime as _dt

# version: (end of standard support, end of extended support). Standard support lasts 14 months from EKS's release;
# extended support 12 months more at 6x the control-plane price. EKS stopped building AL2 AMIs with 1.33.
EKS_SUPPORT: dict[str, tuple[str, str]] = {
    "1.30": ("2025-07-23", "2026-07-23"),
    "1.31": ("2025-11-26", "2026-11-26"),
    "1.32": ("2026-03-23", "2027-03-23"),
    "1.33": ("2026-07-29", "2027-07-29"),
    "1.34": ("2026-12-02", "2027-12-02"),
    "1.35": ("2027-03-27", "2028-03-27"),
}
AL2_LAST_VERSION = "1.32"


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def standard_support(today: _dt.date | None = None) -> list[str]:
    """The versions in EKS standard support on `today`, oldest first (from the calendar above)."""
    today = today or _dt.date.today()
    return sorted((v for v, (end, _) in EKS_SUPPORT.items() if _dt.date.fromisoformat(end) > today), key=version_key)


def newest_standard(today: _dt.date | None = None) -> str:
    """The newest version in standard support (the calendar's newest when all are past it: refresh the calendar)."""
    return (standard_support(today) or [max(EKS_SUPPORT, key=version_key)])[-1]


def support_phase(version: str, today: _dt.date | None = None) -> str:
    """standard, extended, ended, or unknown (a version newer than the calendar: EKS says, at `up`)."""
    today = today or _dt.date.today()
    if version not in EKS_SUPPORT:
        return "unknown"
    standard, extended = (_dt.date.fromisoformat(d) for d in EKS_SUPPORT[version])
    return "standard" if today < standard else "extended" if today < extended else "ended"


# ---- region-bound registries -----------------------------------------------------------------------------------------
# EKS add-on images (aws-efa-k8s-device-plugin and the others EKS replicates): 602401143452 except these regions.
EKS_ADDON_ACCOUNT = "602401143452"
EKS_ADDON_ACCOUNTS = {
    "af-south-1": "877085696533", "ap-east-1": "800184023465", "ap-east-2": "533267051163",
    "ap-south-2": "900889452093", "ap-southeast-3": "296578399912", "ap-southeast-4": "491585149902",
    "ap-southeast-5": "151610086707", "ap-southeast-6": "333609536671", "ap-southeast-7": "121268973566",
    "ca-west-1": "761377655185", "cn-north-1": "918309763551", "cn-northwest-1": "961992271922",
    "eu-central-2": "900612956339", "eu-south-1": "590381155156", "eu-south-2": "455263428931",
    "il-central-1": "066635153087", "me-central-1": "759879836304", "me-south-1": "558608220178",
    "mx-central-1": "730335286997", "us-gov-east-1": "151742754352", "us-gov-west-1": "013241004608",
}
# AWS Deep Learning Containers: 763104351884 except these regions.
DLC_ACCOUNT = "763104351884"
DLC_ACCOUNTS = {
    "af-south-1": "626614931356", "ap-east-1": "871362719292", "ap-northeast-3": "364406365360",
    "ap-south-2": "772153158452", "ap-southeast-3": "907027046896", "ap-southeast-4": "457447274322",
    "ap-southeast-5": "550225433462", "ap-southeast-7": "590183813437", "ca-west-1": "204538143572",
    "eu-central-2": "380420809688", "eu-south-1": "692866216735", "eu-south-2": "503227376785",
    "il-central-1": "780543022126", "me-central-1": "914824155844", "me-south-1": "217643126080",
    "mx-central-1": "637423239942", "cn-north-1": "727897471807", "cn-northwest-1": "727897471807",
    "us-gov-east-1": "446045086412", "us-gov-west-1": "442386744353",
}
# The same DLC images, published without a login in the public ECR gallery (same repository names and tags).
DLC_PUBLIC = "public.ecr.aws/deep-learning-containers"


def ecr_host(account: str, region: str) -> str:
    suffix = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    return f"{account}.dkr.ecr.{region}.{suffix}"


def eks_addon_registry(region: str) -> str:
    return ecr_host(EKS_ADDON_ACCOUNTS.get(region, EKS_ADDON_ACCOUNT), region)


def dlc_registry(region: str) -> str:
    return ecr_host(DLC_ACCOUNTS.get(region, DLC_ACCOUNT), region)


# The PyTorch training DLC for SageMaker that SAGEMAKER_IMAGE defaults to (in AWS_REGION's DLC registry).
# Source: aws/deep-learning-containers pytorch/training/buildspec-2-9-sm.yml (the CUDA 13 family of the EKS image's
# DLC, doeks.trainimage.DLC_TAG): the job's sourcedir asks SageMaker for the torch doeks is tested with on top of it
# (doeks.sagemaker.source_archive's requirements.txt).
SAGEMAKER_DLC_TAG = "2.9.0-gpu-py312-cu130-ubuntu22.04-sagemaker"


def sagemaker_image(region: str, tag: str = SAGEMAKER_DLC_TAG) -> str:
    """A PyTorch training DLC for SageMaker in `region` (SageMaker pulls from its own region's registry)."""
    return f"{dlc_registry(region)}/pytorch-training:{tag}"

# What a GPU node type has, as EC2's DescribeInstanceTypes says (GpuInfo.Gpus[].Count, NetworkInfo.EfaInfo.
# MaximumEfaInterfaces): asked once per region and type by doeks.instancetypes and kept in the user cache folder, so
# NPROC_PER_NODE=auto and EFA_PER_NODE=auto follow the type. The tables below only stand in for an offline plan (a
# dry run without credentials), and say so: EC2 is asked before anything is created.
def instance_cache():
    from .cachedirs import cache_dir

    return cache_dir() / "instance-types.json"


def cached_facts(region: str, instance: str) -> dict | None:
    """EC2's answer about `instance` in `region` as doeks.instancetypes cached it (gpus, efa; vcpus and memory_mib
    where cached since they are asked), or None."""
    import json

    try:
        found = json.loads(instance_cache().read_text()).get(region, {}).get(instance)
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, dict) and "gpus" in found else None


def offline_facts(instance: str) -> dict:
    """What the tables below say of one node of `instance` (None where they do not know), for a plan without EC2."""
    shape = VCPUS_MEMORY.get(instance)
    known = instance in GPUS or shape is not None  # a type in the tables: what they lack, it does not have
    return {"gpus": GPUS.get(instance, 0 if known else None), "efa": EFA_ADAPTERS.get(instance, 0 if known else None),
            "vcpus": shape[0] if shape else None, "memory_mib": shape[1] * 1024 if shape else None,
            "source": "doeks' offline table (EC2 not asked yet)" if known else "unknown (EC2 not asked yet)"}


def instance_facts(region: str, instance: str) -> tuple[int | None, int | None, str]:
    """(GPUs, EFA interfaces, where the numbers come from) of an instance type: EC2's answer cached here, else the
    offline tables, else (None, None, "unknown")."""
    cached = cached_facts(region, instance)
    if cached:
        return cached["gpus"], cached["efa"], "EC2 DescribeInstanceTypes"
    if instance in GPUS:
        return GPUS[instance], EFA_ADAPTERS.get(instance, 0), "doeks' offline table (EC2 not asked yet)"
    return None, None, "unknown (EC2 not asked yet)"


# What one node of a type has, as EC2's DescribeInstanceTypes says (copied from its answer, as moto 5 ships it):
# the offline stand-ins for NPROC_PER_NODE=auto, EFA_PER_NODE=auto, Kueue's quotas and `up`'s vCPU quota check.
# GPUs per instance type (nvidia.com/gpu a node advertises)
GPUS = {"g4dn.metal": 8, "g4dn.xlarge": 1, "g4dn.2xlarge": 1, "g4dn.4xlarge": 1, "g4dn.8xlarge": 1,
        "g4dn.12xlarge": 4, "g4dn.16xlarge": 1, "g5.xlarge": 1, "g5.2xlarge": 1, "g5.4xlarge": 1, "g5.8xlarge": 1,
        "g5.12xlarge": 4, "g5.16xlarge": 1, "g5.24xlarge": 4, "g5.48xlarge": 8, "g6.xlarge": 1, "g6.2xlarge": 1,
        "g6.4xlarge": 1, "g6.8xlarge": 1, "g6.12xlarge": 4, "g6.16xlarge": 1, "g6.24xlarge": 4, "g6.48xlarge": 8,
        "g6e.xlarge": 1, "g6e.2xlarge": 1, "g6e.4xlarge": 1, "g6e.8xlarge": 1, "g6e.12xlarge": 4, "g6e.16xlarge": 1,
        "g6e.24xlarge": 4, "g6e.48xlarge": 8, "p3.2xlarge": 1, "p3.8xlarge": 4, "p3.16xlarge": 8, "p3dn.24xlarge": 8,
        "p4d.24xlarge": 8, "p4de.24xlarge": 8, "p5.4xlarge": 1, "p5.48xlarge": 8, "p5e.48xlarge": 8,
        "p5en.48xlarge": 8, "p6-b200.48xlarge": 8}
# EFA interfaces per instance type (vpc.amazonaws.com/efa a node advertises; NetworkInfo.EfaInfo.MaximumEfaInterfaces)
EFA_ADAPTERS = {"c5n.18xlarge": 1, "g4dn.metal": 1, "g4dn.8xlarge": 1, "g4dn.12xlarge": 1, "g4dn.16xlarge": 1,
                "g5.8xlarge": 1, "g5.12xlarge": 1, "g5.16xlarge": 1, "g5.24xlarge": 1, "g5.48xlarge": 1,
                "g6.8xlarge": 1, "g6.12xlarge": 1, "g6.16xlarge": 1, "g6.24xlarge": 1, "g6.48xlarge": 1,
                "g6e.8xlarge": 1, "g6e.12xlarge": 1, "g6e.16xlarge": 1, "g6e.24xlarge": 2, "g6e.48xlarge": 4,
                "hpc7g.16xlarge": 1, "p3dn.24xlarge": 1, "p4d.24xlarge": 4, "p4de.24xlarge": 4, "p5.4xlarge": 1,
                "p5.48xlarge": 32, "p5e.48xlarge": 32, "p5en.48xlarge": 16, "p6-b200.48xlarge": 8,
                "trn1.32xlarge": 8, "trn1n.32xlarge": 16}
# vCPUs (VCpuInfo.DefaultVCpus) and memory in GiB (MemoryInfo.SizeInMiB / 1024)
VCPUS_MEMORY = {"c5.2xlarge": (8, 16), "c5.4xlarge": (16, 32), "g4dn.metal": (96, 384), "g4dn.xlarge": (4, 16),
                "g4dn.2xlarge": (8, 32), "g4dn.4xlarge": (16, 64), "g4dn.8xlarge": (32, 128),
                "g4dn.12xlarge": (48, 192), "g4dn.16xlarge": (64, 256), "g5.xlarge": (4, 16), "g5.2xlarge": (8, 32),
                "g5.4xlarge": (16, 64), "g5.8xlarge": (32, 128), "g5.12xlarge": (48, 192), "g5.16xlarge": (64, 256),
                "g5.24xlarge": (96, 384), "g5.48xlarge": (192, 768), "g6.xlarge": (4, 16), "g6.2xlarge": (8, 32),
                "g6.4xlarge": (16, 64), "g6.8xlarge": (32, 128), "g6.12xlarge": (48, 192), "g6.16xlarge": (64, 256),
                "g6.24xlarge": (96, 384), "g6.48xlarge": (192, 768), "g6e.xlarge": (4, 32), "g6e.2xlarge": (8, 64),
                "g6e.4xlarge": (16, 128), "g6e.8xlarge": (32, 256), "g6e.12xlarge": (48, 384),
                "g6e.16xlarge": (64, 512), "g6e.24xlarge": (96, 768), "g6e.48xlarge": (192, 1536),
                "p3dn.24xlarge": (96, 768), "p4d.24xlarge": (96, 1152), "p4de.24xlarge": (96, 1152),
                "p5.4xlarge": (16, 256), "p5.48xlarge": (192, 2048), "p5e.48xlarge": (192, 2048),
                "p5en.48xlarge": (192, 2048), "p6-b200.48xlarge": (192, 2048), "trn1.32xlarge": (128, 512)}

# vCPUs, memory (GiB) and the pods EKS lets a node run (the VPC CNI's eni-max-pods, awslabs/amazon-eks-ami) per
# instance type: what a simulated node of the type has (doeks.cluster.simnodes, KUBE_SIM_NODES)
NODE_SHAPES = {"p4d.24xlarge": (96, 1152, 737), "p4de.24xlarge": (96, 1152, 737), "p5.48xlarge": (192, 2048, 100),
               "p5e.48xlarge": (192, 2048, 100), "p5en.48xlarge": (192, 2048, 100), "g5.48xlarge": (192, 768, 345),
               "g6.48xlarge": (192, 768, 737), "trn1.32xlarge": (128, 512, 247), "c5.4xlarge": (16, 32, 234)}

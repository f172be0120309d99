"""GPUs and EFA interfaces of the GPU node type, from EC2's DescribeInstanceTypes (GpuInfo.Gpus[].Count,
NetworkInfo.EfaInfo.MaximumEfaInterfaces), asked once per region and type and kept in the user cache folder
(doeks.catalog.instance_cache), where settings read it: NPROC_PER_NODE=auto and EFA_PER_NODE=auto follow the type
(a hand-kept table lags behind what EC2 offers). `.env` overrides either.
"""
from __future__ import annotations

import json
import os

from . import ui
from .catalog import instance_cache


def describe(settings, instance: str) -> dict[str, int] | None:
    """What one node of `instance` has as EC2 answers in AWS_REGION (gpus, efa interfaces, vcpus, memory in MiB);
    None when EC2 does not know the type."""
    from .aws import client

    ec2 = client(settings, "ec2")
    try:
        found = ec2.describe_instance_types(InstanceTypes=[instance])["InstanceTypes"]
    except ec2.exceptions.ClientError as error:
        if error.response.get("Error", {}).get("Code") in ("InvalidInstanceType", "InvalidParameterValue"):
            return None
        raise
    if not found:
        return None
    info = found[0]
    gpus = sum(g.get("Count", 0) for g in (info.get("GpuInfo") or {}).get("Gpus", []))
    network = info.get("NetworkInfo") or {}
    efa = (network.get("EfaInfo") or {}).get("MaximumEfaInterfaces", 0) if network.get("EfaSupported") else 0
    return {"gpus": gpus, "efa": efa, "vcpus": (info.get("VCpuInfo") or {}).get("DefaultVCpus"),
            "memory_mib": (info.get("MemoryInfo") or {}).get("SizeInMiB")}


def remember(region: str, instance: str, facts: dict[str, int]) -> None:
    path = instance_cache()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known.setdefault(region, {})[instance] = dict(facts)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")  # each writer its own: two at once never share one
    partial.write_text(json.dumps(known, indent=1, sort_keys=True))
    partial.replace(path)


def refresh(settings, runner=None) -> bool:
    """Ask EC2 about GPU_INSTANCE_TYPE when settings still lack its answer (only with credentials configured: no
    instance-metadata probe); True when the cache changed (reload the settings). A type EC2 does not offer is one
    error line; no credentials: the plan says the numbers are unknown and goes on."""
    from .aws import credentials_configured, lookup
    from .errors import DoeksError, is_credentials_error

    if not settings.instance_facts_unknown or not credentials_configured(settings):
        return False
    instance, region = settings.gpu_instance_type, settings.aws_region
    try:
        answer = lookup(runner, f"GPUs and EFA of {instance} (EC2 DescribeInstanceTypes)",
                        lambda: describe(settings, instance), False)
    except Exception as error:  # noqa: BLE001 - EC2 out of reach or refusing: settings keep their table, and say so
        why = "no usable credentials" if is_credentials_error(error) else f"{type(error).__name__}"
        ui.say(f"GPUs and EFA of {instance}: EC2 not asked ({why}); {settings.instance_facts}", style="dim")
        return False
    if answer is False:
        return False
    if answer is None:
        raise DoeksError(f"GPU_INSTANCE_TYPE={instance} is not an instance type EC2 knows in {region}")
    remember(region, instance, answer)
    ui.say(f"{instance}: {answer['gpus']} GPUs, {answer['efa']} EFA interfaces (EC2 DescribeInstanceTypes, cached in "
           f"{instance_cache()})")
    return True


def node_facts(settings, instance: str, runner=None) -> dict:
    """What one node of `instance` has (gpus, efa, vcpus, memory_mib, and `source`): EC2's answer cached by
    `refresh`, else EC2 asked now (with credentials; cached), else doeks' offline tables (catalog.offline_facts),
    whose unknowns are None. What Kueue's quotas and `up`'s quota check are sized by."""
    from .aws import credentials_configured, lookup
    from .catalog import cached_facts, offline_facts

    found = cached_facts(settings.aws_region, instance)
    if found and found.get("vcpus") is not None:
        return {**found, "source": "EC2 DescribeInstanceTypes"}
    if credentials_configured(settings):
        try:
            answer = lookup(runner, f"{instance} (EC2 DescribeInstanceTypes)", lambda: describe(settings, instance), False)
        except Exception as error:  # noqa: BLE001 - EC2 out of reach: the offline tables stand in, and say so
            ui.say(f"{instance}: EC2 not asked ({type(error).__name__}); doeks' offline table stands in", style="dim")
            answer = False
        if answer:
            remember(settings.aws_region, instance, answer)
            return {**answer, "source": "EC2 DescribeInstanceTypes"}
    return offline_facts(instance)

"""A price before the bill: what `up` starts that AWS bills by the hour (instance types and counts, the EKS control
plane, the NAT gateway, the FSx file system, SageMaker's training instances), its on-demand $/hour, and one question
before any of it is made (`--yes` answers it; without a terminal, or in CI, `up` refuses in one line).

Prices are the AWS Price List API's answer (the `pricing` client's GetProducts), kept in the user cache folder with
the date they were read (prices.json; read again after MAX_AGE_DAYS). What it cannot answer (no credentials, an
endpoint without the API) is shown as unknown, never guessed; FSx is priced from doeks.audit's list prices.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MAX_AGE_DAYS = 7
PRICING_REGION = "us-east-1"  # the Price List API's endpoint; its products cover every region


@dataclass
class Item:
    """One billable thing `up` makes: what it is, how many, and the on-demand $/hour of one (None: unknown)."""

    what: str
    count: int
    unit_hour: float | None = None
    note: str = ""
    short: str = ""  # its name in the total's "not priced" list

    @property
    def per_hour(self) -> float | None:
        return None if self.unit_hour is None else self.unit_hour * self.count


def cache_path() -> Path:
    from .cachedirs import cache_dir

    return cache_dir() / "prices.json"


def _read_cache() -> dict:
    try:
        found = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _write_cache(entries: dict) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=2, sort_keys=True))
        os.replace(tmp, path)
    except OSError:  # a read-only cache folder: the price is still shown, read again next time
        pass


def _fresh(entry) -> bool:
    try:
        age = time.time() - time.mktime(time.strptime(entry["date"], "%Y-%m-%d"))
    except (KeyError, TypeError, ValueError):
        return False
    return age < MAX_AGE_DAYS * 86400 and isinstance(entry.get("usd_hour"), (int, float))


def _on_demand_hourly(price_list: list, usage: str = "") -> float | None:
    """The hourly USD price in GetProducts' PriceList (JSON strings): the OnDemand term's dimension priced per hour of
    the first product whose usagetype ends with `usage` (any product when empty)."""
    for text in price_list:
        product = json.loads(text) if isinstance(text, str) else text
        if not product.get("product", {}).get("attributes", {}).get("usagetype", "").endswith(usage):
            continue
        for term in (product.get("terms", {}).get("OnDemand") or {}).values():
            for dimension in (term.get("priceDimensions") or {}).values():
                usd = dimension.get("pricePerUnit", {}).get("USD")
                if usd is not None and dimension.get("unit", "").lower() in ("hrs", "hours", "hour") and float(usd) > 0:
                    return float(usd)
    return None


def _filters(**terms: str) -> list[dict]:
    return [{"Type": "TERM_MATCH", "Field": field, "Value": value} for field, value in terms.items()]


def queries(settings) -> dict[str, tuple[str, list[dict], str]]:
    """Each price `up` needs: cache key -> (service code, GetProducts filters, the end of the product's usagetype)."""
    region = settings.aws_region
    wanted = {f"{region}/eks-cluster": ("AmazonEKS", _filters(regionCode=region), "AmazonEKS-Hours:perCluster"),
              f"{region}/nat-gateway": ("AmazonEC2", _filters(regionCode=region, productFamily="NAT Gateway"),
                                        "NatGateway-Hours")}
    for instance in instance_types(settings):
        wanted[f"{region}/ec2/{instance}"] = ("AmazonEC2", _filters(
            regionCode=region, instanceType=instance, operatingSystem="Linux", tenancy="Shared", preInstalledSw="NA",
            capacitystatus="Used", licenseModel="No License required"), "")
    return wanted


def instance_types(settings) -> list[str]:
    from . import eks

    return list(dict.fromkeys(g["instanceType"] for g in eks.cluster_config(settings, None)["managedNodeGroups"]))


def pricing_client(settings):
    from botocore.config import Config

    from . import aws

    return aws.session(settings).client("pricing", region_name=PRICING_REGION, endpoint_url=aws.endpoint_url(settings, start=False),
                                        config=Config(connect_timeout=5, read_timeout=15, retries={"max_attempts": 2}))


def prices(settings, client=None) -> tuple[dict[str, float], str]:
    """The $/hour of each key of `queries` that the Price List answers (cache first), and where they come from."""
    cache = _read_cache()
    found, dates, missing = {}, set(), {}
    for key, query in queries(settings).items():
        entry = cache.get(key)
        if _fresh(entry):
            found[key], _ = entry["usd_hour"], dates.add(entry["date"])
        else:
            missing[key] = query
    if missing:
        asked = _ask(settings, missing, client)
        today = time.strftime("%Y-%m-%d")
        for key, usd in asked.items():
            found[key] = usd
            cache[key] = {"usd_hour": usd, "date": today}
            dates.add(today)
        if asked:
            _write_cache(cache)
    source = f"AWS Price List, read {', '.join(sorted(dates))}" if dates else "AWS Price List not reachable"
    return found, source


def _ask(settings, missing: dict, client=None) -> dict[str, float]:
    """GetProducts for each missing price; none at all when there are no credentials or the endpoint lacks the API."""
    if client is None:
        from . import aws

        try:
            if aws.session(settings).get_credentials() is None:
                return {}
        except Exception:  # noqa: BLE001 - a broken profile: the prices are unknown, `up` says why later
            return {}
        client = pricing_client(settings)
    answers = {}
    for key, (service, filters, usage) in missing.items():
        try:
            usd, token = None, None
            for _ in range(5):  # a region's EKS products fill a few pages; the one wanted is among them
                reply = client.get_products(ServiceCode=service, Filters=filters, FormatVersion="aws_v1", MaxResults=100,
                                            **({"NextToken": token} if token else {}))
                usd = _on_demand_hourly(reply.get("PriceList") or [], usage)
                token = reply.get("NextToken")
                if usd is not None or not token:
                    break
        except Exception:  # noqa: BLE001 - no such API here (moto), denied, offline: this price is unknown
            if not answers:  # the first failure is every one's: do not wait on each
                return answers
            continue
        if usd is not None:
            answers[key] = usd
    return answers


def items(target) -> tuple[list[Item], str]:
    """What `up` on this target starts that bills by the hour, priced where the Price List answered; and the prices'
    source (the Price List and the date it was read)."""
    from . import audit, eks

    s = target.settings
    found, source = prices(s)
    region = s.aws_region
    rows = [Item(f"EKS control plane {s.cluster_name} (Kubernetes {s.eks_version})", 1, found.get(f"{region}/eks-cluster"),
                 short="EKS control plane")]
    for group in eks.cluster_config(s, None)["managedNodeGroups"]:
        rows.append(Item(f"node group {group['name']}: {group['instanceType']}"
                         + (" (spot)" if group.get("spot") else ""), group["desiredCapacity"],
                         None if group.get("spot") else found.get(f"{region}/ec2/{group['instanceType']}"),
                         f"scales {group['minSize']}-{group['maxSize']}", group["instanceType"]))
    rows.append(Item("NAT gateway (eksctl's single NAT for the private subnets)", 1, found.get(f"{region}/nat-gateway"),
                     "+ $/GB processed", "NAT gateway"))
    if not s.fsx_file_system_id:
        gb_month = audit.FSX_LUSTRE_GB_MONTH.get((s.fsx_deployment_type, None if s.fsx_deployment_type == "SCRATCH_2" else s.fsx_throughput))
        rows.append(Item(f"FSx for Lustre {s.fsx_deployment_type} {s.fsx_storage_capacity} GiB, {s.fsx_throughput} MB/s/TiB", 1,
                         None if gb_month is None else round(s.fsx_storage_capacity * gb_month / audit.HOURS_PER_MONTH, 3),
                         "list price, us-east-1", "FSx"))
    if target.name == "sagemaker" and not getattr(target, "local", False):  # local mode trains on this machine
        rows.append(Item(f"SageMaker training: {s.sagemaker_instance_type}", s.sagemaker_instance_count, None,
                         "while a job trains (elasticjob.deploy)", s.sagemaker_instance_type))
    return rows, source


def summary(target) -> list[str]:
    """The lines `up` shows before it makes anything: each billable item, its count and $/hour, and the total."""
    s = target.settings
    rows, source = items(target)
    width = max(len(r.what) for r in rows)
    lines = [f"`invoke up` on TARGET={target.name} makes, in {s.aws_region} (billed by the hour until `invoke down`):"]
    for r in rows:
        price = "$?/h" if r.per_hour is None else f"${r.per_hour:,.2f}/h"
        each = "" if r.unit_hour is None or r.count == 1 else f" (${r.unit_hour:,.3f} each)"
        lines.append(f"  {r.count:>3} x {r.what:<{width}}  {price}{each}" + (f"  {r.note}" if r.note else ""))
    known = [r.per_hour for r in rows if r.per_hour is not None]
    unknown = list(dict.fromkeys(r.short or r.what for r in rows if r.per_hour is None and r.count))
    total = f"about ${sum(known):,.2f}/hour on demand" if known else "$/hour unknown"
    lines.append(f"  {total} ({source}" + (f"; not priced: {', '.join(unknown)}" if unknown else "") + ")")
    return lines


def bills(target) -> bool:
    """`up` on this target makes what AWS bills (eks, sagemaker), not a rehearsal on this machine."""
    return bool(getattr(target, "asks_before_down", False)) and not getattr(target, "rehearsal", False)


def confirm(target, yes: bool, dry_run: bool) -> None:
    """Show the summary; then, unless a dry run or --yes, ask before anything is made. No terminal (or CI) without
    --yes: one line, nothing made."""
    from . import ui
    from .errors import DoeksError

    if not bills(target):
        return
    lines = summary(target)
    for line in lines:
        ui.say(line)
    if dry_run or yes:
        return
    if os.environ.get("CI") or not sys.stdin.isatty():
        raise DoeksError(f"`invoke up` makes billable resources ({lines[-1].strip()}): pass --yes to confirm "
                         "(no terminal to ask on); `invoke up --dry-run` shows the plan")
    answer = input("Create them? [y/N] ")
    if answer.strip().lower() not in ("y", "yes"):
        raise DoeksError("not confirmed: nothing created")

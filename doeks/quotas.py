"""What the account allows, asked before anything bills: `up` stops in one line when the EC2 vCPU quota for the
instance family (on-demand or spot) cannot hold the node group, or when S3_BUCKET is another account's."""
from __future__ import annotations

from . import ui
from .errors import DoeksError

_STANDARD = "acdhimrtz"
ON_DEMAND_QUOTAS = {"p": "L-417A185B", "g": "L-DB2E81BA", "vt": "L-DB2E81BA", "trn": "L-2C3B7624", "inf": "L-1945791B",
                    "dl": "L-6E869C2A", "f": "L-74FC7D96", "x": "L-7295265B", **{f: "L-1216C47A" for f in _STANDARD}}
SPOT_QUOTAS = {"p": "L-7212CCBC", "g": "L-3819A6DF", "vt": "L-3819A6DF", "inf": "L-B5D1601B", "dl": "L-85EED4F7",
               "f": "L-88CF9481", "x": "L-E3A00192", **{f: "L-34B43A08" for f in _STANDARD}}
QUOTA_NAMES = {"L-417A185B": "Running On-Demand P instances", "L-DB2E81BA": "Running On-Demand G and VT instances",
               "L-2C3B7624": "Running On-Demand Trn instances", "L-1945791B": "Running On-Demand Inf instances",
               "L-6E869C2A": "Running On-Demand DL instances", "L-74FC7D96": "Running On-Demand F instances",
               "L-7295265B": "Running On-Demand X instances",
               "L-1216C47A": "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances",
               "L-7212CCBC": "All P Spot Instance Requests", "L-3819A6DF": "All G and VT Spot Instance Requests",
               "L-B5D1601B": "All Inf Spot Instance Requests", "L-85EED4F7": "All DL Spot Instance Requests",
               "L-88CF9481": "All F Spot Instance Requests", "L-E3A00192": "All X Spot Instance Requests",
               "L-34B43A08": "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests"}


def instance_family(instance_type: str) -> str:
    import re

    return re.match(r"[a-z]+", instance_type).group(0)


def quota_code(instance_type: str, spot: bool = False) -> str | None:
    """The vCPU quota `instance_type` runs under (on-demand or spot), or None where doeks knows none (hpc, u-...)."""
    return (SPOT_QUOTAS if spot else ON_DEMAND_QUOTAS).get(instance_family(instance_type))


def quota_value(client, code: str) -> float | None:
    """The account's value of EC2 quota `code` in the client's region (the default where none is applied); None when
    Service Quotas does not answer for it (an endpoint without EC2's quotas: moto, the rehearsal)."""
    quotas = client("service-quotas")
    try:
        return quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
    except quotas.exceptions.NoSuchResourceException:
        pass
    except quotas.exceptions.ClientError as error:
        from .errors import is_credentials_error

        if is_credentials_error(error):  # a dry run without credentials: the caller's lookup says unknown
            raise
        why = error.response.get("Error", {}).get("Code", type(error).__name__)
        raise DoeksError(f"cannot read EC2 quota {code} ({QUOTA_NAMES.get(code, code)}) from Service Quotas ({why}): "
                         "allow servicequotas:GetServiceQuota, or check it in the Service Quotas console") from None
    try:
        return quotas.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
    except quotas.exceptions.ClientError:  # no EC2 quotas at this endpoint at all (moto: NoSuchResource, NotImplemented)
        return None


def node_group_vcpus(settings, runner=None, capacity_block: bool = False) -> dict[tuple[str, bool], list[tuple[str, int, str, int]]]:
    """What `up`'s node groups may run, by (quota code, spot): (group, nodes, instance type, vCPUs of one) each. The
    system and CPU groups at their desired size (what `up` starts), the GPU group at GPU_NODES_MAX (what it may grow
    to for a job); a Capacity Block's GPU nodes are left out (the block is capacity bought already). vCPUs as EC2's
    DescribeInstanceTypes says (doeks.instancetypes.node_facts); a type without a known quota or vCPUs is left out."""
    from . import instancetypes

    s = settings
    groups = [("sys", s.system_instance_type, s.system_nodes, False)]
    if s.cpu_nodes_max > 0:
        groups.append(("cpu", s.cpu_instance_type, s.cpu_nodes, False))
    if s.gpu_nodes_max > 0 and not capacity_block:
        groups.append(("gpu", s.gpu_instance_type, s.gpu_nodes_max, s.gpu_spot))
    needs: dict[tuple[str, bool], list[tuple[str, int, str, int]]] = {}
    for name, instance, nodes, spot in groups:
        code = quota_code(instance, spot)
        vcpus = instancetypes.node_facts(s, instance, runner).get("vcpus")
        if nodes > 0 and code and vcpus:
            needs.setdefault((code, spot), []).append((name, nodes, instance, vcpus))
    return needs


def require_quotas(settings, runner=None, client=None, capacity_block: bool = False) -> None:
    """Before `up` makes anything that bills (eksctl's CloudFormation stacks, the EKS control plane): each EC2 vCPU
    quota the node groups run under (Service Quotas) against the vCPUs they ask (node_group_vcpus). Refused with one
    line naming the quota, its value, what is needed and how to raise it; a quota Service Quotas does not answer for
    is said and passed (the rehearsal's moto). In a dry run without credentials the lookup is an unknown."""
    from .aws import client as aws_client
    from .aws import lookup

    client = client or (lambda service: aws_client(settings, service))
    region = settings.aws_region
    for (code, spot), parts in node_group_vcpus(settings, runner, capacity_block).items():
        need = sum(nodes * vcpus for _, nodes, _, vcpus in parts)
        name = QUOTA_NAMES.get(code, code)
        value = lookup(runner, f"EC2 quota {code} ({name}) in {region}", lambda: quota_value(client, code), False)
        if value is False:
            continue
        if value is None:
            ui.say(f"quota {code} ({name}): Service Quotas does not answer for it here: not checked", style="yellow")
            continue
        if value >= need:
            ui.say(f"quota {code} ({name}): {value:.0f} vCPUs >= {need} needed", style="dim")
            continue
        asked = " + ".join(f"{group} {nodes} x {instance} x {vcpus}" for group, nodes, instance, vcpus in parts)
        lower = " or lower GPU_NODES_MAX" if any(group == "gpu" for group, *_ in parts) else ""
        raise DoeksError(
            f"EC2 quota {code} ({name}) in {region} is {value:.0f} vCPUs; the node groups need {need} ({asked} "
            f"vCPUs): nothing was created. Raise it in the Service Quotas console "
            f"(https://console.aws.amazon.com/servicequotas/home/services/ec2/quotas/{code}) or with `aws service-quotas "
            f"request-service-quota-increase --service-code ec2 --quota-code {code} --desired-value {need} "
            f"--region {region}`{lower}")


def bucket_owner(settings, bucket: str, runner=None) -> str:
    """Whose `bucket` is: "ours" (this account's), "absent" (doeks makes it), or another account's, said as this
    account's id ("not <id>"). S3 bucket names are global: the default S3_BUCKET may be another account's. HeadBucket
    with ExpectedBucketOwner (AWS answers 403 for a bucket of another account, or one these credentials may not
    read), then ListBuckets, which lists this account's buckets only (moto answers HeadBucket 200 for any account's
    bucket). In a dry run without credentials: "ours" (the plan says it is unknown)."""
    from botocore.exceptions import ClientError

    from .aws import client, lookup

    from botocore.exceptions import BotoCoreError

    from .errors import is_credentials_error

    def ask() -> str:
        account = client(settings, "sts").get_caller_identity()["Account"]
        s3 = client(settings, "s3")
        try:
            s3.head_bucket(Bucket=bucket, ExpectedBucketOwner=account)
        except ClientError as error:
            code = str(error.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchBucket", "NotFound"):
                return "absent"
            if code in ("403", "AccessDenied", "Forbidden"):
                return f"not {account}"
            raise
        try:
            listed = s3.list_buckets(Prefix=bucket).get("Buckets", [])
        except ClientError:  # no s3:ListAllMyBuckets: HeadBucket's answer stands
            return "ours"
        return "ours" if any(b["Name"] == bucket for b in listed) else f"not {account}"

    def read() -> str:
        try:
            return ask()
        except (ClientError, BotoCoreError) as error:
            if is_credentials_error(error):  # a dry run without credentials: lookup says unknown
                raise
            raise DoeksError(f"cannot tell whose bucket {bucket} is (S3_BUCKET): {str(error).splitlines()[0][:200]}") \
                from None

    return lookup(runner, f"the owner of bucket {bucket}", read, unknown="ours")


def require_own_bucket(settings, runner=None, buckets=None) -> None:
    """Before `up` makes anything: each bucket doeks writes to (S3_BUCKET by default) is this account's or absent; one
    line naming the fix otherwise (a bucket of another account fails later, half-way, with AccessDenied or
    BucketAlreadyExists)."""
    for bucket in buckets or [settings.s3_bucket]:
        owner = bucket_owner(settings, bucket, runner)
        if owner.startswith("not "):
            account = owner[4:]
            raise DoeksError(f"S3_BUCKET={bucket}: that bucket exists and is not this account's ({account}): S3 bucket "
                             f"names are global, so set S3_BUCKET to a name of yours, e.g. "
                             f"S3_BUCKET=doeks-{account}-{settings.aws_region}")

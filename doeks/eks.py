"""The EKS cluster: an eksctl ClusterConfig rendered from settings, eksctl to create/scale/delete it (the
ecosystem's tool; doeks builds no cluster itself), boto3 to read its state back and to manage access entries.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from . import ui
from .errors import DoeksError, MissingTool

ADDONS = ("vpc-cni", "coredns", "kube-proxy", "eks-pod-identity-agent")  # eks-pod-identity-agent: every association needs it
EBS_ADDON = "aws-ebs-csi-driver"  # added by doeks after eksctl (its role is in the identity table), with a gp3 default class


TAG = "doeks/cluster"


def gp3_storage_class(cluster: str) -> dict[str, Any]:
    """The default StorageClass Kubeflow's claims (MySQL, MinIO, Katib) need. The in-tree gp2 class is migrated to
    ebs.csi.aws.com (kubernetes CSIMigrationAWS, GA in 1.25), so without the EBS CSI driver those claims stay Pending."""
    return {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
            "metadata": {"name": "gp3", "labels": {"app.kubernetes.io/part-of": "doeks"},
                         "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
            "provisioner": "ebs.csi.aws.com", "volumeBindingMode": "WaitForFirstConsumer", "allowVolumeExpansion": True,
            "reclaimPolicy": "Delete", "parameters": {"type": "gp3", "encrypted": "true",
                                                      # the EBS CSI driver tags each volume it makes: `invoke audit` finds it
                                                      "tagSpecification_1": f"{TAG}={cluster}"}}


def ensure_addons(settings, runner) -> None:
    """The EBS CSI driver add-on with its Pod Identity role, and gp3 as the default StorageClass (gp2 no longer default)."""
    from . import identity, kube, storage

    associations = identity.addon_associations(settings, runner, identity.get("ebs-csi"))
    if runner.dry_run or not storage.addon_exists(settings, EBS_ADDON):
        runner.call(_client(settings), "create_addon", clusterName=settings.cluster_name, addonName=EBS_ADDON,
                    resolveConflicts="OVERWRITE", podIdentityAssociations=associations, tags={storage.TAG: settings.cluster_name})
    kube.apply(runner, [gp3_storage_class(settings.cluster_name)])
    kube.run(runner, ["annotate", "storageclass", "gp2", "storageclass.kubernetes.io/is-default-class=false", "--overwrite"]) \
        if runner.dry_run else runner.run([kube.kubectl(), "annotate", "storageclass", "gp2",
                                           "storageclass.kubernetes.io/is-default-class=false", "--overwrite"], check=False)


def cluster_vpc(settings, cluster: dict[str, Any]) -> str | None:
    """The cluster's VPC id (from its subnets when EKS does not report it)."""
    vpc_config = cluster.get("resourcesVpcConfig", {})
    if vpc_config.get("vpcId"):
        return vpc_config["vpcId"]
    if not vpc_config.get("subnetIds"):
        return None
    ec2 = _client(settings, "ec2")
    try:
        subnets = ec2.describe_subnets(SubnetIds=vpc_config["subnetIds"][:1])["Subnets"]
    except ec2.exceptions.ClientError:  # a subnet deleted already: there is no VPC left to clean
        return None
    return subnets[0]["VpcId"] if subnets else None


def remove_addons(settings, runner) -> None:
    """What ensure_addons and the other units made in AWS around the cluster, before eksctl deletes it: the S3 gateway
    endpoint (its route entries keep the VPC), the EBS add-on, every role of the identity table (a unit's delete
    that failed half-way leaves them otherwise), the CloudWatch add-on's log groups, the training image's ECR
    repository (tagged with this cluster)."""
    from . import identity, sagemaker, storage

    cluster = describe(settings, runner)
    if cluster is not None and cluster_vpc(settings, cluster):
        sagemaker.delete_s3_endpoint(settings, runner, cluster_vpc(settings, cluster))
    elif runner.dry_run:
        runner.call(_client(settings, "ec2"), "delete_vpc_endpoints", VpcEndpointIds=["<S3 gateway endpoint of the cluster VPC>"])
    storage.delete_addon(settings, runner, EBS_ADDON)
    for workload in identity.WORKLOADS:
        identity.remove(settings, runner, workload)
    from . import gpumetrics, trainimage

    gpumetrics.delete_log_groups(settings, runner)  # the CloudWatch add-on's, once it is gone (gpu-metrics' down)
    trainimage.delete_repository(settings, runner)  # the training image's ECR repository, when this cluster's
ACCESS_POLICIES = {"admin": "AmazonEKSClusterAdminPolicy", "edit": "AmazonEKSEditPolicy", "view": "AmazonEKSViewPolicy"}


def _nodegroup(settings, name: str, instance: str, low: int, desired: int, high: int, processor: str) -> dict[str, Any]:
    group: dict[str, Any] = {
        "name": name,
        "instanceType": instance,
        "minSize": low,
        "desiredCapacity": desired,
        "maxSize": high,
        "volumeSize": settings.node_volume_size,
        "volumeType": settings.node_volume_type,
        "volumeEncrypted": settings.node_volume_encrypted,
        "privateNetworking": settings.node_private_networking,
        "amiFamily": settings.ami_family,
        "labels": {"processor": processor, "doeks/nodegroup": name},
        "tags": {"doeks/cluster": settings.cluster_name},
    }
    return group


# eksctl's own default: 3 zones (2 in us-east-1, where some zones lack capacity for the control plane's subnets)
from .zones import _ZONES, _zone_count, choose_zones, gpu_zone, zones  # noqa: E402,F401 - below eks and storage


_ASK = object()


def reservation_type(settings, runner=None) -> str | None:
    """CAPACITY_RESERVATION_ID's kind as EC2's DescribeCapacityReservations says: "capacity-block" (a Capacity Block
    for ML, which eksctl launches into only with the node group's instanceMarketOptions.marketType capacity-block)
    or "default" (an On-Demand Capacity Reservation); None without a reservation or where EC2 cannot be asked (no
    credentials: the plan says so). A reservation EC2 does not know is one error line."""
    from .aws import credentials_configured, lookup

    reservation = settings.capacity_reservation_id
    if not reservation:
        return None
    if not credentials_configured(settings):
        if runner is not None and runner.dry_run:
            runner.unknown(f"kind of capacity reservation {reservation} (Capacity Block or not)")
        return None
    ec2 = _client(settings, "ec2")

    def read():
        try:
            found = ec2.describe_capacity_reservations(CapacityReservationIds=[reservation])["CapacityReservations"]
        except ec2.exceptions.ClientError as error:
            if "NotFound" not in error.response.get("Error", {}).get("Code", ""):
                raise
            found = []
        if not found:
            raise DoeksError(f"CAPACITY_RESERVATION_ID={reservation}: no such capacity reservation in "
                             f"{settings.aws_region} (`aws ec2 describe-capacity-reservations --region {settings.aws_region}`)")
        return found[0].get("ReservationType") or "default"

    return lookup(runner, f"kind of capacity reservation {reservation}", read)


def cluster_config(settings, chosen: Any = _ASK, reservation: str | None = None) -> dict[str, Any]:
    """The eksctl ClusterConfig (eksctl.io/v1alpha5) for the cluster in `settings`; `chosen` = (cluster zones, GPU
    zone), by default from `zones()` (EC2's offerings); None = not known (a dry run without credentials).
    `reservation`: CAPACITY_RESERVATION_ID's kind (reservation_type), "capacity-block" marking the GPU group's
    market type as eksctl needs it."""
    if chosen is _ASK:
        chosen = zones(settings)
    config: dict[str, Any] = {
        "apiVersion": "eksctl.io/v1alpha5",
        "kind": "ClusterConfig",
        "metadata": {"name": settings.cluster_name, "region": settings.aws_region, "version": settings.eks_version,
                     "tags": {"doeks/cluster": settings.cluster_name}},
        "vpc": {"cidr": settings.vpc_cidr},
        "iam": {"withOIDC": True},
        "accessConfig": {"authenticationMode": "API_AND_CONFIG_MAP"},
        "addons": [{"name": name} for name in ADDONS],
        "managedNodeGroups": [],
    }
    if chosen:
        config["availabilityZones"] = list(chosen[0])
    groups = config["managedNodeGroups"]
    groups.append(_nodegroup(settings, "sys", settings.system_instance_type, settings.system_nodes_min,
                             settings.system_nodes, settings.system_nodes_max, "cpu"))
    if settings.cpu_nodes_max > 0:
        groups.append(_nodegroup(settings, "cpu", settings.cpu_instance_type, settings.cpu_nodes_min,
                                 settings.cpu_nodes, settings.cpu_nodes_max, "cpu"))
    if settings.gpu_nodes_max > 0:  # GPU_NODES (0 by default): a job's deploy grows the group (scale_for_job)
        gpu = _nodegroup(settings, GPU_GROUP, settings.gpu_instance_type, settings.gpu_nodes_min, settings.gpu_nodes,
                         settings.gpu_nodes_max, "gpu")
        from .jobspec import GPU_TAINT

        gpu["taints"] = [dict(GPU_TAINT)]
        efa = settings.efa_per_node > 0  # the type has EFA (EC2's DescribeInstanceTypes) and GPU_EFA
        if efa:
            gpu["efaEnabled"] = True
        if efa or settings.placement_group or settings.capacity_reservation_id:
            # EFA, placement groups, reservations and FSx for Lustre all live in one AZ: pin the group to it
            gpu["availabilityZones"] = [chosen[1] if chosen else f"<zone of {settings.aws_region} offering {settings.gpu_instance_type}>"]
        if settings.placement_group:
            gpu["placement"] = {"groupName": settings.placement_group}
        if settings.capacity_reservation_id:
            gpu["capacityReservation"] = {"capacityReservationTarget": {"capacityReservationID": settings.capacity_reservation_id}}
            if reservation == "capacity-block":  # eksctl sets the launch template's market type from this field only
                gpu["instanceMarketOptions"] = {"marketType": "capacity-block"}
        if settings.gpu_spot:
            gpu["spot"] = True
        if efa:  # the label EKS' EFA examples (terraform-aws-eks, data-on-eks) select the device plugin by
            gpu["labels"][EFA_PRESENT] = "true"
        groups.append(gpu)
    return config


EFA_PRESENT = "vpc.amazonaws.com/efa.present"
GPU_RESOURCE, EFA_RESOURCE = "nvidia.com/gpu", "vpc.amazonaws.com/efa"


def group_nodes(config: dict[str, Any], name: str, zone: str, count: int, facts: dict | None = None) -> list[dict]:
    """What `count` nodes of managed node group `name` of `config` (the ClusterConfig doeks gives eksctl) carry on
    EKS, each {"labels", "taints", "capacity"}: the group's own labels and taints, eksctl's labels
    (alpha.eksctl.io/..., its SetManagedNodeGroupDefaults), EKS' (eks.amazonaws.com/nodegroup, capacityType), the
    kubelet's and the cloud provider's (instance type, zone, region), EC2's network-topology layers where doeks'
    Kueue Topology uses them, and the GPUs and EFA interfaces the device plugins advertise (`facts`: one node's, EC2's
    DescribeInstanceTypes). The EKS rehearsal makes its nodes from this, so they are what eksctl's group makes."""
    from . import kueue
    from .cluster.simnodes import layout

    group = next(g for g in config["managedNodeGroups"] if g["name"] == name)
    meta, instance = config["metadata"], group["instanceType"]
    market = (group.get("instanceMarketOptions") or {}).get("marketType")
    labels = {**group.get("labels", {}), "alpha.eksctl.io/cluster-name": meta["name"],
              "alpha.eksctl.io/nodegroup-name": name, "eks.amazonaws.com/nodegroup": name,
              "eks.amazonaws.com/capacityType": "SPOT" if group.get("spot") else
              "CAPACITY_BLOCK" if market == "capacity-block" else "ON_DEMAND",
              "node.kubernetes.io/instance-type": instance, "beta.kubernetes.io/instance-type": instance,
              "topology.kubernetes.io/region": meta["region"], "topology.kubernetes.io/zone": zone}
    facts = facts or {}
    gpus, efa = facts.get("gpus") or 0, (facts.get("efa") or 0) if group.get("efaEnabled") else 0
    capacity = {GPU_RESOURCE: str(gpus) if gpus else None, EFA_RESOURCE: str(efa) if efa else None}  # None: none
    layers = layout(count, f"{meta['name']}/{zone}/{name}") if kueue.has_topology(instance) else [()] * count
    return [{"labels": {**labels, **dict(zip(kueue.LAYERS, ids))}, "taints": [dict(t) for t in group.get("taints", [])],
             "capacity": dict(capacity)} for ids in layers]


def config_yaml(settings, runner=None) -> str:
    import yaml

    if settings.eks_yaml:
        path = Path(settings.eks_yaml)
        if not path.is_file():
            raise DoeksError(f"EKS_YAML={settings.eks_yaml!r}: no such file")
        return path.read_text()
    return yaml.safe_dump(cluster_config(settings, zones(settings, runner), reservation_type(settings, runner)),
                          sort_keys=False)


def check_version(settings, runner=None) -> str:
    """EKS_VERSION against what EKS offers in the region (DescribeClusterVersions): refused with one line when EKS
    does not offer it; a warning when it is in extended support (6x the control-plane price). Returns its status."""
    from . import catalog
    from .aws import lookup

    eks = _client(settings)

    def read():
        try:
            return eks.describe_cluster_versions(clusterType="eks", includeAll=True)["clusterVersions"]
        except eks.exceptions.ClientError as error:  # an endpoint without the API (moto): the calendar stands in
            if error.response.get("Error", {}).get("Code") not in ("404", "UnknownOperationException", "InvalidAction"):
                raise
            return None

    offered = lookup(runner, f"Kubernetes versions EKS offers in {settings.aws_region}", read)
    if offered is None:  # a dry run without credentials: the calendar stands in
        status = catalog.support_phase(settings.eks_version)
    else:
        by_version = {v["clusterVersion"]: (v.get("versionStatus") or v.get("status") or "").upper().replace("-", "_")
                      for v in offered}
        supported = sorted((v for v, st in by_version.items() if st in ("STANDARD_SUPPORT", "EXTENDED_SUPPORT")),
                           key=catalog.version_key)
        if by_version.get(settings.eks_version) not in ("STANDARD_SUPPORT", "EXTENDED_SUPPORT"):
            raise DoeksError(f"EKS_VERSION={settings.eks_version} is not offered by EKS in {settings.aws_region}: "
                             f"one of {', '.join(supported) or 'none'}")
        status = {"STANDARD_SUPPORT": "standard", "EXTENDED_SUPPORT": "extended"}[by_version[settings.eks_version]]
    if status == "extended":
        ui.say(f"warning: EKS_VERSION={settings.eks_version} is in extended support (6x the control-plane price): "
               f"set EKS_VERSION={catalog.newest_standard()}")
    ui.say(f"Kubernetes {settings.eks_version} ({status} support)")
    return status


def config_path(settings) -> Path:
    return settings.state_dir / "eks" / f"{settings.cluster_name}.yaml"


def eksctl() -> str:
    found = shutil.which("eksctl")
    if not found:
        raise MissingTool("eksctl is not on PATH: run doeks in the management container (invoke build run exec), or install eksctl")
    return found


def _client(settings, service: str = "eks"):
    from .aws import client

    return client(settings, service)


def describe(settings, runner=None) -> dict[str, Any] | None:
    """The cluster as EKS reports it (doeks.aws.describe_cluster, which the lower layers use)."""
    from .aws import describe_cluster

    return describe_cluster(settings, runner)


def nodegroups(settings) -> list[dict[str, Any]]:
    eks = _client(settings)
    names = eks.list_nodegroups(clusterName=settings.cluster_name).get("nodegroups", [])
    return [eks.describe_nodegroup(clusterName=settings.cluster_name, nodegroupName=n)["nodegroup"] for n in names]


def create(settings, runner) -> None:
    check_version(settings, runner)
    text = config_yaml(settings, runner)
    import sys

    sys.stdout.write(runner.mask(text if text.startswith("---") else "---\n" + text))
    path = config_path(settings)
    from .quotas import require_own_bucket

    require_own_bucket(settings, runner)  # S3_BUCKET (data, checkpoints, models): not another account's
    if runner.dry_run:
        require_capacity(settings, runner)
        runner.run(["eksctl", "create", "cluster", "-f", str(path)])
        runner.run(["eksctl", "utils", "write-kubeconfig", "--cluster", settings.cluster_name, "--region", settings.aws_region])
        ensure_addons(settings, runner)
        return
    binary = eksctl()
    if describe(settings) is not None:
        ui.say(f"cluster {settings.cluster_name} already exists in {settings.aws_region}: connecting")
    else:
        require_capacity(settings, runner)  # before eksctl's first CreateStack: nothing bills before it can succeed
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        runner.run([binary, "create", "cluster", "-f", str(path)])
    connect(settings, runner)
    ensure_addons(settings, runner)


def require_capacity(settings, runner) -> None:
    """The account can run the node groups: each EC2 vCPU quota they run under holds what they ask
    (doeks.quotas.require_quotas); one error line otherwise, before anything is made."""
    from .quotas import require_quotas

    require_quotas(settings, runner, capacity_block=reservation_type(settings, runner) == "capacity-block")


def connect(settings, runner) -> None:
    """The cluster's kubeconfig: the user's (eksctl's default, its current context) and doeks' own for this cluster
    only (doeks.kube.eks_kubeconfig), which every doeks task on TARGET=eks uses."""
    from .kube import eks_kubeconfig

    argv = ["eksctl", "utils", "write-kubeconfig", "--cluster", settings.cluster_name, "--region", settings.aws_region]
    pinned = eks_kubeconfig(settings)
    if not runner.dry_run:
        pinned.parent.mkdir(parents=True, exist_ok=True)
    for command in (argv, argv + ["--kubeconfig", str(pinned)]):
        runner.run(command if runner.dry_run else [eksctl()] + command[1:])


def scale(settings, runner, nodegroup: str, size: int, low: int | None, high: int | None) -> None:
    if size < 0 or (low is not None and low > size) or (high is not None and high < size):
        raise DoeksError(f"--size {size} must be >= 0 and within --min {low} / --max {high}")
    argv = ["eksctl", "scale", "nodegroup", "--cluster", settings.cluster_name, "--region", settings.aws_region,
            "--name", nodegroup, "--nodes", str(size)]
    if low is not None:
        argv += ["--nodes-min", str(low)]
    if high is not None:
        argv += ["--nodes-max", str(high)]
    if runner.dry_run:
        runner.run(argv)
        return
    names = [g["nodegroupName"] for g in nodegroups(settings)] if describe(settings) else []
    if nodegroup not in names:
        raise DoeksError(f"node group {nodegroup!r} not found in cluster {settings.cluster_name}: one of {', '.join(names) or 'none'}")
    runner.run([eksctl()] + argv[1:])


def scale_for_job(settings, runner, nodes: int) -> int:
    """The GPU node group grown to `nodes` (a job's REPLICAS, at most GPU_NODES_MAX) with EKS' UpdateNodegroupConfig,
    when it has fewer: GPU nodes start at GPU_NODES (0 by default) and bill from here, when a job needs them. Never
    shrinks the group (another job may run there); a cluster without the group is said and left as it is. Returns
    the size asked (0: no group)."""
    wanted = min(nodes, settings.gpu_nodes_max)
    eks = _client(settings)
    if runner.dry_run:
        runner.call(eks, "update_nodegroup_config", clusterName=settings.cluster_name, nodegroupName=GPU_GROUP,
                    scalingConfig={"desiredSize": f"<max(its desired size, {wanted})>"})
        return wanted
    try:
        current = eks.describe_nodegroup(clusterName=settings.cluster_name, nodegroupName=GPU_GROUP)["nodegroup"]
    except eks.exceptions.ResourceNotFoundException:  # a cluster not made by `up` (its own node groups, Karpenter)
        ui.say(f"cluster {settings.cluster_name} has no node group {GPU_GROUP} (`invoke up` makes one): doeks grows "
               f"none; the job's pods wait for {settings.gpu_instance_type} nodes of the cluster's own", style="yellow")
        return 0
    desired = current["scalingConfig"].get("desiredSize", 0)
    if desired >= wanted:
        ui.say(f"node group {GPU_GROUP}: {desired} nodes asked already (the job needs {wanted})", style="dim")
        return desired
    runner.call(eks, "update_nodegroup_config", clusterName=settings.cluster_name, nodegroupName=GPU_GROUP,
                scalingConfig={"desiredSize": wanted})
    ui.say(f"node group {GPU_GROUP}: {desired} -> {wanted} {settings.gpu_instance_type} nodes (they start now; "
           f"`invoke eks.scale --nodegroup {GPU_GROUP} --size 0` when no job needs them)")
    return wanted


GPU_GROUP = "gpu"


def delete(settings, runner) -> bool:
    """Delete the cluster with eksctl; False (and no error) when it is already gone."""
    argv = ["eksctl", "delete", "cluster", "--name", settings.cluster_name, "--region", settings.aws_region, "--wait"]
    remove_addons(settings, runner)
    if runner.dry_run:
        runner.run(argv)
        return True
    if describe(settings) is None:
        ui.say(f"cluster {settings.cluster_name} does not exist in {settings.aws_region}: nothing to delete")
        return False
    runner.run([eksctl()] + argv[1:])
    if describe(settings) is not None:
        raise DoeksError(f"eksctl returned but cluster {settings.cluster_name} still exists: run `invoke eks.delete --yes` again")
    return True


def authorize(settings, runner, principal: str, access: str = "admin", namespaces: tuple[str, ...] = ()) -> None:
    """Give an IAM principal cluster access with an EKS access entry and an access policy."""
    import re

    if not re.fullmatch(r"arn:aws[a-z-]*:(iam|sts)::\d{12}:(role|user|assumed-role)/[\w+=,.@/-]+", principal):
        raise DoeksError(f"--principal {principal!r} is not an IAM role or user ARN (arn:aws:iam::123456789012:role/NAME)")
    if access not in ACCESS_POLICIES:
        raise DoeksError(f"--access {access!r}: expected one of {', '.join(ACCESS_POLICIES)}")
    eks = _client(settings)
    scope = {"type": "namespace", "namespaces": list(namespaces)} if namespaces else {"type": "cluster"}
    try:
        runner.call(eks, "create_access_entry", clusterName=settings.cluster_name, principalArn=principal)
    except eks.exceptions.ResourceInUseException:
        ui.say(f"access entry for {principal} exists: updating its policy")
    runner.call(eks, "associate_access_policy", clusterName=settings.cluster_name, principalArn=principal,
                policyArn=f"arn:aws:eks::aws:cluster-access-policy/{ACCESS_POLICIES[access]}", accessScope=scope)


def status_rows(settings) -> tuple[list[list[Any]], list[list[Any]]]:
    cluster = describe(settings)
    if cluster is None:
        return [[settings.cluster_name, "absent", "", "", ""]], []
    head = [[cluster["name"], cluster["status"], cluster.get("version", ""), cluster.get("endpoint", ""),
             cluster.get("platformVersion", "")]]
    groups = [[g["nodegroupName"], g["status"], ",".join(g.get("instanceTypes", [])),
               f"{g['scalingConfig'].get('minSize')}/{g['scalingConfig'].get('desiredSize')}/{g['scalingConfig'].get('maxSize')}",
               g.get("capacityType", ""), (g.get("labels") or {}).get("processor", "")] for g in nodegroups(settings)]
    return head, groups


def node_rows() -> list[list[Any]]:
    """Kubernetes nodes with instance type and allocatable GPUs/EFA, when a cluster is reachable."""
    from .kube import client

    rows = []
    for node in client().list_node(_request_timeout=5).items:
        labels = node.metadata.labels or {}
        allocatable = node.status.allocatable or {}
        ready = next((c.status for c in node.status.conditions or [] if c.type == "Ready"), "?")
        rows.append([node.metadata.name, labels.get("node.kubernetes.io/instance-type", ""), ready,
                     allocatable.get("nvidia.com/gpu", "0"), allocatable.get("vpc.amazonaws.com/efa", "0")])
    return rows

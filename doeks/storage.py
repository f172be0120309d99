"""Shared storage for training pods: EFS and FSx for Lustre with their CSI drivers, IAM, security groups and
Kubernetes objects (boto3 for AWS, kubectl server-side apply for the cluster). Everything is found by tags and names
derived from CLUSTER_NAME, never "the first file system in the region" or "the first cluster in the account".
"""
from __future__ import annotations

import json
import subprocess
import time
from typing import Any

from . import ui
from .errors import DoeksError

EFS_DRIVER_ADDON = "aws-efs-csi-driver"
FSX_CHART_VERSION = "1.11.0"
FSX_CHART_REPO = "https://kubernetes-sigs.github.io/aws-fsx-csi-driver"
TAG = "doeks/cluster"
FSX_CONTROLLER_SA = "fsx-csi-controller-sa"  # the chart's default; the Pod Identity association names it
WAIT_TIMEOUT = 1800  # seconds to wait for a file system / add-on to be really gone


def _client(settings, service):
    from .aws import client

    return client(settings, service)


# -- the cluster's network ----------------------------------------------------------------------------------------
def cluster_network(settings, runner=None) -> dict[str, Any]:
    """VPC, CIDR, cluster security group and the private subnets (one per AZ) of *this* cluster. A dry run of a
    cluster that does not exist yet (`up --dry-run`) or cannot be read (no credentials) plans with placeholders."""
    from .aws import describe_cluster

    cluster = describe_cluster(settings, runner)
    if cluster is None and runner is not None and runner.dry_run:
        from .zones import gpu_zone

        zone = gpu_zone(settings, runner)
        return {"vpc": f"<vpc of cluster {settings.cluster_name}>", "cidr": settings.vpc_cidr,
                "subnets": {zone: f"<private subnet of cluster {settings.cluster_name} in {zone}>"},
                "security_group": f"<cluster security group of {settings.cluster_name}>", "placeholder": True}
    if cluster is None:
        raise DoeksError(f"cluster {settings.cluster_name} not found in {settings.aws_region}: create it first (invoke eks.create)")
    vpc_config = cluster["resourcesVpcConfig"]
    ec2 = _client(settings, "ec2")
    subnets = ec2.describe_subnets(SubnetIds=vpc_config["subnetIds"])["Subnets"]
    vpc_id = vpc_config.get("vpcId") or subnets[0]["VpcId"]
    cidr = ec2.describe_vpcs(VpcIds=[vpc_id])["Vpcs"][0]["CidrBlock"]
    private = [s for s in subnets if not s.get("MapPublicIpOnLaunch")]
    if not private:
        raise DoeksError(f"cluster {settings.cluster_name} has no private subnets to put mount targets in")
    per_zone: dict[str, str] = {}
    for subnet in sorted(private, key=lambda s: s["SubnetId"]):
        per_zone.setdefault(subnet["AvailabilityZone"], subnet["SubnetId"])
    security_group = vpc_config.get("clusterSecurityGroupId") or (vpc_config.get("securityGroupIds") or [None])[0]
    return {"vpc": vpc_id, "cidr": cidr, "subnets": per_zone, "security_group": security_group}


def _find_group(ec2, vpc: str, name: str, runner=None) -> str | None:
    if vpc.startswith("<"):  # a dry run's placeholder VPC: nothing to find
        return None
    from .aws import lookup

    groups = lookup(runner, f"security group {name}", lambda: ec2.describe_security_groups(
        Filters=[{"Name": "vpc-id", "Values": [vpc]}, {"Name": "group-name", "Values": [name]}]), {"SecurityGroups": []})
    return groups["SecurityGroups"][0]["GroupId"] if groups["SecurityGroups"] else None


def ensure_security_group(settings, runner, net, name: str, description: str, permissions: list[dict]) -> str | None:
    ec2 = _client(settings, "ec2")
    existing = _find_group(ec2, net["vpc"], name, runner)
    if existing:
        ui.say(f"security group {name} exists ({existing})")
        return existing
    created = runner.call(ec2, "create_security_group", GroupName=name, Description=description, VpcId=net["vpc"],
                          TagSpecifications=[{"ResourceType": "security-group", "Tags": [{"Key": TAG, "Value": settings.cluster_name}]}])
    group = created["GroupId"] if created else f"<{name}>"
    for permission in permissions:
        if permission.get("self"):
            permission = {k: v for k, v in permission.items() if k != "self"}
            permission["UserIdGroupPairs"] = [{"GroupId": group}]
        runner.call(ec2, "authorize_security_group_ingress", GroupId=group, IpPermissions=[permission])
    return group if created else None


def delete_security_group(settings, runner, vpc: str, name: str, timeout: float = 600) -> None:
    ec2 = _client(settings, "ec2")
    group = _find_group(ec2, vpc, name, runner)
    if group is None and runner.dry_run:
        group = f"<the id of security group {name} in {'the cluster VPC' if vpc.startswith('<') else vpc}, if any>"
    if group is None:
        ui.say(f"security group {name} is gone already")
        return
    if runner.dry_run:
        runner.call(ec2, "delete_security_group", GroupId=group)
        return
    deadline = time.monotonic() + timeout
    while True:  # network interfaces of a file system just deleted hold the group for a while: DependencyViolation
        try:
            runner.call(ec2, "delete_security_group", GroupId=group)
            return
        except ec2.exceptions.ClientError as error:
            if error.response["Error"]["Code"] != "DependencyViolation" or time.monotonic() > deadline:
                raise DoeksError(f"cannot delete security group {name} ({group}): {error.response['Error']['Code']}: "
                                 "something in the VPC still uses it; run the teardown again when it is gone") from None
            time.sleep(10)


# -- EFS ----------------------------------------------------------------------------------------------------------
def efs_token(settings) -> str:
    return f"doeks-{settings.cluster_name}"


def find_efs(settings, runner=None) -> dict[str, Any] | None:
    from .aws import lookup

    efs = _client(settings, "efs")
    found = lookup(runner, f"EFS {efs_token(settings)}",
                   lambda: efs.describe_file_systems(CreationToken=efs_token(settings))["FileSystems"], [])
    return found[0] if found else None


def efs_create(settings, runner) -> str | None:
    """An encrypted file system for this cluster, an NFS security group and mount targets in its private subnets."""
    net = cluster_network(settings, runner)
    efs = _client(settings, "efs")
    fs = find_efs(settings, runner)
    if fs:
        fs_id = fs["FileSystemId"]
        ui.say(f"EFS {fs_id} for {settings.cluster_name} exists")
    else:
        created = runner.call(efs, "create_file_system", CreationToken=efs_token(settings), Encrypted=True,
                              PerformanceMode="generalPurpose", ThroughputMode="elastic",
                              Tags=[{"Key": "Name", "Value": efs_token(settings)}, {"Key": TAG, "Value": settings.cluster_name}])
        fs_id = created["FileSystemId"] if created else "<new-fs>"
        if created:
            _wait(lambda: efs.describe_file_systems(FileSystemId=fs_id)["FileSystems"][0]["LifeCycleState"] == "available",
                  f"EFS {fs_id} to become available")
    nfs = {"IpProtocol": "tcp", "FromPort": 2049, "ToPort": 2049}
    source = {"UserIdGroupPairs": [{"GroupId": net["security_group"]}]} if net["security_group"] else {"IpRanges": [{"CidrIp": net["cidr"]}]}
    group = ensure_security_group(settings, runner, net, f"doeks-efs-{settings.cluster_name}",
                                  "doeks: NFS to EFS from the cluster only", [{**nfs, **source}])
    existing = {} if runner.dry_run and not fs else {m["SubnetId"] for m in efs.describe_mount_targets(FileSystemId=fs_id)["MountTargets"]}
    for zone, subnet in sorted(net["subnets"].items()):
        if subnet in existing:
            continue
        runner.call(efs, "create_mount_target", FileSystemId=fs_id, SubnetId=subnet, SecurityGroups=[group or "<efs-sg>"])
    return fs_id


def efs_destroy(settings, runner) -> bool:
    """Mount targets (waiting until gone), the file system, the security group; False if nothing was there."""
    efs = _client(settings, "efs")
    fs = find_efs(settings, runner)
    if fs:
        fs_id = fs["FileSystemId"]
        targets = efs.describe_mount_targets(FileSystemId=fs_id)["MountTargets"]
        for target in targets:
            runner.call(efs, "delete_mount_target", MountTargetId=target["MountTargetId"])
        if not runner.dry_run:
            _wait(lambda: not efs.describe_mount_targets(FileSystemId=fs_id)["MountTargets"], f"mount targets of {fs_id} to go")
        runner.call(efs, "delete_file_system", FileSystemId=fs_id)
        if not runner.dry_run:
            _wait(lambda: find_efs(settings) is None, f"EFS {fs_id} to be deleted")
    elif runner.dry_run and runner.was_unknown(f"EFS {efs_token(settings)}"):  # it may exist: the lookup is unknown
        runner.call(efs, "delete_mount_target", MountTargetId=f"<each mount target of EFS {efs_token(settings)}, if any>")
        runner.step("wait until the mount targets are gone", lambda: None)
        runner.call(efs, "delete_file_system", FileSystemId=f"<EFS {efs_token(settings)}, if any>")
    else:
        ui.say(f"no EFS for cluster {settings.cluster_name}: nothing to destroy")
    from .aws import describe_cluster

    cluster = describe_cluster(settings, runner)
    if runner.dry_run and not cluster and runner.was_unknown(f"cluster {settings.cluster_name} in {settings.aws_region}"):
        delete_security_group(settings, runner, "<vpc>", f"doeks-efs-{settings.cluster_name}")
    elif cluster:
        delete_security_group(settings, runner, cluster_network(settings, runner)["vpc"], f"doeks-efs-{settings.cluster_name}")
    return fs is not None


def efs_manifests(settings, fs_id: str) -> list[dict[str, Any]]:
    labels = {"app.kubernetes.io/part-of": "doeks"}
    return [
        {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "efs-sc", "labels": labels},
         "provisioner": "efs.csi.aws.com", "parameters": {"provisioningMode": "efs-ap", "fileSystemId": fs_id, "directoryPerms": "700"}},
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "efs-pv", "labels": labels},
         "spec": {"capacity": {"storage": "5Ti"}, "volumeMode": "Filesystem", "accessModes": ["ReadWriteMany"],
                  "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "efs-sc",
                  "csi": {"driver": "efs.csi.aws.com", "volumeHandle": fs_id}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "efs-pvc", "namespace": settings.namespace, "labels": labels},
         "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "efs-sc", "volumeName": "efs-pv",
                  "resources": {"requests": {"storage": "5Ti"}}}},
    ]


def efs_deploy(settings, runner) -> None:
    """The EFS CSI driver as an EKS add-on (Pod Identity role), then StorageClass efs-sc and PV + PVC efs-pvc."""
    from . import kube

    fs = find_efs(settings, runner)
    if fs is None and not runner.dry_run:
        raise DoeksError(f"no EFS for cluster {settings.cluster_name}: run `invoke csi.efs.create` first")
    from . import identity

    eks = _client(settings, "eks")
    associations = identity.addon_associations(settings, runner, identity.get("efs-csi"))
    if runner.dry_run or not addon_exists(settings, EFS_DRIVER_ADDON):
        runner.call(eks, "create_addon", clusterName=settings.cluster_name, addonName=EFS_DRIVER_ADDON, resolveConflicts="OVERWRITE",
                    podIdentityAssociations=associations, tags={TAG: settings.cluster_name})
    kube.apply(runner, efs_manifests(settings, fs["FileSystemId"] if fs else "<fs-id>"))


def efs_delete(settings, runner) -> None:
    from . import kube

    fs = find_efs(settings, runner)
    kube.delete(runner, list(reversed(efs_manifests(settings, fs["FileSystemId"] if fs else "fs-unknown"))))
    from . import identity

    delete_addon(settings, runner, EFS_DRIVER_ADDON)
    identity.remove(settings, runner, identity.get("efs-csi"))


def addon_exists(settings, name: str) -> bool:
    eks = _client(settings, "eks")
    try:
        eks.describe_addon(clusterName=settings.cluster_name, addonName=name)
        return True
    except eks.exceptions.ResourceNotFoundException:
        return False


def delete_addon(settings, runner, name: str, timeout: float = 600) -> None:
    """Delete an EKS add-on (and the associations it made) and wait until it is gone; gone already is fine."""
    from . import aws as cluster

    eks = _client(settings, "eks")
    if runner.dry_run:
        runner.call(eks, "delete_addon", clusterName=settings.cluster_name, addonName=name)
        return
    if cluster.describe_cluster(settings) is None or not addon_exists(settings, name):
        ui.say(f"add-on {name} is gone already")
        return
    runner.call(eks, "delete_addon", clusterName=settings.cluster_name, addonName=name)
    _wait(lambda: not addon_exists(settings, name), f"add-on {name} to go", timeout=timeout)


# -- FSx for Lustre -----------------------------------------------------------------------------------------------
def fsx_policy(settings) -> dict[str, Any]:
    """The FSx CSI driver's policy: defined with the other workloads' policies in doeks.identity."""
    from .identity import fsx_driver_policy

    return fsx_driver_policy(settings)


def fsx_subnet(settings, net) -> str:
    if settings.fsx_subnet_id and net.get("placeholder"):
        return settings.fsx_subnet_id
    if settings.fsx_subnet_id:
        if settings.fsx_subnet_id not in net["subnets"].values():
            raise DoeksError(f"FSX_SUBNET_ID={settings.fsx_subnet_id!r} is not a private subnet of cluster {settings.cluster_name}: "
                             f"expected one of {', '.join(sorted(net['subnets'].values()))}")
        return settings.fsx_subnet_id
    if net.get("placeholder"):  # a dry run's plan: the one placeholder subnet, in the GPU zone already
        return next(iter(net["subnets"].values()))
    from .zones import gpu_zone

    zone = gpu_zone(settings)
    return net["subnets"].get(zone) or sorted(net["subnets"].items())[0][1]


def fsx_manifests(settings, subnet: str, group: str, runner=None) -> list[dict[str, Any]]:
    labels = {"app.kubernetes.io/part-of": "doeks"}
    if settings.fsx_file_system_id:
        from .aws import lookup

        unknown = "<unknown: no credentials>"
        fs = lookup(runner, f"FSx {settings.fsx_file_system_id}", lambda: _client(settings, "fsx").describe_file_systems(
            FileSystemIds=[settings.fsx_file_system_id])["FileSystems"][0],
            {"FileSystemId": settings.fsx_file_system_id, "StorageCapacity": settings.fsx_storage_capacity,
             "DNSName": unknown, "LustreConfiguration": {"MountName": unknown}})
        lustre = fs["LustreConfiguration"]
        return [
            {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "fsx-pv", "labels": labels},
             "spec": {"capacity": {"storage": f"{fs['StorageCapacity']}Gi"}, "volumeMode": "Filesystem", "accessModes": ["ReadWriteMany"],
                      "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                      "csi": {"driver": "fsx.csi.aws.com", "volumeHandle": fs["FileSystemId"],
                              "volumeAttributes": {"dnsname": fs["DNSName"], "mountname": lustre.get("MountName", "fsx")}}}},
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": settings.shared_pvc, "namespace": settings.namespace, "labels": labels},
             "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": "fsx-pv",
                      "resources": {"requests": {"storage": f"{fs['StorageCapacity']}Gi"}}}},
        ]
    parameters = {"subnetId": subnet, "securityGroupIds": group, "deploymentType": settings.fsx_deployment_type,
                  "dataCompressionType": settings.fsx_compression, "fileSystemTypeVersion": "2.15",
                  # aws-fsx-csi-driver docs/parameters.md: extraTags "key1=value1,key2=value2" on the file system it
                  # creates, so teardown and `invoke audit` can find it (the driver itself only adds CSIVolumeName)
                  "extraTags": f"{TAG}={settings.cluster_name}"}
    if settings.fsx_deployment_type != "SCRATCH_2":
        parameters["perUnitStorageThroughput"] = str(settings.fsx_throughput)
    return [
        {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "fsx-sc", "labels": labels},
         "provisioner": "fsx.csi.aws.com", "parameters": parameters, "mountOptions": ["flock"], "reclaimPolicy": "Delete"},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": settings.shared_pvc, "namespace": settings.namespace, "labels": labels},
         "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "fsx-sc",
                  "resources": {"requests": {"storage": f"{settings.fsx_storage_capacity}Gi"}}}},
    ]


def fsx_group_permissions(net) -> list[dict]:
    return [{"IpProtocol": "tcp", "FromPort": 988, "ToPort": 988, "self": True},
            {"IpProtocol": "tcp", "FromPort": 1018, "ToPort": 1023, "self": True},
            {"IpProtocol": "tcp", "FromPort": 988, "ToPort": 988, "IpRanges": [{"CidrIp": net["cidr"]}]},
            {"IpProtocol": "tcp", "FromPort": 1018, "ToPort": 1023, "IpRanges": [{"CidrIp": net["cidr"]}]}]


def fsx_deploy(settings, runner) -> None:
    from . import kube

    net = cluster_network(settings, runner)
    subnet = fsx_subnet(settings, net)
    from . import identity

    identity.ensure(settings, runner, identity.get("fsx-csi"))  # role + Pod Identity association for the controller
    group = ensure_security_group(settings, runner, net, f"doeks-fsx-{settings.cluster_name}", "doeks: Lustre 988, 1018-1023 within the VPC",
                                  fsx_group_permissions(net)) or "<fsx-sg>"
    helm = ["helm", "upgrade", "--install", "aws-fsx-csi-driver", "aws-fsx-csi-driver", "--repo", FSX_CHART_REPO,
            "--version", FSX_CHART_VERSION, "--namespace", "kube-system", "--set", "controller.serviceAccount.create=true",
            "--set", f"controller.serviceAccount.name={FSX_CONTROLLER_SA}"]
    runner.run(helm)
    kube.apply(runner, fsx_manifests(settings, subnet, group, runner))
    if settings.fsx_import_path:
        fsx_import(settings, runner)


def fsx_import(settings, runner, core=None, fsx=None) -> str | None:
    """FSX_IMPORT_PATH on the static file system, or on the dynamic one once the claim is bound (dry run: says so)."""
    file_system_id = settings.fsx_file_system_id
    if not file_system_id:
        if runner.dry_run:
            runner.step(f"wait for PVC {settings.shared_pvc} to bind; its PV's csi.volumeHandle is the file system id", lambda: None)
            file_system_id = f"<volumeHandle of the PV bound to {settings.shared_pvc}>"
        else:
            file_system_id = claim_file_system(settings, core)
    return fsx_associate(settings, runner, file_system_id, fsx)


def fsx_delete(settings, runner, force: bool = False, in_use: list[str] | None = None, timeout: float | None = None) -> None:
    """Reverse fsx.deploy in dependency order, waiting for each step: the claim (refused while pods use it, not
    because it is Bound), the file system the driver made for it (its DeleteVolume needs the controller and its
    role), the driver, its association and role, then the security group."""
    from . import identity, kube
    from .aws import describe_cluster

    if in_use is None and not runner.dry_run:
        try:  # doeks' staging Job first: its Completed pod holds the claim, and a waiting delete would wait for ever
            kube.release_claim(runner, settings.namespace, settings.shared_pvc)
        except DoeksError:
            if not force:
                raise
        in_use = [] if force else pods_using_claim(settings)
    if in_use and not force:
        raise DoeksError(f"PVC {settings.shared_pvc} is used by pod(s) {', '.join(in_use[:5])}: delete the job first "
                         f"(invoke elasticjob.delete), or pass --force")
    if runner.dry_run:
        kube.release_claim(runner, settings.namespace, settings.shared_pvc)
    cluster = describe_cluster(settings, runner)
    if settings.fsx_import_path:  # only then did deploy make one (unset it only after csi.fsx.delete)
        fsx_dissociate(settings, runner)
    subnet = group = "-"
    held = [] if runner.dry_run or not force else _held(settings)
    kube.delete(runner, list(reversed(fsx_manifests(settings.with_overrides(fsx_file_system_id=""), subnet, group))),
                wait=not held)  # --force with pods holding it: asked to go, not waited for
    if runner.dry_run:
        runner.step(f"wait until the FSx file systems tagged {TAG}={settings.cluster_name} by the CSI driver are deleted", lambda: None)
    else:
        wait_file_systems_gone(settings, timeout=WAIT_TIMEOUT if timeout is None else timeout)
    runner.run(["helm", "uninstall", "aws-fsx-csi-driver", "--namespace", "kube-system", "--ignore-not-found", "--wait"])
    identity.remove(settings, runner, identity.get("fsx-csi"))
    if cluster or runner.dry_run:
        vpc = cluster_network(settings, runner)["vpc"] if cluster else "<vpc>"
        delete_security_group(settings, runner, vpc, f"doeks-fsx-{settings.cluster_name}")


def tagged_file_systems(settings) -> list[dict[str, Any]]:
    """FSx file systems tagged doeks/cluster=<cluster> (the CSI driver's, via extraTags), not yet deleted."""
    fsx = _client(settings, "fsx")
    found = []
    for page in fsx.get_paginator("describe_file_systems").paginate():
        for fs in page["FileSystems"]:
            tags = {t["Key"]: t["Value"] for t in fs.get("Tags", [])}
            if tags.get(TAG) == settings.cluster_name and fs.get("Lifecycle") != "DELETED" \
                    and fs["FileSystemId"] != settings.fsx_file_system_id:
                found.append(fs)
    return found


def wait_file_systems_gone(settings, timeout: float = WAIT_TIMEOUT) -> None:
    if not tagged_file_systems(settings):
        return
    _wait(lambda: not tagged_file_systems(settings),
          f"FSx {', '.join(f['FileSystemId'] for f in tagged_file_systems(settings))} to be deleted by the CSI driver "
          "(the PV's DeleteVolume); the driver's role and security group are kept until then", timeout=timeout)


def _held(settings) -> list[str]:
    from . import kube

    try:
        return kube.pods_using_claim(settings.namespace, settings.shared_pvc)
    except DoeksError:
        return ["<unknown>"]


def pods_using_claim(settings) -> list[str]:
    """Names of the pods that mount the shared claim and keep it (claim protection: any pod scheduled with it,
    a Completed one too), from `kubectl get pods -o json`."""
    from . import kube

    try:
        result = subprocess.run([kube.kubectl(), "get", "pods", "-n", settings.namespace, "-o", "json"],
                                capture_output=True, text=True, timeout=30)
        pods = json.loads(result.stdout)["items"] if result.returncode == 0 else None
    except (OSError, ValueError, KeyError, subprocess.TimeoutExpired, DoeksError):
        pods = None
    if pods is None:
        raise DoeksError(f"cannot tell whether pods use PVC {settings.shared_pvc} (Kubernetes API not reachable: "
                         f"`invoke eks.connect` writes the kubeconfig): pass --force to delete anyway")
    users = []
    for pod in pods:
        if not (pod.get("spec") or {}).get("nodeName") and (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        claims = {(v.get("persistentVolumeClaim") or {}).get("claimName") for v in (pod.get("spec") or {}).get("volumes") or []}
        if settings.shared_pvc in claims:
            users.append(pod["metadata"]["name"])
    return users


def pvc_bound(settings) -> bool:
    """Kept for callers that only report the claim's phase (teardown no longer refuses because of it)."""
    from .kube import client

    try:
        claim = client().read_namespaced_persistent_volume_claim(settings.shared_pvc, settings.namespace, _request_timeout=5)
    except Exception as error:  # noqa: BLE001
        if getattr(error, "status", None) == 404:
            return False
        raise DoeksError(f"cannot tell whether PVC {settings.shared_pvc} is bound ({type(error).__name__})") from None
    return claim.status.phase == "Bound"


def _wait(predicate, what: str, timeout: float = 600, interval: float = 2) -> None:
    with ui.progress(transient=True) as bar:
        bar.add_task(f"waiting for {what}", total=None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(interval)
    raise DoeksError(f"timed out after {timeout:.0f}s waiting for {what}")


# -- FSx data repository association (FSX_IMPORT_PATH) ---------------------------------------------------------------
# An association links FSX_IMPORT_PATH to /data on the file system (where `csi.data.stage` would copy to): listings
# come in at once, file contents on first read (lazy load). Made once per file system, tagged with the cluster,
# removed on delete. Every deployment type doeks offers takes one on Lustre 2.15, the version fsx-sc asks for (FSx
# service model in botocore 1.43, CreateDataRepositoryAssociation: "supported on all FSx for Lustre 2.12 and 2.15 file
# systems, excluding scratch_1 deployment type"; at most 8 per file system).
DRA_FILE_SYSTEM_PATH = "/data"
DRA_EVENTS = ["NEW", "CHANGED", "DELETED"]


def claim_file_system(settings, core=None, timeout: float = 1800, interval: float = 10) -> str:
    """The FSx file system id behind the shared PVC, once the claim is bound: the PV's csi.volumeHandle (the FSx
    CSI driver's controller returns the file system id as the volume id: aws-fsx-csi-driver
    pkg/driver/controller.go CreateVolume, VolumeId: fs.FileSystemId, chart 1.11.0). Dynamic provisioning creates
    the file system first, which takes minutes."""
    if core is None:
        from .kube import client

        core = client()
    deadline = time.monotonic() + timeout
    with ui.progress(transient=True) as bar:
        bar.add_task(f"waiting for PVC {settings.shared_pvc} to bind (FSx provisioning takes minutes)", total=None)
        while True:
            claim = core.read_namespaced_persistent_volume_claim(settings.shared_pvc, settings.namespace, _request_timeout=10)
            if claim.status and claim.status.phase == "Bound" and claim.spec.volume_name:
                volume = core.read_persistent_volume(claim.spec.volume_name, _request_timeout=10)
                csi = volume.spec.csi
                if csi is None or csi.driver != "fsx.csi.aws.com":
                    raise DoeksError(f"PVC {settings.shared_pvc} is bound to {claim.spec.volume_name}, which is not an FSx volume")
                return csi.volume_handle
            if time.monotonic() > deadline:
                raise DoeksError(f"PVC {settings.shared_pvc} did not bind in {timeout:.0f} s: look at "
                                 f"`kubectl describe pvc {settings.shared_pvc} -n {settings.namespace}`")
            time.sleep(interval)


def _associations(fsx, file_system_id: str | None = None) -> list[dict[str, Any]]:
    kwargs: dict[str, Any] = {"Filters": [{"Name": "file-system-id", "Values": [file_system_id]}]} if file_system_id else {}
    found = []
    while True:
        page = fsx.describe_data_repository_associations(**kwargs)
        found += page.get("Associations", [])
        if not page.get("NextToken"):
            return found
        kwargs["NextToken"] = page["NextToken"]


def fsx_associate(settings, runner, file_system_id: str, fsx=None) -> str | None:
    """Link FSX_IMPORT_PATH to /data on `file_system_id`, once: an association already there is kept."""
    fsx = fsx or _client(settings, "fsx")
    path = settings.fsx_import_path.rstrip("/") + "/"
    if not file_system_id.startswith("<"):  # a dry run of a dynamic file system knows no id yet
        for association in _associations(fsx, file_system_id):
            if association.get("FileSystemPath", "").rstrip("/") != DRA_FILE_SYSTEM_PATH:
                continue
            if association["DataRepositoryPath"].rstrip("/") + "/" != path:
                raise DoeksError(f"{DRA_FILE_SYSTEM_PATH} on {file_system_id} is linked to {association['DataRepositoryPath']} "
                                 f"already, not FSX_IMPORT_PATH={settings.fsx_import_path}: delete that association first")
            if association["Lifecycle"] in ("DELETING", "FAILED"):
                raise DoeksError(f"data repository association {association['AssociationId']} is {association['Lifecycle']}: "
                                 "wait until it is gone (or delete it), then deploy again")
            ui.say(f"data repository association {association['AssociationId']} ({path} -> {DRA_FILE_SYSTEM_PATH}) "
                   f"exists: {association['Lifecycle']}")
            return association["AssociationId"]
    created = runner.call(fsx, "create_data_repository_association", FileSystemId=file_system_id,
                          FileSystemPath=DRA_FILE_SYSTEM_PATH, DataRepositoryPath=path, BatchImportMetaDataOnCreate=True,
                          S3={"AutoImportPolicy": {"Events": DRA_EVENTS}},
                          ClientRequestToken=f"doeks-{settings.cluster_name}-{file_system_id}"[:63],
                          Tags=[{"Key": TAG, "Value": settings.cluster_name}])
    if created:
        association = created["Association"]
        ui.say(f"data repository association {association['AssociationId']}: {path} -> {DRA_FILE_SYSTEM_PATH} on "
               f"{file_system_id} ({association['Lifecycle']}; files appear as their metadata is imported)")
        return association["AssociationId"]
    return None


def fsx_dissociate(settings, runner, fsx=None) -> int:
    """Delete every association tagged with this cluster (the data in S3 and on the file system stay); safe twice."""
    from .aws import lookup

    fsx = fsx or _client(settings, "fsx")
    known = lookup(runner, "FSx data repository associations", lambda: _associations(fsx), None)
    if known is None:  # a dry run without credentials: the step, with the ids unknown
        runner.call(fsx, "delete_data_repository_association", AssociationId=f"<each association tagged {TAG}={settings.cluster_name}>",
                    DeleteDataInFileSystem=False)
        return 0
    ours = [a for a in known if {"Key": TAG, "Value": settings.cluster_name} in a.get("Tags", [])]
    if not ours:
        ui.say(f"no data repository association of cluster {settings.cluster_name}")
    deleted = 0
    for association in ours:
        if association["Lifecycle"] == "DELETING":
            ui.say(f"data repository association {association['AssociationId']} is being deleted already")
            continue
        try:
            runner.call(fsx, "delete_data_repository_association", AssociationId=association["AssociationId"],
                        DeleteDataInFileSystem=False)
            deleted += 1
        except fsx.exceptions.DataRepositoryAssociationNotFound:
            ui.say(f"data repository association {association['AssociationId']} is gone already")
    return deleted


# -- data staged on the cluster (csi.data.stage on a cluster, `up`'s elasticjob step) ----------------------------------
def stage_manifests(settings, source: str, relayout_val: bool) -> list[dict[str, Any]]:
    """The staging Job's service account (its Pod Identity association gives it S3 read) and the Job."""
    from . import identity

    return [identity.service_account(settings, identity.get("data-stage")), stage_job(settings, source, relayout_val)]


def stage_job(settings, source: str, relayout_val: bool) -> dict[str, Any]:
    """The Kubernetes Job that stages data on the cluster, in the training image (TRAIN_IMAGE: it has doeks'
    datastage), as the doeks-stage service account, with the shared PVC mounted."""
    from . import identity, trainimage

    s = settings
    image = trainimage.reference(s, on_this_machine=False)
    args = ["python", "-m", "doeks.datastage", source, f"{s.shared_mount}/data", "--threads", str(s.stage_threads)]
    if relayout_val:
        args.append("--relayout-val")
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{s.job_name}-stage", "namespace": s.namespace, "labels": {"app.kubernetes.io/part-of": "doeks"}},
            # `up` deletes it once complete (its finished pod would keep the claim); the TTL is the backstop
            "spec": {"backoffLimit": 3, "ttlSecondsAfterFinished": 600, "template": {"spec": {
                "restartPolicy": "OnFailure", "serviceAccountName": identity.get("data-stage").service_account,
                "containers": [{"name": "stage", "image": image, "command": args,
                                "env": [{"name": "AWS_REGION", "value": s.aws_region}],
                                # a request, not a limit: the stager uses what CPU is idle; 2 never fit a node
                                # with 2 allocatable (the rehearsal's: Pending, and `up` waited on it for hours)
                                "resources": {"requests": {"cpu": "1", "memory": "2Gi"}},
                                "volumeMounts": [{"name": "shared", "mountPath": s.shared_mount}]}],
                "volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": s.shared_pvc}}]}}}}


def stage_on_cluster(settings, runner, source: str, relayout_val: bool, session=None) -> None:
    """The staging Job applied on the cluster, with S3 read on the data prefix for its service account. `session`
    (the target's pod_session) gives the name of a Secret its pods read their AWS session from (envFrom), or None where
    the cluster hands it to them (EKS Pod Identity's agent); it is called once the service account exists."""
    from . import identity, kube

    workload = identity.get("data-stage")
    identity.ensure(settings, runner, workload)
    manifests = stage_manifests(settings, source, relayout_val)
    job = next(m for m in manifests if m["kind"] == "Job")
    rest = manifests
    if session is not None and not runner.dry_run:
        kube.apply(runner, [m for m in manifests if m["kind"] == "ServiceAccount"])
        rest = [job]
        secret = session(runner, workload)  # applied without being printed: the manifests below name it only
        if secret:
            for container in job["spec"]["template"]["spec"]["containers"]:
                container.setdefault("envFrom", []).append({"secretRef": {"name": secret}})
    # a Job's pod template cannot change ("field is immutable"): a previous staging Job (another image after a code
    # change, another source) is deleted first, with its pods
    kube.delete(runner, [job])
    kube.apply(runner, rest)

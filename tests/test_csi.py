"""csi: EFS and FSx against a real moto server process (EC2, EFS, FSx, IAM, EKS) with kubectl and helm as
recorded-argv stand-ins (no Kubernetes API server here); manifests validated with kubernetes-validate; data staging
from moto's S3 into the local volume, for real."""
from __future__ import annotations

import json
import os
import shutil

import boto3
import pytest
import yaml

from doeks import datastage, storage
from doeks import settings as S
from doeks import services

from . import moto_eks
from .conftest import ROOT, invoke
from .test_jobspec import k8s_validate


@pytest.fixture
def cloud(state_dir, tmp_path):
    """moto with a VPC (two private subnets, one public), a cluster security group and an EKS cluster."""
    server = moto_eks.server(state_dir)  # moto + the EKS Pod Identity and add-on operations moto lacks
    server.start()
    kw = dict(endpoint_url=server.endpoint(), region_name="us-west-2", aws_access_key_id="testing", aws_secret_access_key="testing")
    ec2 = boto3.client("ec2", **kw)
    vpc = ec2.create_vpc(CidrBlock="10.2.0.0/16")["Vpc"]["VpcId"]
    private = [ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.2.{i}.0/24", AvailabilityZone=f"us-west-2{z}")["Subnet"]["SubnetId"]
               for i, z in ((1, "a"), (2, "b"))]
    public = ec2.create_subnet(VpcId=vpc, CidrBlock="10.2.3.0/24", AvailabilityZone="us-west-2a")["Subnet"]["SubnetId"]
    ec2.modify_subnet_attribute(SubnetId=public, MapPublicIpOnLaunch={"Value": True})
    cluster_sg = ec2.create_security_group(GroupName="eks-cluster", Description="cluster", VpcId=vpc)["GroupId"]
    # a decoy: another file system in the region that doeks must not touch
    decoy = boto3.client("efs", **kw).create_file_system(CreationToken="someone-else", Encrypted=False)["FileSystemId"]
    boto3.client("eks", **kw).create_cluster(name="doeks", roleArn="arn:aws:iam::123456789012:role/eks",
                                             resourcesVpcConfig={"subnetIds": private + [public], "securityGroupIds": [cluster_sg]})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("kubectl", "helm"):
        shutil.copy(ROOT / "tests" / "recorder.py", bin_dir / tool)
    record = tmp_path / "record.jsonl"
    env = {"TARGET": "eks", "AWS_ENDPOINT_URL": server.endpoint(), "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(record), "COLUMNS": "200"}
    yield {"env": env, "kw": kw, "vpc": vpc, "private": private, "public": public, "cluster_sg": cluster_sg,
           "decoy": decoy, "record": record}
    server.stop()


def recorded(cloud):
    path = cloud["record"]
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_efs_create_is_scoped_encrypted_idempotent_and_destroy_leaves_nothing(cloud, state_dir):
    env, kw = cloud["env"], cloud["kw"]
    for _ in range(2):
        result = invoke("csi.efs.create", env=env)
        assert result.returncode == 0, result.stderr
    efs, ec2 = boto3.client("efs", **kw), boto3.client("ec2", **kw)
    mine = [f for f in efs.describe_file_systems()["FileSystems"] if f["CreationToken"] == "doeks-doeks"]
    assert len(mine) == 1 and mine[0]["Encrypted"] is True
    targets = efs.describe_mount_targets(FileSystemId=mine[0]["FileSystemId"])["MountTargets"]
    assert sorted(t["SubnetId"] for t in targets) == sorted(cloud["private"])  # private subnets only, one per AZ
    group = ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["doeks-efs-doeks"]}])["SecurityGroups"][0]
    rules = group["IpPermissions"]
    assert len(rules) == 1 and rules[0]["FromPort"] == 2049 and rules[0]["ToPort"] == 2049
    assert rules[0]["UserIdGroupPairs"][0]["GroupId"] == cloud["cluster_sg"] and not rules[0].get("IpRanges")

    refused = invoke("csi.efs.destroy", env=env)
    assert refused.returncode == 1 and "--yes" in refused.stderr
    for _ in range(2):
        assert invoke("csi.efs.destroy", "--yes", env=env).returncode == 0
    left = [f["FileSystemId"] for f in efs.describe_file_systems()["FileSystems"]]
    assert left == [cloud["decoy"]]  # ours is gone, the decoy untouched
    assert not ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["doeks-efs-doeks"]}])["SecurityGroups"]


def test_efs_deploy_dry_run_manifests_validate(cloud, state_dir):
    env = cloud["env"]
    assert invoke("csi.efs.create", env=env).returncode == 0
    result = invoke("csi.efs.deploy", "--dry-run", env=env)
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert [d["kind"] for d in docs] == ["StorageClass", "PersistentVolume", "PersistentVolumeClaim"]
    for doc in docs:
        k8s_validate(doc)
    assert docs[2]["spec"]["accessModes"] == ["ReadWriteMany"] and docs[2]["metadata"]["name"] == "efs-pvc"
    assert docs[0]["parameters"]["fileSystemId"].startswith("fs-")
    assert "would call: eks.create_addon" in result.stderr and "AmazonEFSCSIDriverPolicy" in result.stderr


def test_fsx_deploy_then_delete_reverses_everything(cloud, state_dir):
    env, kw = cloud["env"], cloud["kw"]
    for _ in range(2):
        result = invoke("csi.fsx.deploy", env=env)
        assert result.returncode == 0, result.stderr
    calls = recorded(cloud)
    helm = [c for c in calls if c["tool"] == "helm"]
    assert helm and "--version" in helm[0]["argv"] and storage.FSX_CHART_VERSION in helm[0]["argv"]
    applied = [d for c in calls if c["tool"] == "kubectl" for d in yaml.safe_load_all(c["stdin"]) if d]
    storage_class = next(d for d in applied if d["kind"] == "StorageClass")
    for doc in applied:
        k8s_validate(doc)
    assert storage_class["parameters"]["subnetId"] == cloud["private"][0]  # the GPU nodes' AZ (us-west-2a), private
    assert storage_class["parameters"]["deploymentType"] == "PERSISTENT_2"
    ec2, iam = boto3.client("ec2", **kw), boto3.client("iam", **kw)
    group = ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["doeks-fsx-doeks"]}])["SecurityGroups"]
    assert len(group) == 1 and storage_class["parameters"]["securityGroupIds"] == group[0]["GroupId"]
    ports = sorted((p["FromPort"], p["ToPort"]) for p in group[0]["IpPermissions"])
    assert (988, 988) in ports and (1018, 1023) in ports
    policy = iam.get_role_policy(RoleName="doeks-doeks-us-west-2-fsx-csi", PolicyName="doeks-fsx-csi")["PolicyDocument"]
    assert not any(a in ("*", "fsx:*") for st in policy["Statement"] for a in ([st["Action"]] if isinstance(st["Action"], str) else st["Action"]))

    unsure = invoke("csi.fsx.delete", env=env)  # no cluster API here: it cannot tell whether the PVC is bound
    assert unsure.returncode == 1 and "--force" in unsure.stderr
    for _ in range(2):
        gone = invoke("csi.fsx.delete", "--force", env=env)
        assert gone.returncode == 0, gone.stderr
    assert not ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["doeks-fsx-doeks"]}])["SecurityGroups"]
    with pytest.raises(iam.exceptions.NoSuchEntityException):
        iam.get_role(RoleName="doeks-doeks-us-west-2-fsx-csi")
    deleted = [d["kind"] for c in recorded(cloud) if c["tool"] == "kubectl" and "delete" in c["argv"] for d in yaml.safe_load_all(c["stdin"]) if d]
    assert "PersistentVolumeClaim" in deleted and "StorageClass" in deleted


def test_fsx_delete_refuses_a_claim_pods_use_without_force(cloud, state_dir, monkeypatch):
    """Refused while pods use the claim, not because it is Bound (a provisioned claim always is: tests/test_teardown.py)."""
    from doeks.errors import DoeksError
    from doeks.runner import Runner

    for key, value in cloud["env"].items():
        monkeypatch.setenv(key, value)
    s = S.load()
    with pytest.raises(DoeksError, match="used by pod"):
        storage.fsx_delete(s, Runner(echo=False), force=False, in_use=["imagenet-worker-0"])


@pytest.mark.parametrize("key,value", [("FSX_STORAGE_CAPACITY", "1000"), ("FSX_STORAGE_CAPACITY", "3600"),
                                       ("FSX_THROUGHPUT", "300"), ("FSX_SUBNET_ID", "subnet-xyz"), ("STAGE_THREADS", "0")])
def test_bad_sizes_throughputs_subnets_are_refused(key, value, state_dir):
    result = invoke("csi.fsx.deploy", "--dry-run", env={"TARGET": "eks", key: value})
    assert result.returncode == 1 and result.stderr.startswith(f"error: {key}=") and "Traceback" not in result.stderr


def test_fsx_subnet_outside_the_cluster_is_refused(cloud, state_dir):
    env = {**cloud["env"], "FSX_SUBNET_ID": cloud["public"]}
    result = invoke("csi.fsx.deploy", env=env)
    assert result.returncode == 1 and "FSX_SUBNET_ID=" in result.stderr
    assert not recorded(cloud)  # nothing applied


def test_stage_from_s3_is_parallel_resumable_verified(cloud, state_dir):
    kw = cloud["kw"]
    s3 = boto3.client("s3", **kw)
    s3.create_bucket(Bucket="doeks-training", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    for i in range(60):
        s3.put_object(Bucket="doeks-training", Key=f"data/imagenet/train/n{i % 3:08d}/img{i}.JPEG", Body=os.urandom(500 + i))
    env = {"AWS_ENDPOINT_URL": kw["endpoint_url"], "STAGE_THREADS": "8"}
    first = invoke("csi.data.stage", env=env)
    assert first.returncode == 0, first.stderr
    assert "60 downloaded, 0 already there" in first.stderr
    target = state_dir / "volumes" / "fsx-pvc" / "data" / "train"
    assert len(list(target.rglob("*.JPEG"))) == 60
    assert (target / "n00000001" / "img4.JPEG").stat().st_size == 504
    (target / "n00000000" / "img0.JPEG").unlink()  # an interrupted copy: resumable
    (target / "n00000000" / "img3.JPEG").write_bytes(b"short")  # a wrong size is fetched again
    second = invoke("csi.data.stage", env=env)
    assert second.returncode == 0 and "2 downloaded, 58 already there" in second.stderr
    missing = invoke("csi.data.stage", "--source", "s3://doeks-training/nothing", env=env)
    assert missing.returncode == 1 and "nothing under" in missing.stderr


def test_val_relayout_works_for_any_mount_path(tmp_path):
    root = tmp_path / "any" / "mount"
    (root / "val").mkdir(parents=True)
    rows = ["ImageId,PredictionString"]
    for i, label in enumerate(["n01440764", "n01443537", "n01440764"]):
        (root / "val" / f"ILSVRC2012_val_{i:08d}.JPEG").write_bytes(b"x")
        rows.append(f"ILSVRC2012_val_{i:08d},{label} 1 2 3 4")
    (root / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")
    assert datastage.relayout_val(root) == 3
    assert len(list((root / "val" / "n01440764").iterdir())) == 2
    assert datastage.relayout_val(root) == 0  # idempotent


def test_stage_job_manifest_validates_on_eks(state_dir):
    result = invoke("csi.data.stage", "--dry-run", env={"TARGET": "eks"})
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    for doc in docs:
        k8s_validate(doc)
    job = next(d for d in docs if d["kind"] == "Job")  # after its ServiceAccount (identity: tests/test_identity.py)
    assert job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "fsx-pvc"

"""Teardown with proof: `invoke down` (TARGET=eks) deletes in dependency order, waiting until each thing is gone, and
`invoke audit` is 0 afterwards: after up -> down, after an `up` killed mid-way -> down, after down twice.

moto is the account (with the EKS Pod Identity and add-on operations it lacks, tests/moto_eks.py); eksctl, kubectl
and helm are stand-ins (tests/cluster_standins.py) whose `eksctl delete cluster` fails with DependencyViolation while
anything doeks made is left in the VPC, as eksctl's CloudFormation stack does on a real account.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import boto3
import pytest
import yaml

from doeks import identity, storage
from doeks import settings as S
from doeks.errors import DoeksError
from doeks.runner import Runner

from . import moto_eks
from .conftest import ROOT, invoke

SMALL = {"GPU_NODES_MAX": "1", "GPU_NODES": "1", "GPU_NODES_MIN": "0", "GPU_INSTANCE_TYPE": "g5.xlarge",
         # what a first run needs besides (issue 23): an image the nodes pull, data in S3 that `up` stages
         "TRAIN_IMAGE": "123456789012.dkr.ecr.us-west-2.amazonaws.com/doeks-train:1", "S3_BUCKET": "teardown-data"}


@pytest.fixture
def account(state_dir, tmp_path):
    server = moto_eks.server(state_dir)
    server.start()
    kw = dict(endpoint_url=server.endpoint(), region_name="us-west-2", aws_access_key_id="testing", aws_secret_access_key="testing")
    s3 = boto3.client("s3", **kw)
    s3.create_bucket(Bucket=SMALL["S3_BUCKET"], CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    s3.put_object(Bucket=SMALL["S3_BUCKET"], Key="data/imagenet/train/n01440764/a.JPEG", Body=b"x")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("eksctl", "kubectl", "helm"):
        shutil.copy(ROOT / "tests" / "cluster_standins.py", bin_dir / tool)
        os.chmod(bin_dir / tool, 0o755)
    env = {"TARGET": "eks", "AWS_ENDPOINT_URL": server.endpoint(), "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_REGION": "us-west-2", "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(tmp_path / "record.jsonl"),
           "PODS": str(tmp_path / "pods.json"), "COLUMNS": "200", **SMALL}
    yield {"env": env, "kw": kw, "tmp": tmp_path}
    server.stop()


def calls(account) -> list[dict]:
    path = account["tmp"] / "record.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def extras(account):
    """What the default `up` does not make but a user does: EFS (csi.efs.create/deploy), the S3 gateway endpoint."""
    for args in (("csi.efs.create",), ("csi.efs.deploy",), ("sagemaker.s3-endpoint",)):
        result = invoke(*args, env=account["env"])
        assert result.returncode == 0, (args, result.stderr)


def simulate_driver_file_system(account):
    """What the FSx CSI driver makes for fsx-pvc (CreateVolume): a file system tagged through the StorageClass's extraTags."""
    kw = account["kw"]
    eks, ec2 = boto3.client("eks", **kw), boto3.client("ec2", **kw)
    subnet = eks.describe_cluster(name="doeks")["cluster"]["resourcesVpcConfig"]["subnetIds"][0]
    group = ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["doeks-fsx-doeks"]}])["SecurityGroups"][0]["GroupId"]
    return boto3.client("fsx", **kw).create_file_system(
        FileSystemType="LUSTRE", StorageCapacity=1200, SubnetIds=[subnet], SecurityGroupIds=[group],
        LustreConfiguration={"DeploymentType": "PERSISTENT_2", "PerUnitStorageThroughput": 250},
        Tags=[{"Key": "CSIVolumeName", "Value": "pvc-1"}, {"Key": "doeks/cluster", "Value": "doeks"}])["FileSystem"]["FileSystemId"]


def audit(account):
    return invoke("audit", env=account["env"])


@pytest.mark.slow
def test_up_down_audit_is_zero_and_down_twice_too(account):
    env = account["env"]
    up = invoke("up", "--yes", env=env)
    assert up.returncode == 0, up.stderr[-3000:]
    # the staging Job: a previous one deleted first (a Job's template is immutable), applied, waited for, then
    # deleted by `up` itself with its pod (a finished pod keeps the claim: issue 31, failure 1)
    staging = [(c["argv"][0], d["metadata"]["name"]) for c in calls(account) if c["tool"] == "kubectl"
               and c["argv"][:1] in (["apply"], ["delete"]) for d in yaml.safe_load_all(c["stdin"]) if d and d["kind"] == "Job"]
    assert staging == [("delete", "imagenet-stage"), ("apply", "imagenet-stage"), ("delete", "imagenet-stage")], staging
    extras(account)
    fs = simulate_driver_file_system(account)
    # what `up` makes when it pushes the training image itself (no TRAIN_IMAGE): this cluster's ECR repository
    from doeks import trainimage

    trainimage.ensure_repository(S.load(environ=env, path=ROOT / ".env"), Runner(echo=False))
    left = audit(account)
    assert left.returncode == 1
    for expected in ("eks cluster", "fsx lustre", fs, "efs", "vpc endpoint", "iam role", "security group", "pod identity",
                     "ecr repository", "doeks-train", "log group", "/aws/containerinsights/doeks/performance"):
        assert expected in left.stdout + left.stderr, expected
    assert "$0.345" in left.stdout + left.stderr  # 1200 GiB PERSISTENT_2/250 at $0.21 per GB-month; priced where known (cluster, FSx per TiB, nodes)

    down = invoke("down", "--yes", env=env)
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-3000:]
    result = audit(account)
    assert result.returncode == 0, result.stdout + result.stderr
    again = invoke("down", "--yes", env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert audit(account).returncode == 0


@pytest.mark.slow
def test_up_killed_midway_then_down_leaves_nothing(account):
    env = account["env"]
    eks = boto3.client("eks", **account["kw"])
    process = subprocess.Popen([sys.executable, "-m", "invoke", "up", "--yes"], cwd=ROOT, env={**os.environ, **env},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # kill it as soon as the cluster exists and csi has made its role
        roles = [r["RoleName"] for r in boto3.client("iam", **account["kw"]).list_roles()["Roles"]]
        if eks.list_clusters()["clusters"] and any(r.startswith("doeks-doeks-us-west-2-") for r in roles):
            break
        time.sleep(0.2)
    process.kill()
    process.wait()
    assert audit(account).returncode == 1
    down = invoke("down", "--yes", env=env)
    assert down.returncode == 0, down.stderr[-3000:]
    result = audit(account)
    assert result.returncode == 0, result.stdout + result.stderr


def test_down_dry_run_prints_every_deletion_in_reverse_dependency_order(account):
    result = invoke("down", "--dry-run", env=account["env"])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("would ")]
    text = "\n".join(lines)

    def first(fragment):
        index = next((i for i, line in enumerate(lines) if fragment in line), None)
        assert index is not None, f"{fragment!r} not in the plan:\n{text}"
        return index

    claim = first("delete PersistentVolumeClaim default/fsx-pvc")  # jobs (elasticjob), then claims ...
    order = [first("delete PyTorchJob default/imagenet"), claim,
             first("FSx file systems tagged doeks/cluster=doeks"),
             first("helm uninstall aws-fsx-csi-driver"),
             first('delete_pod_identity_association {"associationId": "<kube-system/fsx-csi-controller-sa>"'),
             first('delete_role {"RoleName": "doeks-doeks-us-west-2-fsx-csi"}'),
             first("doeks-fsx-doeks"),
             first("delete StorageClass efs-sc"),  # the account has no EFS: its file system is not planned (see below)
             first("ec2.delete_vpc_endpoints"),
             first('delete_addon {"addonName": "aws-ebs-csi-driver"'),
             first("run: eksctl delete cluster")]
    assert order == sorted(order), text
    for workload in identity.WORKLOADS:  # every role `up` implies
        assert f'"RoleName": "{identity.role_name(S.load(), workload)}"' in text, workload.key


def test_fsx_delete_keeps_role_and_group_until_the_driver_deleted_its_file_system(account, monkeypatch):
    """--force used to delete the driver's role and security group right after the claim, without waiting for the
    PV's DeleteVolume: the controller lost its identity, DeleteFileSystem was never called, the group was in use."""
    env, kw = account["env"], account["kw"]
    assert invoke("eks.create", env=env).returncode == 0
    assert invoke("csi.fsx.deploy", env=env).returncode == 0
    fs = simulate_driver_file_system(account)
    os.environ.pop("PODS", None)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", env["PATH"].replace(str(account["tmp"] / "bin"), str(account["tmp"] / "nodriver")))
    (account["tmp"] / "nodriver").mkdir()
    for tool in ("kubectl", "helm"):  # a cluster whose driver does not get to delete the file system
        shutil.copy(ROOT / "tests" / "recorder.py", account["tmp"] / "nodriver" / tool)
    monkeypatch.setattr(storage, "WAIT_TIMEOUT", 3, raising=False)
    s = S.load()
    with pytest.raises(DoeksError, match="timed out"):
        storage.fsx_delete(s, Runner(echo=False), force=True)
    iam, ec2 = boto3.client("iam", **kw), boto3.client("ec2", **kw)
    assert iam.get_role(RoleName="doeks-doeks-us-west-2-fsx-csi")  # the controller keeps its identity while its volume exists
    assert ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["doeks-fsx-doeks"]}])["SecurityGroups"]
    boto3.client("fsx", **kw).delete_file_system(FileSystemId=fs)  # the driver's DeleteVolume
    storage.fsx_delete(s, Runner(echo=False), force=True)
    with pytest.raises(iam.exceptions.NoSuchEntityException):
        iam.get_role(RoleName="doeks-doeks-us-west-2-fsx-csi")
    assert not ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["doeks-fsx-doeks"]}])["SecurityGroups"]


@pytest.mark.slow
def test_claim_is_refused_only_while_pods_use_it(account):
    env = account["env"]
    assert invoke("eks.create", env=env).returncode == 0
    assert invoke("csi.fsx.deploy", env=env).returncode == 0
    (account["tmp"] / "pods.json").write_text(json.dumps([
        {"metadata": {"name": "imagenet-worker-0"}, "status": {"phase": "Running"},
         "spec": {"volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": "fsx-pvc"}}]}},
        {"metadata": {"name": "old-stage"}, "status": {"phase": "Succeeded"},
         "spec": {"volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": "fsx-pvc"}}]}}]))
    used = invoke("csi.fsx.delete", env=env)
    assert used.returncode == 1 and "imagenet-worker-0" in used.stderr and "old-stage" not in used.stderr
    (account["tmp"] / "pods.json").write_text("[]")  # the claim is Bound, but no pod uses it: delete it
    free = invoke("csi.fsx.delete", env=env)
    assert free.returncode == 0, free.stderr


def test_down_dry_run_names_each_object_once_and_plans_only_what_may_exist(account):
    result = invoke("down", "--dry-run", env=account["env"])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("would ")]
    text = "\n".join(lines)
    assert len(lines) == len(set(lines)), text  # csi's roles once, not again under eks
    assert not [line for line in lines if line.endswith("-f -")], text  # every kubectl delete names its objects
    for named in ("delete PyTorchJob default/imagenet", "delete PersistentVolumeClaim default/fsx-pvc",
                  "delete StorageClass fsx-sc", "delete DaemonSet kube-system/aws-efa-k8s-device-plugin-daemonset"):
        assert named in text, f"{named!r} not in the plan:\n{text}"
    # the account has no EFS (up never makes one): its lookup answered, so no EFS deletion is planned
    assert "efs.delete_file_system" not in text and "efs.delete_mount_target" not in text, text
    assert "no EFS for cluster doeks" in result.stderr

    blind = invoke("down", "--dry-run", env={**account["env"], "AWS_ENDPOINT_URL": "", "AWS_ACCESS_KEY_ID": "",
                                             "AWS_SECRET_ACCESS_KEY": "", "AWS_EC2_METADATA_DISABLED": "true",
                                             "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"})
    assert blind.returncode == 0, blind.stderr[-3000:]
    assert "unknown: EFS doeks-doeks" in blind.stderr  # the lookup cannot be made: it may exist, and the plan says so
    assert "efs.delete_file_system" in blind.stderr and "<EFS doeks-doeks, if any>" in blind.stderr


def test_down_removes_the_kubeflow_platform_that_kubeflow_deploy_installed(account, state_dir):
    """Likely failure (issue 31): `down` deleted the training operator only; a Kubeflow platform `kubeflow.deploy`
    installed stayed on the cluster until eksctl deleted it, and on EKS its databases' claims are EBS volumes that
    outlive the cluster. Now `down` removes it (bounded wait) before the cluster goes; a platform doeks labelled whose
    overlay is not in this STATE_DIR fails the kubeflow step, so the cluster is kept. (The platform itself cannot be
    deployed here: it is fetched from GitHub; the overlay `kubeflow.deploy` writes is what doeks deletes by.)"""
    env = account["env"]
    overlay = state_dir / "kubeflow" / "overlay"
    overlay.mkdir(parents=True)
    (overlay / "kustomization.yaml").write_text("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n")
    plan = invoke("down", "--dry-run", env=env)
    assert plan.returncode == 0, plan.stderr[-3000:]
    lines = [line for line in plan.stderr.splitlines() if line.startswith("would ")]
    platform = [i for i, line in enumerate(lines) if f"-k {overlay}" in line and "kubectl delete" in line]
    cluster = [i for i, line in enumerate(lines) if "eksctl delete cluster" in line]
    assert platform and cluster and platform[0] < cluster[0], "\n".join(lines)
    assert "--timeout=900s" in lines[platform[0]]

    down = invoke("down", "--yes", env=env)
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-3000:]
    argvs = [c["argv"] for c in calls(account) if c["tool"] in ("kubectl", "eksctl")]
    removed = [i for i, a in enumerate(argvs) if a[:1] == ["delete"] and a[-2:] == ["-k", str(overlay)]]
    deleted = [i for i, a in enumerate(argvs) if a[:2] == ["delete", "cluster"]]
    assert removed and "--timeout=900s" in argvs[removed[0]] and (not deleted or removed[0] < deleted[0]), argvs

    shutil.rmtree(overlay)  # deployed from elsewhere: doeks' label on istio-system, no overlay here
    (account["tmp"] / "namespaces.json").write_text(json.dumps({"istio-system": {"app.kubernetes.io/part-of": "kubeflow"}}))
    assert invoke("eks.create", env=env).returncode == 0
    kept = invoke("down", "--yes", env={**env, "NAMESPACES": str(account["tmp"] / "namespaces.json")})
    assert kept.returncode == 1 and "a Kubeflow platform deployed by doeks is on the cluster" in kept.stderr, kept.stderr
    assert "not deleting cluster doeks: kubeflow failed" in kept.stderr
    assert boto3.client("eks", **account["kw"]).list_clusters()["clusters"] == ["doeks"]


@pytest.mark.slow
def test_down_deletes_the_finished_staging_job_that_holds_the_claim(account):
    """Failure 1 (issue 31): the staging Job (`<job>-stage`, kept 24 h by its TTL) left a Completed pod that still
    holds the claim (claim protection counts it: tests/test_rehearsal_cluster.py shows it on a real API server), and
    `down` deleted the claim with an unbounded waiting delete: it hung in csi.delete while the GPU nodes billed. The
    EKS path (storage.fsx_delete) now deletes doeks' Jobs that mount the claim, with their pods, before the claim.
    Stand-ins: the FSx CSI driver and its claim need AWS, so the cluster is tests/cluster_standins.py's, which keeps
    the Job and its Completed pod, takes the pods with the Job, and fails a waiting delete of a held claim at once."""
    env, tmp = account["env"], account["tmp"]
    assert invoke("eks.create", env=env).returncode == 0
    assert invoke("csi.fsx.deploy", env=env).returncode == 0
    volume = {"name": "shared", "persistentVolumeClaim": {"claimName": "fsx-pvc"}}
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": {"name": "imagenet-stage", "namespace": "default", "labels": {"app.kubernetes.io/part-of": "doeks"}},
           "spec": {"template": {"spec": {"volumes": [volume]}}},
           "status": {"conditions": [{"type": "Complete", "status": "True"}], "succeeded": 1}}
    pod = {"metadata": {"name": "imagenet-stage-x7k2p", "namespace": "default",
                        "labels": {"batch.kubernetes.io/job-name": "imagenet-stage"}},
           "spec": {"nodeName": "ip-10-0-1-17.us-west-2.compute.internal", "volumes": [volume]},
           "status": {"phase": "Succeeded"}}
    (tmp / "jobs.json").write_text(json.dumps([job]))
    (tmp / "pods.json").write_text(json.dumps([pod]))
    down = invoke("down", "--yes", env={**env, "JOBS": str(tmp / "jobs.json")})
    assert down.returncode == 0, down.stdout[-2000:] + down.stderr[-3000:]
    deleted = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for c in calls(account)
               if c["argv"][:1] == ["delete"] for d in yaml.safe_load_all(c["stdin"]) if d]
    job, claim = ("Job", "default", "imagenet-stage"), ("PersistentVolumeClaim", "default", "fsx-pvc")
    assert job in deleted and deleted.index(job) < deleted.index(claim), deleted
    assert json.loads((tmp / "pods.json").read_text()) == []  # its pod went with it
    assert boto3.client("eks", **account["kw"]).list_clusters()["clusters"] == []
    result = audit(account)
    assert result.returncode == 0, result.stdout + result.stderr

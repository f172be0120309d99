"""Issue 23: what a first run on a real AWS account needs, read against upstream (versions, names, zones, regional
registries, images, teardown). Each test failed on the code before its fix."""
from __future__ import annotations

import datetime as dt

import boto3
import pytest
from botocore.stub import Stubber

from doeks import catalog, eks, identity
from doeks import settings as S
from doeks.errors import DoeksError, SettingsError

from .conftest import ROOT

TODAY = dt.date(2026, 11, 23)


def load(**env):
    return S.load(environ={k: str(v) for k, v in env.items()}, path=ROOT / ".env")


# -- (4) versions ------------------------------------------------------------------------------------------------------
def test_default_version_is_the_newest_in_standard_support():
    assert catalog.newest_standard(TODAY) == "1.35"  # 1.34 leaves standard support 2026-12-02
    assert S.KEY_BY_NAME["EKS_VERSION"].default == catalog.newest_standard(TODAY)
    assert catalog.support_phase("1.33", TODAY) == "extended"


def test_newer_versions_are_accepted_and_old_ones_refused():
    assert load(EKS_VERSION="1.35").eks_version == "1.35"
    assert load(EKS_VERSION="1.36").eks_version == "1.36"  # newer than the calendar: EKS says at `up`
    for bad in ("1.29", "2", "1.3x"):
        with pytest.raises(SettingsError, match=r"^EKS_VERSION="):
            load(EKS_VERSION=bad)


def test_amazon_linux_2_refused_from_1_33():
    assert load(EKS_VERSION="1.32", AMI_FAMILY="AmazonLinux2").ami_family == "AmazonLinux2"
    with pytest.raises(SettingsError, match=r"^AMI_FAMILY='AmazonLinux2' is not accepted: .*1\.32") as error:
        load(EKS_VERSION="1.33", AMI_FAMILY="AmazonLinux2")
    assert "\n" not in str(error.value)


def _eks_stub(versions):
    client = boto3.client("eks", region_name="us-west-2", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(client)
    stub.add_response("describe_cluster_versions", {"clusterVersions": [
        {"clusterVersion": v, "versionStatus": st} for v, st in versions]}, {"clusterType": "eks", "includeAll": True})
    stub.activate()
    return client, stub


def test_version_checked_against_what_eks_offers(monkeypatch, capsys):
    """DescribeClusterVersions (moto has none: Stubber against the service model)."""
    s = load(TARGET="eks", EKS_VERSION="1.36")
    offered = [("1.33", "EXTENDED_SUPPORT"), ("1.34", "STANDARD_SUPPORT"), ("1.35", "STANDARD_SUPPORT")]
    client, stub = _eks_stub(offered)
    monkeypatch.setattr(eks, "_client", lambda settings, service="eks": client)
    with pytest.raises(DoeksError, match=r"^EKS_VERSION=1\.36 is not offered by EKS in us-west-2: one of 1\.33, 1\.34, 1\.35$"):
        eks.check_version(s)
    client, stub = _eks_stub(offered)
    monkeypatch.setattr(eks, "_client", lambda settings, service="eks": client)
    assert eks.check_version(load(TARGET="eks", EKS_VERSION="1.33")) == "extended"
    assert "extended support" in capsys.readouterr().err


# -- (5) names ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["9job", "1"])
def test_job_name_is_a_dns_1035_label(name):
    with pytest.raises(SettingsError, match=r"^JOB_NAME=.*DNS-1035") as error:
        load(JOB_NAME=name)
    assert "\n" not in str(error.value)


def test_job_name_leaves_room_for_what_the_operators_append():
    """The longest name the operators derive (PyTorchJob Service `<job>-worker-<i>`, JobSet `<job>-node-0-<i>`) is
    a DNS-1035 label at the longest JOB_NAME and the most replicas."""
    import re

    s = load(JOB_NAME="j" * 50, MAX_REPLICAS=1000, REPLICAS=1000, MIN_REPLICAS=1)
    for derived in (f"{s.job_name}-worker-{s.max_replicas - 1}", f"{s.job_name}-node-0-{s.max_replicas - 1}"):
        assert len(derived) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", derived)


def test_role_names_of_a_long_cluster_name_stay_distinct_and_fit_iam():
    s = load(CLUSTER_NAME="c" * 60)
    names = [identity.role_name(s, w) for w in identity.WORKLOADS]
    assert len(set(names)) == len(names) and all(len(n) <= 64 for n in names)
    other = [identity.role_name(load(CLUSTER_NAME="c" * 59 + "d"), w) for w in identity.WORKLOADS]
    assert not set(names) & set(other)


# -- (3) zones ---------------------------------------------------------------------------------------------------------
def test_gpu_zone_is_one_where_the_instance_type_is_offered(monkeypatch):
    """moto models DescribeInstanceTypeOfferings: in eu-west-1 it offers p4d.24xlarge only in eu-west-1c."""
    from moto import mock_aws

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    eks._ZONES.clear()
    with mock_aws():
        s = load(TARGET="eks", AWS_REGION="eu-west-1", GPU_INSTANCE_TYPE="p4d.24xlarge")
        config = eks.cluster_config(s)
    eks._ZONES.clear()
    gpu = next(g for g in config["managedNodeGroups"] if g["name"] == "gpu")
    assert gpu["availabilityZones"] == ["eu-west-1c"]
    assert config["availabilityZones"][0] == "eu-west-1c" and len(config["availabilityZones"]) == 3


def test_zones_refused_where_the_type_is_offered_nowhere():
    s = load(TARGET="eks", AWS_REGION="eu-west-1", GPU_INSTANCE_TYPE="p5.48xlarge")
    with pytest.raises(DoeksError, match=r"^GPU_INSTANCE_TYPE=p5\.48xlarge is offered in no zone of eu-west-1"):
        eks.choose_zones(s, [], ["eu-west-1a", "eu-west-1b"])
    assert eks.choose_zones(load(AWS_REGION="us-east-1"), ["us-east-1d"], [f"us-east-1{z}" for z in "abcdef"]) == \
        (["us-east-1d", "us-east-1a"], "us-east-1d")


# -- (6) region-bound registries: one table (doeks.catalog), a case per region family -----------------------------------
REGIONS = [  # (region, EKS add-on registry, DLC registry)
    ("us-west-2", "602401143452.dkr.ecr.us-west-2.amazonaws.com", "763104351884.dkr.ecr.us-west-2.amazonaws.com"),
    ("eu-central-1", "602401143452.dkr.ecr.eu-central-1.amazonaws.com", "763104351884.dkr.ecr.eu-central-1.amazonaws.com"),
    ("ap-southeast-3", "296578399912.dkr.ecr.ap-southeast-3.amazonaws.com", "907027046896.dkr.ecr.ap-southeast-3.amazonaws.com"),
    ("af-south-1", "877085696533.dkr.ecr.af-south-1.amazonaws.com", "626614931356.dkr.ecr.af-south-1.amazonaws.com"),
    ("me-south-1", "558608220178.dkr.ecr.me-south-1.amazonaws.com", "217643126080.dkr.ecr.me-south-1.amazonaws.com"),
    ("il-central-1", "066635153087.dkr.ecr.il-central-1.amazonaws.com", "780543022126.dkr.ecr.il-central-1.amazonaws.com"),
    ("cn-north-1", "918309763551.dkr.ecr.cn-north-1.amazonaws.com.cn", "727897471807.dkr.ecr.cn-north-1.amazonaws.com.cn"),
    ("us-gov-west-1", "013241004608.dkr.ecr.us-gov-west-1.amazonaws.com", "442386744353.dkr.ecr.us-gov-west-1.amazonaws.com"),
]


@pytest.mark.parametrize("region,addon,dlc", REGIONS)
def test_images_come_from_the_regions_own_registries(region, addon, dlc):
    from doeks import efa

    s = load(TARGET="eks", AWS_REGION=region)
    plugin = efa.device_plugin(s)[0]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert plugin == f"{addon}/eks/aws-efa-k8s-device-plugin:{efa.DEVICE_PLUGIN_VERSION}"
    assert s.sagemaker_image == f"{dlc}/pytorch-training:{catalog.SAGEMAKER_DLC_TAG}"


def test_config_shows_the_derived_sagemaker_image():
    s = load(AWS_REGION="me-south-1")
    row = next(r for r in s.rows() if r[1] == "SAGEMAKER_IMAGE")
    assert row[2].startswith("217643126080.dkr.ecr.me-south-1.amazonaws.com/") and "AWS_REGION" in row[3]
    pinned = load(AWS_REGION="me-south-1", SAGEMAKER_IMAGE="my/image:1")
    assert pinned.sagemaker_image == "my/image:1"


# -- (1) the EKS training image's base needs no registry login ------------------------------------------------------------
def test_eks_training_base_is_the_public_gallery_copy(state_dir):
    from doeks import trainimage

    for region in ("us-west-2", "af-south-1"):
        base = trainimage.base_image(load(TARGET="eks", AWS_REGION=region), on_this_machine=False)
        assert base == f"public.ecr.aws/deep-learning-containers/pytorch-training:{trainimage.DLC_TAG}"


# -- (7) nccl-tests as upstream runs it -------------------------------------------------------------------------------------
def test_nccl_mpijob_follows_upstream():
    import re

    from doeks import efa

    job = efa.nccl_mpijob(load(TARGET="eks", GPU_INSTANCE_TYPE="p5.48xlarge"))
    spec = job["spec"]
    launcher, worker = spec["mpiReplicaSpecs"]["Launcher"], spec["mpiReplicaSpecs"]["Worker"]
    for pod in (launcher, worker):
        image = pod["template"]["spec"]["containers"][0]["image"]
        # the buildspec's published tags: a versioned one or `latest` (never `latest-efa`)
        assert re.fullmatch(r"public\.ecr\.aws/hpc-cloud/nccl-tests:(latest|efa[\d.]+-ofiv?[\d.]+-aws-ncclv[\d.-]+-testsv[\d.]+)", image)
    assert spec["launcherCreationPolicy"] == "WaitForWorkersReady" and launcher["restartPolicy"] == "OnFailure"
    assert spec["runPolicy"]["backoffLimit"] > 0
    pod = worker["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert next(v for v in pod["volumes"] if v["name"] == mount["name"])["emptyDir"] == {"medium": "Memory"}


# -- (8) teardown leaves shared namespaces to their owners ---------------------------------------------------------------
def test_gpu_metrics_delete_keeps_the_add_ons_namespace(state_dir, monkeypatch):
    """The task's own kube.delete call, captured."""
    import importlib.util

    from doeks import kube, taskkit

    deleted = []
    monkeypatch.setattr(kube, "delete", lambda runner, manifests: deleted.extend(manifests))
    monkeypatch.setenv("TARGET", "eks")
    S.reset()
    spec = importlib.util.spec_from_file_location("gpu_metrics_tasks", ROOT / "gpu-metrics" / "tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    try:
        tasks.delete.body(None, dry_run=True)
    finally:
        S.reset()
    assert any(d["kind"] == "DaemonSet" for d in deleted)  # the agent still goes
    assert not [d for d in deleted if d["kind"] == "Namespace"]


def test_training_operator_delete_keeps_the_shared_kubeflow_namespace(tmp_path):
    """`kubectl kustomize` over a stand-in of the v1.9.4 standalone overlay (namespace.yaml: Namespace kubeflow)."""
    import os
    import subprocess

    import yaml

    from doeks import kube, kubeflow

    base = tmp_path / "standalone"
    base.mkdir()
    docs = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kubeflow"}},
            {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {"name": "mpijobs.kubeflow.org"}},
            {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "training-operator", "namespace": "kubeflow"},
             "spec": {"template": {"spec": {"containers": [{"name": "training-operator", "image": "x"}]}}}}]
    (base / "all.yaml").write_text(yaml.safe_dump_all(docs))
    (base / "kustomization.yaml").write_text("resources:\n- all.yaml\n")

    def render(**kw):
        ours = tmp_path / ("delete" if kw else "deploy")
        ours.mkdir()
        (ours / "kustomization.yaml").write_text(kubeflow.operator_kustomization(base=os.path.relpath(base, ours), **kw))
        out = subprocess.run([kube.kubectl(), "kustomize", str(ours)], capture_output=True, text=True, check=True).stdout
        return {d["kind"] for d in yaml.safe_load_all(out) if d}

    assert render() == {"Namespace", "Deployment"}  # deploy still creates the namespace where it is missing
    assert render(for_delete=True) == {"Deployment"}


def test_audit_finds_what_controllers_made_for_the_cluster(monkeypatch):
    """moto (in process) holds what the EBS CSI driver, the VPC CNI, a LoadBalancer Service and the CloudWatch add-on
    leave behind for cluster `doeks`; audit lists each, and nothing of another cluster."""
    from moto import mock_aws

    from doeks import audit

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with mock_aws():
        s = load(TARGET="eks")
        kw = {"region_name": "us-west-2"}
        ec2 = boto3.client("ec2", **kw)
        claim = ec2.create_volume(AvailabilityZone="us-west-2a", Size=100, VolumeType="gp3", TagSpecifications=[{
            "ResourceType": "volume", "Tags": [{"Key": "doeks/cluster", "Value": "doeks"},
                                               {"Key": "kubernetes.io/created-for/pvc/name", "Value": "mysql-pv-claim"}]}])
        legacy = ec2.create_volume(AvailabilityZone="us-west-2a", Size=10, VolumeType="gp2", TagSpecifications=[{
            "ResourceType": "volume", "Tags": [{"Key": "kubernetes.io/cluster/doeks", "Value": "owned"}]}])
        ec2.create_volume(AvailabilityZone="us-west-2a", Size=10, TagSpecifications=[{
            "ResourceType": "volume", "Tags": [{"Key": "kubernetes.io/cluster/other", "Value": "owned"}]}])
        vpc = ec2.create_vpc(CidrBlock="10.9.0.0/16")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.9.1.0/24", AvailabilityZone="us-west-2a")["Subnet"]["SubnetId"]
        eni = ec2.create_network_interface(SubnetId=subnet, TagSpecifications=[{"ResourceType": "network-interface", "Tags": [
            {"Key": "cluster.k8s.amazonaws.com/name", "Value": "doeks"}]}])["NetworkInterface"]["NetworkInterfaceId"]
        elbv2 = boto3.client("elbv2", **kw)
        nlb = elbv2.create_load_balancer(Name="k8s-istiosys-gateway", Subnets=[subnet], Type="network",
                                         Tags=[{"Key": "kubernetes.io/cluster/doeks", "Value": "owned"}])["LoadBalancers"][0]
        elbv2.create_load_balancer(Name="someone-elses", Subnets=[subnet], Type="network")
        boto3.client("elb", **kw).create_load_balancer(
            LoadBalancerName="a1b2c3", AvailabilityZones=["us-west-2a"],
            Listeners=[{"Protocol": "TCP", "LoadBalancerPort": 80, "InstancePort": 30080}],
            Tags=[{"Key": "kubernetes.io/cluster/doeks", "Value": "owned"}])
        boto3.client("logs", **kw).create_log_group(logGroupName="/aws/containerinsights/doeks/performance")
        boto3.client("logs", **kw).create_log_group(logGroupName="/aws/containerinsights/other/performance")
        found = {(f.kind, f.ident) for f in audit.scan(s)}
    assert ("ebs volume", claim["VolumeId"]) in found and ("ebs volume", legacy["VolumeId"]) in found
    assert ("network interface", eni) in found
    assert ("load balancer", nlb["LoadBalancerName"]) in found and ("load balancer", "a1b2c3") in found
    assert ("log group", "/aws/containerinsights/doeks/performance") in found
    assert len([f for f in found if f[0] == "ebs volume"]) == 2 and ("load balancer", "someone-elses") not in found
    assert not [f for f in found if "other" in f[1]]


def test_gp3_class_has_the_driver_tag_its_volumes():
    assert eks.gp3_storage_class("train1")["parameters"]["tagSpecification_1"] == "doeks/cluster=train1"


# -- (11) the pipeline's branches find SHARED_PVC in the profile namespace ----------------------------------------------
FSX_PV = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "pvc-1234"},
          "spec": {"capacity": {"storage": "1200Gi"}, "accessModes": ["ReadWriteMany"], "mountOptions": ["flock"],
                   "persistentVolumeReclaimPolicy": "Delete", "storageClassName": "fsx-sc",
                   "claimRef": {"namespace": "default", "name": "fsx-pvc"},
                   "csi": {"driver": "fsx.csi.aws.com", "volumeHandle": "fs-0123456789abcdef0",
                           "volumeAttributes": {"dnsname": "fs-0123.fsx.us-west-2.amazonaws.com", "mountname": "abcd"}}}}


def _script(tmp_path, entries):
    import json
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shutil.copy(ROOT / "tests" / "kubectl_standin.py", bin_dir / "kubectl")
    (tmp_path / "script.json").write_text(json.dumps(entries))
    return bin_dir


def test_pipeline_deploy_gives_the_profile_namespace_the_shared_claim(tmp_path, monkeypatch):
    import json
    import os

    import yaml

    from doeks import pipeline
    from doeks.runner import Runner

    from .test_jobspec import k8s_validate

    claim = {"spec": {"volumeName": "pvc-1234"}}
    bin_dir = _script(tmp_path, [{"match": ["get", "pvc", "fsx-pvc", "-n", "default"], "stdout": json.dumps(claim)},
                                 {"match": ["get", "pv", "pvc-1234"], "stdout": json.dumps(FSX_PV)},
                                 {"match": ["apply"], "stdout": ""}])
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("KUBECTL_SCRIPT", str(tmp_path / "script.json"))
    monkeypatch.setenv("RECORD", str(tmp_path / "record.jsonl"))
    s = load(TARGET="eks", KFP_NAMESPACE="team-a")
    applied = pipeline.ensure_shared_claim(s, Runner())
    pv, pvc = applied
    for doc in applied:
        k8s_validate(doc)
    assert pvc["metadata"] == {"name": "fsx-pvc", "namespace": "team-a", "labels": {"app.kubernetes.io/part-of": "doeks"}}
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"] and pvc["spec"]["storageClassName"] == ""
    assert pv["spec"]["csi"]["volumeHandle"] == "fs-0123456789abcdef0"  # the same file system, not a new one
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"  # removing it never deletes the data
    assert pv["spec"]["claimRef"] == {"namespace": "team-a", "name": "fsx-pvc"}
    records = [json.loads(line) for line in (tmp_path / "record.jsonl").read_text().splitlines()]
    sent = [d for r in records if "apply" in r["argv"] for d in yaml.safe_load_all(r["stdin"]) if d]
    assert [d["kind"] for d in sent] == ["PersistentVolume", "PersistentVolumeClaim"]


def test_pipeline_deploy_without_shared_storage_says_which_step(tmp_path, monkeypatch, capsys):
    import os

    from doeks import pipeline
    from doeks.runner import Runner

    bin_dir = _script(tmp_path, [{"match": ["get", "pvc"], "stderr": 'Error from server (NotFound): persistentvolumeclaims "fsx-pvc" not found\n', "rc": 1}])
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("KUBECTL_SCRIPT", str(tmp_path / "script.json"))
    assert pipeline.ensure_shared_claim(load(TARGET="eks", KFP_NAMESPACE="team-a"), Runner()) == []
    err = capsys.readouterr().err
    assert "no bound claim fsx-pvc in namespace default" in err and "invoke csi.fsx.deploy" in err


# -- (2) + acceptance: `invoke up` on EKS does what the job needs --------------------------------------------------------------
def test_up_dry_run_on_a_fresh_clone_names_every_first_run_step(state_dir):
    """No credentials, no cluster: the plan names the image's real base, the version, the zones' lookup, and builds,
    pushes and stages before the job."""
    import yaml

    from doeks import trainimage

    from .conftest import invoke

    import os

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        assert not os.environ.get(key)  # a fresh clone on a machine without credentials
    env = {"TARGET": "eks", "AWS_SHARED_CREDENTIALS_FILE": str(state_dir / "none"), "AWS_CONFIG_FILE": str(state_dir / "none"),
           "AWS_EC2_METADATA_DISABLED": "true"}
    result = invoke("up", "--dry-run", "--full", env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    err = result.stderr
    config = next(d for d in yaml.safe_load_all(result.stdout) if d and d.get("kind") == "ClusterConfig")
    assert config["metadata"]["version"] == "1.35" and "Kubernetes 1.35 (standard support)" in err
    gpu = next(g for g in config["managedNodeGroups"] if g["name"] == "gpu")
    assert gpu["availabilityZones"] != ["us-west-2a"] and "zones of us-west-2 where p4d.24xlarge is offered" in err
    steps = ["eksctl create cluster", f"TRAIN_BASE_IMAGE={trainimage.DLC_BASE}", "docker push",
             "training data under s3://doeks-training/data/imagenet/train/", "wait for Job default/imagenet-stage", "PyTorchJob/imagenet"]
    at = [err.find(step) for step in steps]
    assert all(i >= 0 for i in at) and at == sorted(at), dict(zip(steps, at))


def test_up_refuses_with_one_line_when_s3_has_no_data(monkeypatch):
    from moto import mock_aws

    from doeks import elastic

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with mock_aws():
        s = load(TARGET="eks", S3_BUCKET="first-run")
        s3 = boto3.client("s3", region_name="us-west-2")
        with pytest.raises(DoeksError, match=r"^no training data under s3://first-run/data/imagenet/train/: .*aws s3 sync") as error:
            elastic.cluster_data_source(s)
        assert "\n" not in str(error.value)
        s3.create_bucket(Bucket="first-run", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
        s3.put_object(Bucket="first-run", Key="data/imagenet/train/n01440764/a.JPEG", Body=b"x")
        assert elastic.cluster_data_source(s) == "s3://first-run/data/imagenet"


# -- (10) least privilege, with moto enforcing IAM (INITIAL_NO_AUTH_ACTION_COUNT) ---------------------------------------------
def _user_with(iam, name: str, documents: list[dict]) -> dict:
    """An IAM user holding exactly `documents`; its access key as client keyword arguments."""
    import json

    iam.create_user(UserName=name)
    for i, document in enumerate(documents):
        iam.put_user_policy(UserName=name, PolicyName=f"p{i}", PolicyDocument=json.dumps(document))
    key = iam.create_access_key(UserName=name)["AccessKey"]
    return {"region_name": "us-west-2", "aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}


def _denied(call) -> bool:
    from botocore.exceptions import ClientError

    try:
        call()
    except ClientError as error:
        return error.response["ResponseMetadata"]["HTTPStatusCode"] == 403 or "AccessDenied" in error.response["Error"]["Code"]
    return False


def test_workload_roles_allow_their_calls_and_nothing_of_doeks(monkeypatch):
    """For the FSx CSI controller and the staging Job: a user holding exactly the workload's policies makes the calls
    its code makes (allowed), and the calls doeks makes with its own credentials (data repository association, S3
    writes, EC2 lookups) are refused by moto's IAM."""
    from moto import mock_aws
    from moto.core import set_initial_no_auth_action_count

    from doeks import identity

    s = load(TARGET="eks", FSX_IMPORT_PATH="s3://import-bucket/data", S3_BUCKET="train-bucket")
    subnet = "subnet-0123456789abcdef0"

    @set_initial_no_auth_action_count(100)  # the set-up below runs as root; then every call is checked
    @mock_aws
    def run():
        iam = boto3.client("iam", region_name="us-west-2")
        root_s3 = boto3.client("s3", region_name="us-west-2")
        root_s3.create_bucket(Bucket="train-bucket", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
        root_s3.put_object(Bucket="train-bucket", Key="data/imagenet/train/n0/a.JPEG", Body=b"x")
        fsx_kw = _user_with(iam, "fsx-csi", identity.policies(s, identity.get("fsx-csi")))
        stage_kw = _user_with(iam, "data-stage", identity.policies(s, identity.get("data-stage")))
        import moto.settings as moto_settings

        moto_settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # from here on, every request is authorised
        fsx = boto3.client("fsx", **fsx_kw)
        created = fsx.create_file_system(FileSystemType="LUSTRE", StorageCapacity=1200, SubnetIds=[subnet],
                                         LustreConfiguration={"DeploymentType": "PERSISTENT_2", "PerUnitStorageThroughput": 250},
                                         Tags=[{"Key": "doeks/cluster", "Value": "doeks"}])["FileSystem"]["FileSystemId"]
        assert fsx.describe_file_systems(FileSystemIds=[created])["FileSystems"]
        assert _denied(lambda: boto3.client("ec2", **fsx_kw).describe_subnets(SubnetIds=[subnet]))
        assert _denied(lambda: boto3.client("s3", **fsx_kw).put_object(Bucket="import-bucket", Key="x", Body=b"x"))
        # (moto has no CreateDataRepositoryAssociation: a 403 comes from its IAM check, before the service)
        assert _denied(lambda: fsx.create_data_repository_association(
            FileSystemId=created, FileSystemPath="/data", DataRepositoryPath="s3://import-bucket/data/"))
        fsx.delete_file_system(FileSystemId=created)
        s3 = boto3.client("s3", **stage_kw)
        assert s3.list_objects_v2(Bucket="train-bucket", Prefix="data/imagenet/")["KeyCount"] == 1
        assert s3.get_object(Bucket="train-bucket", Key="data/imagenet/train/n0/a.JPEG")["Body"].read() == b"x"
        assert _denied(lambda: s3.put_object(Bucket="train-bucket", Key="data/imagenet/x", Body=b"x"))
        assert _denied(lambda: s3.get_object(Bucket="train-bucket", Key="models/secret"))

    run()


# -- (9) one EFA device plugin, one owner -------------------------------------------------------------------------------------
def test_efa_deploy_replaces_eksctls_plugin_before_applying_its_own(state_dir):
    from doeks import efa

    from .conftest import invoke

    result = invoke("efa.deploy", "--dry-run", env={"TARGET": "eks"})
    assert result.returncode == 0, result.stderr
    replace = "kubectl delete daemonset -n kube-system --field-selector metadata.name=aws-efa-k8s-device-plugin-daemonset " \
              "-l 'app.kubernetes.io/part-of!=doeks' --ignore-not-found"
    assert replace in result.stderr
    assert result.stderr.index(replace) < result.stderr.index("kubectl apply --server-side --field-manager=doeks")
    # the DaemonSet doeks applies carries the label, so a second deploy never deletes it
    assert efa.device_plugin(load(TARGET="eks"))[0]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "doeks"

"""The eks unit: ClusterConfig against eksctl's own JSON schema; boto3 read-back and delete against a real moto
server process; the eksctl boundary through a recorded-argv stand-in (eksctl itself cannot run here)."""
from __future__ import annotations

import functools
import json
import os
import shutil

import jsonschema
import pytest
import yaml
from hypothesis import given, settings as hsettings, strategies as st

from doeks import eks, keys
from doeks import settings as S
from doeks import services

from . import moto_eks
from .conftest import ROOT, invoke, schema_path

@functools.lru_cache(maxsize=1)
def schema():
    return json.loads(schema_path("eksctl-clusterconfig-v1alpha5.schema.json").read_text())


def render(**env):
    settings = S.load(environ={k: str(v) for k, v in env.items()}, path=ROOT / ".env")
    region = settings.aws_region  # zones as EC2 would answer (tests/test_first_run.py asks moto)
    return eks.cluster_config(settings, eks.choose_zones(settings, [f"{region}b"], [f"{region}{z}" for z in "abcd"]))


def validate(config):
    jsonschema.Draft7Validator(schema()).validate(config)


@pytest.mark.parametrize("env", [
    {},
    {"GPU_EFA": "false", "CPU_NODES": "1", "CPU_NODES_MAX": "4"},
    {"GPU_INSTANCE_TYPE": "p5.48xlarge", "PLACEMENT_GROUP": "pg-train", "CAPACITY_RESERVATION_ID": "cr-0123456789abcdef0"},
    {"GPU_INSTANCE_TYPE": "g5.12xlarge", "GPU_SPOT": "true", "EKS_ZONES": "us-east-1a,us-east-1b", "AWS_REGION": "us-east-1"},
    {"GPU_NODES_MAX": "0", "GPU_NODES": "0", "CPU_NODES_MAX": "0", "AMI_FAMILY": "Bottlerocket", "NODE_VOLUME_TYPE": "io2"},
])
def test_cluster_config_validates_against_eksctl_schema(env):
    config = render(**env)
    validate(config)
    groups = {g["name"]: g for g in config["managedNodeGroups"]}
    assert all(g["volumeEncrypted"] for g in groups.values())  # encryption on by default
    assert config["iam"]["withOIDC"] is True
    assert {a["name"] for a in config["addons"]} == set(eks.ADDONS)
    if "gpu" in groups:
        gpu = groups["gpu"]
        assert gpu["labels"]["processor"] == "gpu"
        if gpu.get("efaEnabled") or "placement" in gpu:
            assert len(gpu["availabilityZones"]) == 1  # EFA/FSx groups pinned to one AZ


def test_efa_only_on_efa_instance_types():
    assert render(GPU_INSTANCE_TYPE="p4d.24xlarge")["managedNodeGroups"][-1].get("efaEnabled") is True
    assert "efaEnabled" not in render(GPU_INSTANCE_TYPE="g4dn.xlarge")["managedNodeGroups"][-1]


def test_schema_rejects_an_unknown_field():
    config = render()
    config["managedNodeGroups"][0]["efaEnabeld"] = True
    with pytest.raises(jsonschema.ValidationError):
        validate(config)


@hsettings(max_examples=60, deadline=None)
@given(gpu=st.sampled_from(["p4d.24xlarge", "p5.48xlarge", "g5.xlarge", "p3.8xlarge", "trn1.32xlarge"]),
       efa=st.booleans(), spot=st.booleans(), low=st.integers(0, 3), extra=st.integers(0, 3), volume=st.integers(20, 2000),
       version=st.sampled_from(keys.EKS_VERSIONS), private=st.booleans())
def test_many_env_combinations_validate(gpu, efa, spot, low, extra, volume, version, private):
    validate(render(GPU_INSTANCE_TYPE=gpu, GPU_EFA=efa, GPU_SPOT=spot, GPU_NODES_MIN=low, GPU_NODES=low + extra,
                    GPU_NODES_MAX=low + 2 * extra + 1, NODE_VOLUME_SIZE=volume, EKS_VERSION=version,
                    NODE_PRIVATE_NETWORKING=private))


def test_eks_yaml_is_used_as_is(tmp_path, state_dir):
    custom = tmp_path / "cluster.yaml"
    custom.write_text("apiVersion: eksctl.io/v1alpha5\nkind: ClusterConfig\nmetadata: {name: mine, region: eu-west-1}\n")
    result = invoke("eks.config", env={"EKS_YAML": str(custom)})
    assert result.returncode == 0 and result.stdout == custom.read_text()
    missing = invoke("eks.config", env={"EKS_YAML": str(tmp_path / "nope.yaml")})
    assert missing.returncode == 1 and "EKS_YAML=" in missing.stderr


@pytest.fixture
def moto_endpoint(state_dir):
    server = moto_eks.server(state_dir)  # moto + EKS add-ons and Pod Identity (eks.create adds the EBS CSI add-on)
    server.start()
    yield server.endpoint()
    server.stop()


@pytest.fixture
def fake_eksctl(tmp_path, moto_endpoint):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(ROOT / "tests" / "eksctl_standin.py", bin_dir / "eksctl")
    shutil.copy(ROOT / "tests" / "recorder.py", bin_dir / "kubectl")  # the gp3 StorageClass is applied after create
    record = tmp_path / "eksctl.jsonl"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "EKSCTL_RECORD": str(record), "TARGET": "eks",
           "RECORD": str(tmp_path / "kubectl.jsonl"),
           "AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "COLUMNS": "250"}
    return env, record


def calls(record):
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def test_create_status_scale_delete_through_eksctl_and_boto3(fake_eksctl, state_dir):
    env, record = fake_eksctl
    created = invoke("eks.create", env=env)
    assert created.returncode == 0, created.stderr
    assert calls(record)[0][:3] == ["create", "cluster", "-f"]
    assert calls(record)[1][:2] == ["utils", "write-kubeconfig"]
    # and the kubeconfig of this cluster alone, which every TARGET=eks task reads (issue 31: never the user's context)
    pinned = state_dir / "kube" / "eks-doeks.us-west-2.kubeconfig"
    written = [argv for argv in calls(record) if argv[:2] == ["utils", "write-kubeconfig"]]
    assert ["utils", "write-kubeconfig", "--cluster", "doeks", "--region", "us-west-2", "--kubeconfig", str(pinned)] \
        in written, written
    config = yaml.safe_load(open(calls(record)[0][3]))
    validate(config)

    status = invoke("eks.status", env=env)
    assert status.returncode == 0, status.stderr
    assert "ACTIVE" in status.stderr and "sys" in status.stderr and "gpu" in status.stderr and "0/0/4" in status.stderr

    scaled = invoke("eks.scale", "--nodegroup", "gpu", "--size", "3", "--max", "4", env=env)
    assert scaled.returncode == 0, scaled.stderr
    assert calls(record)[-1] == ["scale", "nodegroup", "--cluster", "doeks", "--region", "us-west-2", "--name", "gpu",
                                 "--nodes", "3", "--nodes-max", "4"]
    bad = invoke("eks.scale", "--nodegroup", "nope", "--size", "1", env=env)
    assert bad.returncode == 1 and "not found" in bad.stderr and "Traceback" not in bad.stderr

    refused = invoke("eks.delete", env=env)
    assert refused.returncode == 1 and "--yes" in refused.stderr
    deleted = invoke("eks.delete", "--yes", env=env)
    assert deleted.returncode == 0, deleted.stderr
    assert calls(record)[-1] == ["delete", "cluster", "--name", "doeks", "--region", "us-west-2", "--wait"]
    n = len(calls(record))
    again = invoke("eks.delete", "--yes", env=env)  # idempotent: boto3 sees it gone, eksctl is not called
    assert again.returncode == 0 and "nothing to delete" in again.stderr and len(calls(record)) == n
    gone = invoke("eks.status", env=env)
    assert "absent" in gone.stderr


def test_create_dry_run_prints_config_and_commands_only(fake_eksctl, state_dir):
    env, record = fake_eksctl
    result = invoke("eks.create", "--dry-run", env=env)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    validate(docs[0])  # the ClusterConfig, then what doeks applies after it (the gp3 default StorageClass)
    assert [d["kind"] for d in docs] == ["ClusterConfig", "StorageClass"]
    assert "would run: eksctl create cluster -f" in result.stderr
    assert calls(record) == []


def test_missing_eksctl_is_a_clear_error(moto_endpoint, state_dir):
    env = {"TARGET": "eks", "AWS_ENDPOINT_URL": moto_endpoint, "PATH": "/usr/bin:/bin:" + os.path.dirname(shutil.which("python3") or "")}
    result = invoke("eks.create", env=env)
    assert result.returncode == 1 and "eksctl is not on PATH" in result.stderr and "Traceback" not in result.stderr


def test_authorize_requests_match_the_eks_service_model(state_dir):
    """moto does not implement access entries: botocore's Stubber checks the requests against AWS's own model."""
    from botocore.stub import Stubber

    from doeks.runner import Runner

    s = S.load(environ={"TARGET": "eks", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, path=ROOT / ".env")
    client = eks._client(s)
    principal = "arn:aws:iam::123456789012:role/ml-team"
    with Stubber(client) as stub:
        stub.add_response("create_access_entry", {"accessEntry": {"principalArn": principal}},
                          {"clusterName": "doeks", "principalArn": principal})
        stub.add_response("associate_access_policy", {"clusterName": "doeks", "principalArn": principal},
                          {"clusterName": "doeks", "principalArn": principal,
                           "policyArn": "arn:aws:eks::aws:cluster-access-policy/AmazonEKSViewPolicy",
                           "accessScope": {"type": "namespace", "namespaces": ["ml"]}})
        original = eks._client
        eks._client = lambda *_: client
        try:
            eks.authorize(s, Runner(echo=False), principal, "view", ("ml",))
        finally:
            eks._client = original
        stub.assert_no_pending_responses()
    with pytest.raises(Exception, match="not an IAM role"):
        eks.authorize(s, Runner(echo=False), "bob", "admin")


def test_local_target_create_and_delete_manage_the_local_runtime(state_dir):
    up = invoke("eks.create")
    assert up.returncode == 0 and "TARGET=local" in up.stderr
    assert services.etcd(state_dir).info() and services.moto(state_dir).info()
    table = invoke("eks.status", env={"COLUMNS": "200"})
    assert table.stderr.count("running") == 2
    assert invoke("eks.delete").returncode == 0
    assert services.etcd(state_dir).info() is None and services.moto(state_dir).info() is None
    assert invoke("eks.delete").returncode == 0


def test_doctor_checks_what_a_real_account_needs(state_dir):
    """Service Quotas, instance type offerings, the capacity reservation's AZ, a leftover VPC, the ECR image; each
    request checked against AWS's service model by botocore's Stubber (moto has no Service Quotas)."""
    import boto3
    from botocore.stub import Stubber

    from doeks import preflight

    s = S.load(environ={"TARGET": "eks", "GPU_INSTANCE_TYPE": "p4d.24xlarge", "GPU_NODES_MAX": "4", "EKS_ZONES": "us-west-2b,us-west-2c",
                        "CAPACITY_RESERVATION_ID": "cr-0123456789abcdef0",
                        "TRAIN_IMAGE": "123456789012.dkr.ecr.us-west-2.amazonaws.com/doeks-train:1.0"})
    kw = dict(region_name="us-west-2", aws_access_key_id="x", aws_secret_access_key="x")
    clients = {name: boto3.client(name, **kw) for name in ("ec2", "service-quotas", "eks", "ecr")}
    stubs = {name: Stubber(c) for name, c in clients.items()}
    stubs["ec2"].add_response("describe_instance_types", {"InstanceTypes": [{"InstanceType": "p4d.24xlarge", "VCpuInfo": {"DefaultVCpus": 96}}]},
                              {"InstanceTypes": ["p4d.24xlarge"]})
    stubs["service-quotas"].add_response("get_service_quota", {"Quota": {"Value": 192.0}}, {"ServiceCode": "ec2", "QuotaCode": "L-417A185B"})
    stubs["ec2"].add_response("describe_instance_type_offerings", {"InstanceTypeOfferings": [
        {"InstanceType": "p4d.24xlarge", "LocationType": "availability-zone", "Location": "us-west-2a"}]},
        {"LocationType": "availability-zone", "Filters": [{"Name": "instance-type", "Values": ["p4d.24xlarge"]}]})
    stubs["ec2"].add_response("describe_capacity_reservations", {"CapacityReservations": [
        {"CapacityReservationId": "cr-0123456789abcdef0", "AvailabilityZone": "us-west-2a", "InstanceType": "p4d.24xlarge"}]},
        {"CapacityReservationIds": ["cr-0123456789abcdef0"]})
    stubs["eks"].add_client_error("describe_cluster", "ResourceNotFoundException", http_status_code=404, expected_params={"name": "doeks"})
    stubs["ec2"].add_response("describe_vpcs", {"Vpcs": [{"VpcId": "vpc-0abc"}]},
                              {"Filters": [{"Name": "tag:alpha.eksctl.io/cluster-name", "Values": ["doeks"]}]})
    stubs["ecr"].add_client_error("describe_images", "ImageNotFoundException", expected_params={
        "repositoryName": "doeks-train", "imageIds": [{"imageTag": "1.0"}]})
    for stub in stubs.values():
        stub.activate()
    rows = {what: (ok, detail) for what, ok, detail in preflight.cluster_checks(s, clients.__getitem__)}
    for stub in stubs.values():
        stub.assert_no_pending_responses()
    assert rows["quota L-417A185B (p on-demand vCPUs)"][0] is False and "384" in rows["quota L-417A185B (p on-demand vCPUs)"][1]
    assert rows["p4d.24xlarge offered in us-west-2b"] == (False, "not offered there: set EKS_ZONES to one of us-west-2a")
    assert rows["capacity reservation cr-0123456789abcdef0"][0] is False and "EKS_ZONES=us-west-2a" in rows["capacity reservation cr-0123456789abcdef0"][1]
    assert rows["no leftover VPC of doeks"][0] is False and "vpc-0abc" in rows["no leftover VPC of doeks"][1]
    assert rows["image 123456789012.dkr.ecr.us-west-2.amazonaws.com/doeks-train:1.0"][0] is False


def test_fresh_on_eks_says_the_checkpoints_on_the_claim_are_kept(state_dir):
    """--fresh clears a job's checkpoints only where this machine reaches them (doeks' own cluster's folder, S3: eks'
    default); with CHECKPOINT_URI on the claim it still replaces a running job, and says the job resumes from them."""
    fresh = invoke("elasticjob.deploy", "--fresh", "--dry-run", env={"TARGET": "eks", "CHECKPOINT_URI": "/fsx-shared/ck"})
    assert fresh.returncode == 0, fresh.stderr
    said = fresh.stdout + fresh.stderr
    assert "checkpoints on claim fsx-pvc are not on this machine: the job resumes from them" in said
    assert "remove checkpoints, metrics and model.pt" not in said
    in_s3 = invoke("elasticjob.deploy", "--fresh", "--dry-run", env={"TARGET": "eks"})
    said = in_s3.stdout + in_s3.stderr
    assert in_s3.returncode == 0 and "resumes from them" not in said, said[-2000:]
    assert "remove the checkpoints of imagenet in s3://doeks-training/doeks/checkpoints/imagenet/" in said
    assert "remove the previous run's s3://doeks-training/doeks/models/imagenet/model.pt (--fresh)" in said
    plain = invoke("elasticjob.deploy", "--dry-run", env={"TARGET": "eks"})
    assert plain.returncode == 0 and "resumes from them" not in plain.stdout + plain.stderr

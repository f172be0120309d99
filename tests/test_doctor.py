"""`invoke doctor` per target. eks: credentials and where botocore found them, the account, the cluster (moto's EKS
API), the kubeconfig context against the cluster's endpoint, the tools' versions; sagemaker: the execution role,
the bucket and its data, the image's region. Exit 1 with one line naming what is missing.

The AWS account is a moto server process (doeks' own, over HTTP). kubectl, helm and eksctl are small stand-ins that
print what the real tools print for their version (kubectl `Client Version: v1.33.4`, helm `v3.18.6+g...`, eksctl
`0.215.0`): this machine has no eksctl or helm, and doctor only runs their version commands.
"""
from __future__ import annotations

import os
import subprocess
import sys

import boto3
import pytest
import yaml

from doeks.targets import checks as target_checks
from doeks import settings as S
from doeks import services

from .conftest import ROOT

VERSIONS = {"kubectl": "Client Version: v1.33.4\nKustomize Version: v5.6.0", "helm": "v3.18.6+gb76a950",
            "eksctl": "0.215.0"}


@pytest.fixture
def tools(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, text in VERSIONS.items():
        (bin_dir / tool).write_text(f"#!/bin/sh\ncat <<'EOT'\n{text}\nEOT\n")
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def doctor(env: dict[str, str], home) -> subprocess.CompletedProcess:
    """`invoke doctor` with no AWS_* variables of this machine (and no ~/.aws): only those the test gives."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KUBECONFIG"))}
    full = {**base, "HOME": str(home), "AWS_EC2_METADATA_DISABLED": "true", "COLUMNS": "250", **env}
    return subprocess.run([sys.executable, "-m", "invoke", "doctor"], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=120)


def error_line(result) -> str:
    lines = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_eks_without_credentials_says_where_they_are_read_from(state_dir, tmp_path, tools):
    result = doctor({"TARGET": "eks", "PATH": f"{tools}:{os.environ['PATH']}"}, tmp_path)
    assert result.returncode == 1
    assert error_line(result) == "error: TARGET=eks cannot work here: AWS credentials (see the fixes above)"
    assert "no AWS credentials: doeks reads them (botocore's chain, in order) from AWS_ACCESS_KEY_ID" in result.stderr
    assert "~/.aws/credentials" in result.stderr and "disabled by AWS_EC2_METADATA_DISABLED" in result.stderr
    assert "unknown: no working AWS credentials" in result.stderr  # the cluster is not claimed absent
    assert "Client Version: v1.33.4" in result.stderr and "v3.18.6+gb76a950" in result.stderr and "0.215.0" in result.stderr


def test_eks_credentials_cluster_context_and_tools(state_dir, tmp_path, tools):
    moto = services.moto(state_dir)
    moto.start()
    endpoint = moto.endpoint()
    eks = boto3.client("eks", endpoint_url=endpoint, region_name="us-west-2", aws_access_key_id="testing",
                       aws_secret_access_key="testing")
    cluster = eks.create_cluster(name="train-1", roleArn="arn:aws:iam::123456789012:role/eks",
                                 resourcesVpcConfig={"subnetIds": ["subnet-1"]})["cluster"]
    # what doeks reads on TARGET=eks: the kubeconfig `eks.connect` writes for CLUSTER_NAME/AWS_REGION alone
    kubeconfig = state_dir / "kube" / "eks-train-1.us-west-2.kubeconfig"
    kubeconfig.parent.mkdir(parents=True)

    def write_kubeconfig(server: str) -> None:  # as `eksctl utils write-kubeconfig` names things
        name = "train-1.us-west-2.eksctl.io"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": f"doeks@{name}",
            "clusters": [{"name": name, "cluster": {"server": server}}],
            "contexts": [{"name": f"doeks@{name}", "context": {"cluster": name, "user": f"doeks@{name}"}}],
            "users": [{"name": f"doeks@{name}", "user": {}}]}))

    write_kubeconfig(cluster["endpoint"])
    env = {"TARGET": "eks", "CLUSTER_NAME": "train-1", "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
           "AWS_SECRET_ACCESS_KEY": "s3cr3t-value", "GPU_NODES_MIN": "0", "GPU_NODES": "0", "GPU_NODES_MAX": "0",
           "TRAIN_IMAGE": "ghcr.io/example/doeks-train:1", "KUBECONFIG": str(kubeconfig), "PATH": f"{tools}:{os.environ['PATH']}"}
    ok = doctor(env, tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "AWS_ACCESS_KEY_ID from environment" in ok.stderr and "s3cr3t-value" not in ok.stderr
    assert "123456789012" in ok.stderr  # the account, from sts:GetCallerIdentity
    assert f"ACTIVE, Kubernetes {cluster['version']}, {cluster['endpoint']}" in ok.stderr
    assert "context doeks@train-1.us-west-2.eksctl.io" in ok.stderr

    write_kubeconfig("https://another-cluster.example:443")  # a context left over from another cluster
    stale = doctor(env, tmp_path)
    assert stale.returncode == 1
    assert error_line(stale) == "error: TARGET=eks cannot work here: kubeconfig context (see the fixes above)"
    assert "points at https://another-cluster.example:443" in stale.stderr and "invoke eks.connect" in stale.stderr

    kubeconfig.unlink()
    (tools / "eksctl").unlink()
    gone = doctor(env, tmp_path)
    assert gone.returncode == 1
    assert error_line(gone) == "error: TARGET=eks cannot work here: kubeconfig context, eksctl (see the fixes above)"

    absent = doctor({**env, "CLUSTER_NAME": "not-yet"}, tmp_path)  # before `invoke up`: no kubeconfig needed
    assert "not created yet in us-west-2: `invoke up`" in absent.stderr
    assert error_line(absent) == "error: TARGET=eks cannot work here: eksctl (see the fixes above)"


def test_sagemaker_role_bucket_data_and_image_region(state_dir):
    moto = services.moto(state_dir)
    moto.start()
    env = {"TARGET": "sagemaker", "AWS_ENDPOINT_URL": moto.endpoint(), "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "S3_BUCKET": "sm-doctor", "SAGEMAKER_ROLE_NAME": "sm-doctor-role"}
    s = S.load(environ=env, path=ROOT / ".env")

    def rows(settings):
        return {what: (ok, detail, required) for what, ok, detail, required in target_checks.sagemaker_checks(settings)}

    before = rows(s)
    assert before["execution role sm-doctor-role"] == (False, "not found: `invoke sagemaker.role`", True)
    assert before["bucket sm-doctor"][0] is False and "S3_BUCKET" in before["bucket sm-doctor"][1]
    assert before["image for the region"][0] is True  # the default DLC image is in us-west-2, as is AWS_REGION

    kw = dict(endpoint_url=moto.endpoint(), region_name="us-west-2", aws_access_key_id="testing", aws_secret_access_key="testing")
    boto3.client("iam", **kw).create_role(RoleName="sm-doctor-role", AssumeRolePolicyDocument="{}")
    s3 = boto3.client("s3", **kw)
    s3.create_bucket(Bucket="sm-doctor", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    middle = rows(s)
    assert middle["execution role sm-doctor-role"][0] is True and middle["bucket sm-doctor"][0] is True
    assert middle["data s3://sm-doctor/data/imagenet/"][:2] == (False, "empty: upload train/ and val/ there (DATA_S3_PREFIX)")
    s3.put_object(Bucket="sm-doctor", Key="data/imagenet/train/n01/x.JPEG", Body=b"x")
    assert all(ok for ok, _, required in rows(s).values() if required)

    assert rows(S.load(environ={**env, "AWS_REGION": "eu-west-1"}, path=ROOT / ".env"))["image for the region"][0] is True
    pinned = {**env, "AWS_REGION": "eu-west-1", "SAGEMAKER_IMAGE": S.load(environ=env, path=ROOT / ".env").sagemaker_image}
    elsewhere = rows(S.load(environ=pinned, path=ROOT / ".env"))["image for the region"]
    assert elsewhere[0] is False
    assert "SAGEMAKER_IMAGE=763104351884.dkr.ecr.eu-west-1.amazonaws.com/pytorch-training:" in elsewhere[1]


def test_local_as_before_and_docker_needs_the_daemon(state_dir, tmp_path):
    local = doctor({"TARGET": "local"}, tmp_path)
    assert "doeks doctor (TARGET=local)" in local.stderr and "torchvision imports" in local.stderr
    needed = {line.split("│")[1].strip() for line in local.stderr.splitlines()
              if line.count("│") == 5 and line.split("│")[4].strip() == "yes"}
    assert needed == {"python: invoke", "python: boto3", "python: torch", "torchvision imports", "etcd (v2 API)"}
    assert local.returncode == (0 if "│ NO " not in local.stderr else 1)
    # TARGET=docker also needs the daemon: pointed at a socket nobody listens on, doctor fails and names it
    docker = doctor({"TARGET": "docker", "DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock"}, tmp_path)
    assert docker.returncode == 1
    assert error_line(docker).startswith("error: TARGET=docker cannot work here: ") and "docker daemon" in error_line(docker)

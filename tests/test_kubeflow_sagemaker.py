"""kubeflow + sagemaker: PyTorchJobs validate against the CRD; the hybrid pipeline compiles for every runtime, runs its
local branch for real with kfp.local, and its SageMaker branch against a real moto server process (which implements
CreateTrainingJob/DescribeTrainingJob); the SageMaker tasks' requests are asserted field by field."""
from __future__ import annotations

import json

import boto3
import jsonschema
import pytest
import yaml

from doeks import settings as S
from doeks import services
from doeks.runner import Runner

from .conftest import ROOT, invoke
from .test_jobspec import crd_schema


@pytest.fixture
def moto_env(state_dir):
    server = services.moto(state_dir)
    server.start()
    env = {"TARGET": "sagemaker", "AWS_ENDPOINT_URL": server.endpoint(), "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "COLUMNS": "220"}
    yield env
    server.stop()


def boto(env, service):
    return boto3.client(service, endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-west-2",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


@pytest.mark.parametrize("flags", [[], ["--no-elastic"], ["--replicas", "3"]])
def test_pytorchjob_submit_dry_run_validates(flags, state_dir):
    result = invoke("kubeflow.pytorchjob.submit", "--dry-run", *flags, env={"TARGET": "eks"})
    assert result.returncode == 0, result.stderr
    job = yaml.safe_load(result.stdout)
    jsonschema.validate(job, crd_schema("kubeflow.org_pytorchjobs.crd.yaml", "v1"))
    assert ("elasticPolicy" in job["spec"]) == ("--no-elastic" not in flags)
    assert "would run: kubectl apply --server-side" in result.stderr


@pytest.mark.parametrize("runtime", ["kubernetes", "sagemaker", "local"])
def test_pipeline_compiles_for_each_runtime(runtime, tmp_path, state_dir):
    out = tmp_path / f"{runtime}.yaml"
    result = invoke("kubeflow.pipeline.compile", "--out", str(out), "--runtime", runtime, env={"REGISTRY": "registry.example.com"})
    assert result.returncode == 0, result.stderr
    ir = next(yaml.safe_load_all(out.read_text()))  # then the platform spec (service accounts)
    assert ir["pipelineInfo"]["name"] == "doeks-hybrid-training"
    assert ir["root"]["inputDefinitions"]["parameters"]["training_runtime"]["defaultValue"] == runtime
    text = out.read_text()
    for component in ("train-kubernetes", "train-sagemaker", "train-local"):
        assert f"comp-{component}" in text
    branches = ir["components"]["comp-condition-branches-1"]["dag"]["tasks"]
    conditions = " ".join(t.get("triggerPolicy", {}).get("condition", "") for t in branches.values())
    assert "== 'kubernetes'" in conditions and "== 'sagemaker'" in conditions


def test_unknown_runtime_is_a_clear_error(tmp_path, state_dir):
    result = invoke("kubeflow.pipeline.compile", "--out", str(tmp_path / "x.yaml"), "--runtime", "gke")
    assert result.returncode == 1 and "--runtime 'gke'" in result.stderr and "Traceback" not in result.stderr


def test_sagemaker_train_dry_run_prints_the_full_request(state_dir):
    env = {"TARGET": "sagemaker", "SAGEMAKER_SPOT": "true", "EFS_FILE_SYSTEM_ID": "fs-0123456789abcdef0",
           "SAGEMAKER_SUBNETS": "subnet-0123456789abcdef0", "SAGEMAKER_SECURITY_GROUPS": "sg-0123456789abcdef0"}
    result = invoke("sagemaker.train", "--dry-run", env=env)
    assert result.returncode == 0, result.stderr
    request = json.loads(result.stdout)
    assert request["EnableManagedSpotTraining"] is True
    assert request["StoppingCondition"]["MaxWaitTimeInSeconds"] >= request["StoppingCondition"]["MaxRuntimeInSeconds"]
    assert request["CheckpointConfig"]["S3Uri"].startswith("s3://doeks-training/")
    source = request["InputDataConfig"][0]["DataSource"]["FileSystemDataSource"]
    assert source["FileSystemType"] == "EFS" and source["FileSystemId"] == "fs-0123456789abcdef0"
    assert request["VpcConfig"]["Subnets"] == ["subnet-0123456789abcdef0"]
    assert request["HyperParameters"]["sagemaker_program"] == "train.py"
    assert request["HyperParameters"]["sagemaker_torch_distributed_enabled"] == "true"
    assert "would call: sagemaker.create_training_job" in result.stderr


def test_efs_without_subnets_is_refused(state_dir):
    result = invoke("sagemaker.train", "--dry-run", env={"EFS_FILE_SYSTEM_ID": "fs-0123456789abcdef0"})
    assert result.returncode == 1 and "SAGEMAKER_SUBNETS" in result.stderr


def test_role_train_status_stop_against_moto(moto_env, state_dir):
    assert invoke("sagemaker.train", env=moto_env).returncode == 1  # no role yet: clear error, nothing submitted
    assert boto(moto_env, "sagemaker").list_training_jobs()["TrainingJobSummaries"] == []
    created = invoke("sagemaker.role", env=moto_env)
    assert created.returncode == 0, created.stderr
    policy = boto(moto_env, "iam").get_role_policy(RoleName="doeks-sagemaker-execution-us-west-2", PolicyName="doeks-training")
    actions = [a for st in policy["PolicyDocument"]["Statement"] for a in st["Action"]]
    assert not any(a in ("*", "s3:*", "sagemaker:*") for a in actions)
    assert invoke("sagemaker.role", env=moto_env).returncode == 0  # idempotent
    boto(moto_env, "s3").create_bucket(Bucket="doeks-training", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})

    submitted = invoke("sagemaker.train", "--max-steps", "7", env=moto_env)
    assert submitted.returncode == 0, submitted.stderr
    sm = boto(moto_env, "sagemaker")
    name = sm.list_training_jobs()["TrainingJobSummaries"][0]["TrainingJobName"]
    job = sm.describe_training_job(TrainingJobName=name)
    assert job["ResourceConfig"]["InstanceType"] == "ml.g5.12xlarge" and job["ResourceConfig"]["InstanceCount"] == 2
    assert job["HyperParameters"]["max-steps"] == "7" and job["HyperParameters"]["arch"] == "resnet18"
    assert job["RoleArn"].endswith(":role/doeks-sagemaker-execution-us-west-2")
    source = job["HyperParameters"]["sagemaker_submit_directory"]
    body = boto(moto_env, "s3").get_object(Bucket="doeks-training", Key=source.split("doeks-training/", 1)[1])["Body"].read()
    import io
    import tarfile

    assert "train.py" in tarfile.open(fileobj=io.BytesIO(body)).getnames()
    status = invoke("sagemaker.status", env=moto_env)
    assert status.returncode == 0 and "Completed" in status.stderr
    stopped = invoke("sagemaker.stop", env=moto_env)
    assert stopped.returncode == 0 and "nothing to stop" in stopped.stderr
    assert invoke("sagemaker.role-delete", env=moto_env).returncode == 0
    again = invoke("sagemaker.role-delete", env=moto_env)
    assert again.returncode == 0 and "nothing to delete" in again.stderr


def test_s3_gateway_endpoint_create_delete_idempotent(moto_env, state_dir):
    ec2 = boto(moto_env, "ec2")
    vpc = ec2.create_vpc(CidrBlock="10.1.0.0/16")["Vpc"]["VpcId"]
    for _ in range(2):
        assert invoke("sagemaker.s3-endpoint", "--vpc", vpc, env=moto_env).returncode == 0
    endpoints = [e for e in ec2.describe_vpc_endpoints()["VpcEndpoints"] if e["VpcId"] == vpc and e["State"].lower() != "deleted"]
    assert len(endpoints) == 1 and endpoints[0]["VpcEndpointType"] == "Gateway"
    assert endpoints[0]["ServiceName"] == "com.amazonaws.us-west-2.s3"
    assert invoke("sagemaker.s3-endpoint-delete", "--vpc", vpc, env=moto_env).returncode == 0
    second = invoke("sagemaker.s3-endpoint-delete", "--vpc", vpc, env=moto_env)
    assert second.returncode == 0 and "nothing to delete" in second.stderr


@pytest.mark.slow
def test_pipeline_local_branch_trains_and_sagemaker_branch_submits(moto_env, state_dir):
    data = invoke("elasticjob.data", env={"DATA_TRAIN_PER_CLASS": "20", "DATA_VAL_PER_CLASS": "5"})
    assert data.returncode == 0, data.stderr
    scratch = state_dir.parent / "scratch"  # the temporary folder the local branch's training may use
    scratch.mkdir()
    local = invoke("kubeflow.pipeline.run", "--local", "--runtime", "local", "--steps", "3",
                   env={"DATA_TRAIN_PER_CLASS": "20", "DATA_VAL_PER_CLASS": "5", "TMPDIR": str(scratch)}, timeout=600)
    assert local.returncode == 0, local.stderr[-3000:]
    assert not list(scratch.glob("doeks-kfp-*"))  # its checkpoints are not left on the user's machine
    models = list((state_dir / "kfp").glob("*/train-local/model/model.pt"))
    assert models and models[0].stat().st_size > 1_000_000
    assert not list((state_dir / "kfp").glob("*/train-sagemaker"))  # the other branches did not run

    assert invoke("sagemaker.role", env=moto_env).returncode == 0
    boto(moto_env, "s3").create_bucket(Bucket="doeks-training", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    remote = invoke("kubeflow.pipeline.run", "--local", "--runtime", "sagemaker", "--steps", "4", env=moto_env, timeout=600)
    assert remote.returncode == 0, remote.stderr[-3000:]
    sm = boto(moto_env, "sagemaker")
    jobs = sm.list_training_jobs()["TrainingJobSummaries"]
    assert len(jobs) == 1
    job = sm.describe_training_job(TrainingJobName=jobs[0]["TrainingJobName"])
    assert job["TrainingJobStatus"] == "Completed"
    assert job["HyperParameters"]["max-steps"] == "4"
    assert job["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"] == "s3://doeks-training/data/imagenet/"
    assert job["AlgorithmSpecification"]["TrainingImage"].endswith("-sagemaker")
    assert job["RoleArn"] == boto(moto_env, "iam").get_role(RoleName="doeks-sagemaker-execution-us-west-2")["Role"]["Arn"]

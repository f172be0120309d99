"""Every CreateTrainingJob request variant doeks can send (S3, EFS, VPC, spot, and their mixes), built from what a
user's .env can say, checked against AWS's own service model: botocore's Stubber (the client's parameter validation:
types, required members, minimums) and, for what that validation skips, the model's max lengths, patterns and enums
(botocore data sagemaker/2017-07-24/service-2.json)."""
from __future__ import annotations

import re

import boto3
import pytest
from botocore.stub import Stubber

from doeks import sagemaker
from doeks import settings as S
from doeks.errors import DoeksError

from .conftest import ROOT, invoke

ROLE = "arn:aws:iam::123456789012:role/doeks-sagemaker-execution"
SUBNETS = "subnet-0123456789abcdef0,subnet-0fedcba9876543210"
GROUPS = "sg-0123456789abcdef0"
VARIANTS = {
    "s3": {},
    "s3-spot": {"SAGEMAKER_SPOT": "true"},
    "s3-vpc": {"SAGEMAKER_SUBNETS": SUBNETS, "SAGEMAKER_SECURITY_GROUPS": GROUPS},
    "efs-vpc": {"EFS_FILE_SYSTEM_ID": "fs-0123456789abcdef0", "SAGEMAKER_SUBNETS": SUBNETS, "SAGEMAKER_SECURITY_GROUPS": GROUPS},
    "efs-vpc-spot-max": {"EFS_FILE_SYSTEM_ID": "fs-0123456789abcdef0", "SAGEMAKER_SUBNETS": ",".join(f"subnet-{i:017x}" for i in range(16)),
                         "SAGEMAKER_SECURITY_GROUPS": ",".join(f"sg-{i:017x}" for i in range(5)), "SAGEMAKER_SPOT": "true",
                         "SAGEMAKER_INSTANCE_COUNT": "100", "SAGEMAKER_MAX_RUN": "2419200", "SAGEMAKER_MAX_WAIT": "2419200",
                         "JOB_NAME": "a" * 50, "DATA_S3_PREFIX": "x/" * 100 + "data"},
}


def settings_for(env: dict, state_dir) -> S.Settings:
    return S.load(environ={"STATE_DIR": str(state_dir), "TARGET": "sagemaker", **env}, path=ROOT / ".env")


def model_problems(shape, value, path: str = "") -> list[str]:
    """max length / count, pattern and enum of `shape` (what botocore's parameter validation does not check)."""
    try:
        import regex as re_mod  # the model's patterns use \p{L} classes
    except ImportError:  # pragma: no cover
        re_mod = re
    problems = []
    meta = shape.metadata
    if shape.type_name == "string":
        if "max" in meta and len(value) > meta["max"]:
            problems.append(f"{path}: {len(value)} > max {meta['max']}")
        if "pattern" in meta and not re_mod.fullmatch(meta["pattern"], value):
            problems.append(f"{path}: {value!r} does not match {meta['pattern']}")
        if shape.enum and value not in shape.enum:
            problems.append(f"{path}: {value!r} not in {shape.enum}")
    elif shape.type_name in ("integer", "long"):
        if "max" in meta and value > meta["max"]:
            problems.append(f"{path}: {value} > max {meta['max']}")
    elif shape.type_name == "list":
        if "max" in meta and len(value) > meta["max"]:
            problems.append(f"{path}: {len(value)} items > max {meta['max']}")
        for i, item in enumerate(value):
            problems += model_problems(shape.member, item, f"{path}[{i}]")
    elif shape.type_name == "map":
        if "max" in meta and len(value) > meta["max"]:
            problems.append(f"{path}: {len(value)} entries > max {meta['max']}")
        for k, v in value.items():
            problems += model_problems(shape.key, k, f"{path}{{{k}}}") + model_problems(shape.value, v, f"{path}[{k}]")
    elif shape.type_name == "structure":
        for k, v in value.items():
            problems += model_problems(shape.members[k], v, f"{path}.{k}")
    return problems


def check_against_model(request: dict) -> None:
    client = boto3.client("sagemaker", region_name="us-west-2", aws_access_key_id="x", aws_secret_access_key="x")
    shape = client.meta.service_model.operation_model("CreateTrainingJob").input_shape
    assert model_problems(shape, request) == []
    with Stubber(client) as stub:  # the client validates the parameters against the model before the stub answers
        stub.add_response("create_training_job", {"TrainingJobArn": f"arn:aws:sagemaker:us-west-2:123456789012:training-job/{request['TrainingJobName']}"},
                          request)
        client.create_training_job(**request)
        stub.assert_no_pending_responses()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_request_variant_fits_the_service_model(variant, state_dir):
    s = settings_for(VARIANTS[variant], state_dir)
    request = sagemaker.training_request(s, ROLE, sagemaker.job_name(s), max_steps=5)
    check_against_model(request)
    source = request["InputDataConfig"][0]["DataSource"]
    if s.efs_file_system_id:
        assert source["FileSystemDataSource"]["FileSystemId"] == s.efs_file_system_id and "VpcConfig" in request
    else:
        assert source["S3DataSource"]["S3Uri"].startswith(f"s3://{s.s3_bucket}/{s.data_s3_prefix}")
    assert ("VpcConfig" in request) == bool(s.sagemaker_subnets)
    assert request.get("EnableManagedSpotTraining", False) == s.sagemaker_spot
    if s.sagemaker_spot:
        assert request["StoppingCondition"]["MaxWaitTimeInSeconds"] >= request["StoppingCondition"]["MaxRuntimeInSeconds"]
    # every job's checkpoints go to S3 through the checkpoint channel, spot or not (the instance's disk does not last)
    assert request["CheckpointConfig"]["LocalPath"] == request["HyperParameters"].get("checkpoint-dir", "/opt/ml/checkpoints")
    assert request["CheckpointConfig"]["S3Uri"] == f"s3://{s.s3_bucket}/doeks/{s.job_name}/checkpoints"


def test_longest_job_name_fits_and_latest_job_finds_it(state_dir):
    s = settings_for({"JOB_NAME": "a" * 50}, state_dir)
    name = sagemaker.job_name(s)
    assert len(name) <= 63 and name.startswith(sagemaker.name_prefix(s)) and s.job_name.startswith(sagemaker.name_prefix(s))


@pytest.mark.parametrize("env, message", [
    ({"SAGEMAKER_SUBNETS": SUBNETS}, "SAGEMAKER_SECURITY_GROUPS is empty"),
    ({"SAGEMAKER_SUBNETS": ",".join(f"subnet-{i:017x}" for i in range(17)), "SAGEMAKER_SECURITY_GROUPS": GROUPS}, "at most 16"),
    ({"SAGEMAKER_SUBNETS": SUBNETS, "SAGEMAKER_SECURITY_GROUPS": ",".join(f"sg-{i:017x}" for i in range(6))}, "at most 5"),
    ({"SAGEMAKER_INSTANCE_TYPE": "ml.g5.13xlarge"}, "not a SageMaker training instance type"),
])
def test_env_the_api_would_refuse_is_one_clear_error(env, message, state_dir):
    with pytest.raises(DoeksError, match=message):
        sagemaker.training_request(settings_for(env, state_dir), ROLE, "n")
    result = invoke("sagemaker.train", "--dry-run", env={"TARGET": "sagemaker", **env})
    assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr


def test_sagemaker_sdk_is_not_a_dependency():
    """boto3 alone: the SDK (v2 pinned <3, never imported) is no longer installed."""
    text = (ROOT / "pyproject.toml").read_text()
    assert not re.search(r'^\s*"sagemaker\b', text, re.M)


def test_instance_type_typo_gets_a_suggestion(state_dir):
    with pytest.raises(DoeksError, match=r"did you mean .*ml\.g5\.12xlarge"):
        sagemaker.training_request(settings_for({"SAGEMAKER_INSTANCE_TYPE": "ml.g5.13xlarge"}, state_dir), ROLE, "n")
    assert S.load(environ={"SAGEMAKER_INSTANCE_TYPE": "ml.g5.13xlarge"}, path=ROOT / ".env")  # the .env check alone lets it by

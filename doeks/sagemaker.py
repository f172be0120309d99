"""SageMaker training from the same training script and data: the execution role (scoped, not *FullAccess), the S3
gateway VPC endpoint, and CreateTrainingJob built with boto3 so the request is plain to read (`--dry-run` prints it).

boto3 alone, by decision: the SageMaker Python SDK v3 (`ModelTrainer` + `Torchrun`, which replaced the v2 Estimators)
would build this same CreateTrainingJob request, but it needs AWS (session, role, defaults) before it can show a request,
so `--dry-run` could not print one, and it adds a large dependency tree for nothing doeks uses; every request variant
(S3, EFS, VPC, spot) is instead checked against botocore's service model in the tests. The unused `sagemaker<3`
dependency is gone.

The script goes to S3 as `sourcedir.tar.gz` and runs in a PyTorch Deep Learning Container under torchrun
(`sagemaker_torch_distributed_enabled`), reading SM_CHANNEL_TRAINING / SM_MODEL_DIR like on SageMaker proper.
"""
from __future__ import annotations

import io
import json
import tarfile
import time
from pathlib import Path
from typing import Any

from . import ui
from .errors import DoeksError
from .settings import PROJECT_ROOT

WORKLOAD = PROJECT_ROOT / "doeks" / "workload"
TORCHCOMPAT = PROJECT_ROOT / "doeks" / "pod" / "torchcompat.py"  # beside checkpoints.py in the sourcedir
TRUST = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"Service": "sagemaker.amazonaws.com"},
                                                 "Action": "sts:AssumeRole"}]}


def role_policy(settings) -> dict[str, Any]:
    """Only what a training job needs: its bucket, logs, metrics, pulling the image and VPC interfaces."""
    bucket = f"arn:aws:s3:::{settings.s3_bucket}"
    statements = [
        {"Sid": "Bucket", "Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetBucketLocation"], "Resource": bucket},
        {"Sid": "Objects", "Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"], "Resource": f"{bucket}/*"},
        {"Sid": "Logs", "Effect": "Allow", "Action": ["logs:CreateLogGroup", "logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
         "Resource": f"arn:aws:logs:{settings.aws_region}:*:log-group:/aws/sagemaker/*"},
        {"Sid": "Metrics", "Effect": "Allow", "Action": ["cloudwatch:PutMetricData"], "Resource": "*",
         "Condition": {"StringLike": {"cloudwatch:namespace": "/aws/sagemaker/*"}}},
        {"Sid": "Image", "Effect": "Allow", "Action": ["ecr:GetAuthorizationToken", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer",
                                                       "ecr:BatchCheckLayerAvailability"], "Resource": "*"},
        {"Sid": "Vpc", "Effect": "Allow", "Action": ["ec2:CreateNetworkInterface", "ec2:CreateNetworkInterfacePermission",
                                                     "ec2:DeleteNetworkInterface", "ec2:DeleteNetworkInterfacePermission",
                                                     "ec2:DescribeNetworkInterfaces", "ec2:DescribeVpcs", "ec2:DescribeDhcpOptions",
                                                     "ec2:DescribeSubnets", "ec2:DescribeSecurityGroups"], "Resource": "*"},
    ]
    if settings.efs_file_system_id:
        statements.append({"Sid": "Efs", "Effect": "Allow", "Action": ["elasticfilesystem:ClientMount", "elasticfilesystem:DescribeMountTargets"],
                           "Resource": "*"})
    return {"Version": "2012-10-17", "Statement": statements}


def ensure_role(settings, runner) -> str:
    from .aws import client

    from .aws import lookup

    iam = client(settings, "iam")
    name = settings.sagemaker_role_name

    def existing() -> str:
        try:
            return iam.get_role(RoleName=name)["Role"]["Arn"]
        except iam.exceptions.NoSuchEntityException:
            return ""

    arn = lookup(runner, f"IAM role {name}", existing, unknown="")  # a dry run without credentials: planned as new
    if arn:
        ui.say(f"role {name} exists")
    else:
        created = runner.call(iam, "create_role", RoleName=name, AssumeRolePolicyDocument=json.dumps(TRUST),
                              Description="doeks: SageMaker training execution role", Tags=[{"Key": "doeks", "Value": "true"}])
        arn = created["Role"]["Arn"] if created else f"arn:aws:iam::<account>:role/{name}"
    runner.call(iam, "put_role_policy", RoleName=name, PolicyName="doeks-training", PolicyDocument=json.dumps(role_policy(settings)))
    return arn


def delete_role(settings, runner) -> None:
    from .aws import client

    from .aws import lookup

    iam = client(settings, "iam")
    name = settings.sagemaker_role_name
    try:
        policies = lookup(runner, f"inline policies of IAM role {name}",  # a dry run without credentials: ensure_role's
                          lambda: iam.list_role_policies(RoleName=name)["PolicyNames"], unknown=["doeks-training"])
        for policy in policies:
            runner.call(iam, "delete_role_policy", RoleName=name, PolicyName=policy)
        runner.call(iam, "delete_role", RoleName=name)
    except iam.exceptions.NoSuchEntityException:
        ui.say(f"role {name} does not exist: nothing to delete")


# the environment contract (docs/your-own-script.md): doeks' names on SageMaker, for SageMaker's own folders
ENVIRONMENT = {"DOEKS_DATA_DIR": "/opt/ml/input/data/training", "DOEKS_CHECKPOINT_DIR": "/opt/ml/checkpoints",
               "DOEKS_CHECKPOINT_URI": "/opt/ml/checkpoints",
               "DOEKS_MODEL_DIR": "/opt/ml/model", "DOEKS_OUTPUT_DIR": "/opt/ml/output/data"}


def hyperparameters_from_args(args: list[str], flag: str = "--train-args") -> dict[str, str]:
    """`--key value` pairs (the script's own flags) as SageMaker hyperparameters; one line for anything else."""
    import shlex

    result: dict[str, str] = {}
    i = 0
    while i < len(args):
        key = args[i]
        if not key.startswith("--") or i + 1 >= len(args) or args[i + 1].startswith("--"):
            raise DoeksError(f"{flag} {shlex.join(args)!r}: SageMaker passes hyperparameters as '--key value' "
                             f"pairs; {key!r} has no value")
        result[key[2:]] = args[i + 1]
        i += 2
    return result


def source_archive(settings=None, code=None) -> bytes:
    """The job's source folder as sourcedir.tar.gz (its script at the path sagemaker_program names, as SageMaker's
    framework containers expect): doeks/workload (train.py at the top), or the user's TRAIN_SOURCE. `code`: the
    job's, resolved once by whoever holds the job."""
    from .code import resolve

    code = code or (resolve(settings) if settings is not None else None)
    extra: dict[str, bytes] = {}
    if code is None or code.builtin:
        files = [(path, path.name) for path in sorted(WORKLOAD.glob("*.py"))]
        # SageMaker's training toolkit installs the sourcedir's requirements.txt before the script: the torch doeks is
        # tested with (the DLC's own is another), and the check of the private names checkpoints.py reads beside it
        extra["requirements.txt"] = "".join(f"{pin}\n" for pin in torch_requirements()).encode()
        files.append((TORCHCOMPAT, "torchcompat.py"))
    else:
        files = [(path, path.relative_to(code.source).as_posix()) for path in code.files()]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path, name in files:
            info = tar.gettarinfo(str(path), arcname=name)
            info.mtime = 0
            with open(path, "rb") as f:
                tar.addfile(info, f)
        for name, data in extra.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def torch_requirements() -> list[str]:
    """The pins that put doeks' tested torch on a SageMaker framework container (its sourcedir's requirements.txt)."""
    from .trainimage import TORCH_VERSION, TORCHVISION_VERSION

    return [f"torch=={TORCH_VERSION}", f"torchvision=={TORCHVISION_VERSION}"]


# CreateTrainingJob's limits that botocore's own parameter check does not enforce (it checks types, required members
# and minimums only): TrainingJobName <= 63 characters, VpcConfig.Subnets 1-16, VpcConfig.SecurityGroupIds 1-5
# (botocore data sagemaker/2017-07-24/service-2.json; tests/test_kubeflow_sagemaker.py checks every request variant
# against that model's max/pattern/enum as well).
NAME_MAX = 63
STAMP = "%Y%m%d-%H%M%S"
SUBNETS_MAX = 16
SECURITY_GROUPS_MAX = 5


def name_prefix(settings) -> str:
    """JOB_NAME cut so that `<prefix>-<YYYYmmdd-HHMMSS>` fits TrainingJobName's 63 characters (JOB_NAME may be 50)."""
    return settings.job_name[: NAME_MAX - len(time.strftime(STAMP)) - 1].rstrip("-")


def job_name(settings) -> str:
    return f"{name_prefix(settings)}-{time.strftime(STAMP)}"


def training_instance_types() -> list[str]:
    """ResourceConfig.InstanceType's enum in botocore's SageMaker service model (what CreateTrainingJob accepts)."""
    import botocore.session

    model = botocore.session.get_session().get_service_model("sagemaker")
    return list(model.operation_model("CreateTrainingJob").input_shape.members["ResourceConfig"].members["InstanceType"].enum)


def check_instance_type(settings) -> None:
    """SAGEMAKER_INSTANCE_TYPE's own check is a pattern (ml.<family>.<size>); the API takes only its enum."""
    import difflib

    known = training_instance_types()
    if known and settings.sagemaker_instance_type not in known:
        close = difflib.get_close_matches(settings.sagemaker_instance_type, known, n=3)
        raise DoeksError(f"SAGEMAKER_INSTANCE_TYPE={settings.sagemaker_instance_type} is not a SageMaker training instance type"
                         + (f" (did you mean {', '.join(close)}?)" if close else ""))


def vpc_config(settings) -> dict[str, Any] | None:
    """VpcConfig from SAGEMAKER_SUBNETS / SAGEMAKER_SECURITY_GROUPS, or None; the API needs both lists non-empty."""
    if not settings.sagemaker_subnets:
        return None
    subnets = settings.sagemaker_subnets.split(",")
    groups = settings.sagemaker_security_groups.split(",") if settings.sagemaker_security_groups else []
    if not groups:
        raise DoeksError("SAGEMAKER_SUBNETS is set but SAGEMAKER_SECURITY_GROUPS is empty: VPC training needs 1-5 security groups")
    if len(subnets) > SUBNETS_MAX:
        raise DoeksError(f"SAGEMAKER_SUBNETS lists {len(subnets)} subnets: SageMaker takes at most {SUBNETS_MAX}")
    if len(groups) > SECURITY_GROUPS_MAX:
        raise DoeksError(f"SAGEMAKER_SECURITY_GROUPS lists {len(groups)} groups: SageMaker takes at most {SECURITY_GROUPS_MAX}")
    return {"Subnets": subnets, "SecurityGroupIds": groups}


def training_request(settings, role_arn: str, name: str, max_steps: int = 0, code=None) -> dict[str, Any]:
    """The full CreateTrainingJob request: same script, same data layout, torchrun distribution."""
    from .code import resolve

    check_instance_type(settings)
    code = code or resolve(settings)
    if code.module:
        raise DoeksError(f"TRAIN_SCRIPT={settings.train_script!r}: SageMaker runs a script file (sagemaker_program), "
                         "not -m module: name the module's .py file")
    prefix = f"s3://{settings.s3_bucket}/doeks/{name}"
    hyper = {"sagemaker_program": code.entry, "sagemaker_submit_directory": f"{prefix}/source/sourcedir.tar.gz",
             "sagemaker_torch_distributed_enabled": "true", "sagemaker_region": settings.aws_region}
    if not code.builtin:  # a user's script: its own arguments alone, as hyperparameters (given back as --key value)
        hyper.update(hyperparameters_from_args(list(code.args), "TRAIN_ARGS"))
    else:
        hyper.update({
             "arch": settings.arch, "epochs": str(settings.epochs), "batch-size": str(settings.batch_size),
             "lr": str(settings.learning_rate), "checkpoint-every": str(settings.checkpoint_every),
             "checkpoint-when-busy": settings.checkpoint_when_busy,
             "checkpoint-dir": "/opt/ml/checkpoints", "workers": str(settings.data_workers),
             "crop-size": str(settings.crop)})  # train.py's defaults are the ImageNet recipe
        hyper.update(hyperparameters_from_args(list(code.args), "TRAIN_ARGS"))
    if max_steps:
        hyper["max-steps"] = str(max_steps)
    if settings.efs_file_system_id:
        source = {"FileSystemDataSource": {"FileSystemId": settings.efs_file_system_id, "FileSystemAccessMode": "ro",
                                           "FileSystemType": "EFS", "DirectoryPath": f"/{settings.data_s3_prefix.strip('/')}"}}
    else:
        source = {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": f"s3://{settings.s3_bucket}/{settings.data_s3_prefix.strip('/')}/",
                                   "S3DataDistributionType": "FullyReplicated"}}
    request: dict[str, Any] = {
        "TrainingJobName": name,
        "RoleArn": role_arn,
        "AlgorithmSpecification": {"TrainingImage": settings.sagemaker_image, "TrainingInputMode": "File",
                                   "EnableSageMakerMetricsTimeSeries": True,
                                   "MetricDefinitions": [{"Name": "train:loss", "Regex": r"loss=([0-9.]+)"},
                                                         {"Name": "val:accuracy", "Regex": r"val_acc=([0-9.]+)"},
                                                         {"Name": "train:samples_per_s", "Regex": r"samples/s=([0-9.]+)"}]},
        "HyperParameters": hyper,
        "Environment": ENVIRONMENT | {"DOEKS_RUN_ID": name},  # doeks' names for SageMaker's folders (doeks.code)
        "InputDataConfig": [{"ChannelName": "training", "DataSource": source, "InputMode": "File"}],
        "OutputDataConfig": {"S3OutputPath": f"{prefix}/output"},
        "ResourceConfig": {"InstanceType": settings.sagemaker_instance_type, "InstanceCount": settings.sagemaker_instance_count,
                           "VolumeSizeInGB": 100},
        "StoppingCondition": {"MaxRuntimeInSeconds": settings.sagemaker_max_run},
        "Tags": [{"Key": "doeks/job", "Value": settings.job_name}],
    }
    vpc = vpc_config(settings)
    if vpc:
        request["VpcConfig"] = vpc
    if settings.sagemaker_spot:
        request["EnableManagedSpotTraining"] = True
        request["StoppingCondition"]["MaxWaitTimeInSeconds"] = settings.sagemaker_max_wait
    # every job's checkpoints in S3 through SageMaker's checkpoint channel (not only spot jobs': the instance's disk
    # goes with the job, and CHECKPOINT_URI's help says this is where they are)
    request["CheckpointConfig"] = {"S3Uri": f"s3://{settings.s3_bucket}/doeks/{settings.job_name}/checkpoints",
                                   "LocalPath": "/opt/ml/checkpoints"}
    return request


def submit(settings, runner, max_steps: int = 0) -> dict[str, Any]:
    from .aws import client

    if settings.efs_file_system_id and not settings.sagemaker_subnets:
        raise DoeksError("EFS data needs VPC training: set SAGEMAKER_SUBNETS (and SAGEMAKER_SECURITY_GROUPS)")
    name = job_name(settings)
    if runner.dry_run:
        role_arn = f"arn:aws:iam::<account>:role/{settings.sagemaker_role_name}"
    else:
        iam = client(settings, "iam")
        try:
            role_arn = iam.get_role(RoleName=settings.sagemaker_role_name)["Role"]["Arn"]
        except iam.exceptions.NoSuchEntityException:
            raise DoeksError(f"execution role {settings.sagemaker_role_name} does not exist: run `invoke kubeflow.sagemaker.role`") from None
    request = training_request(settings, role_arn, name, max_steps)
    s3 = client(settings, "s3")
    key = request["HyperParameters"]["sagemaker_submit_directory"].split(f"s3://{settings.s3_bucket}/", 1)[1]
    runner.call(s3, "put_object", Bucket=settings.s3_bucket, Key=key, Body=f"<sourcedir.tar.gz of {WORKLOAD}>" if runner.dry_run else source_archive(settings))
    runner.call(client(settings, "sagemaker"), "create_training_job", **request)
    if not runner.dry_run:
        ui.say(f"training job {name} submitted ({settings.sagemaker_instance_count} x {settings.sagemaker_instance_type})")
    return request


def describe(settings, name: str) -> dict[str, Any]:
    from .aws import client

    sm = client(settings, "sagemaker")
    try:
        return sm.describe_training_job(TrainingJobName=name)
    except sm.exceptions.ClientError as error:
        raise DoeksError(f"training job {name}: {error.response['Error']['Message']}") from None


def latest_job(settings) -> str:
    from .aws import client

    jobs = client(settings, "sagemaker").list_training_jobs(NameContains=name_prefix(settings), SortBy="CreationTime",
                                                            SortOrder="Descending", MaxResults=1)["TrainingJobSummaries"]
    if not jobs:
        raise DoeksError(f"no SageMaker training job named {settings.job_name}-*: submit one with `invoke kubeflow.sagemaker.train`")
    return jobs[0]["TrainingJobName"]


def stop(settings, runner, name: str) -> None:
    from .aws import client, lookup

    # a dry run without credentials: the status is unknown and the stop is planned
    status = lookup(runner, f"status of training job {name}", lambda: describe(settings, name)["TrainingJobStatus"],
                    unknown="InProgress")
    if status not in ("InProgress",):
        ui.say(f"training job {name} is {status}: nothing to stop")
        return
    runner.call(client(settings, "sagemaker"), "stop_training_job", TrainingJobName=name)


def logs(settings, name: str) -> list[str]:
    """The job's CloudWatch log lines; says so when the backend keeps none (e.g. a local AWS-API endpoint)."""
    from .aws import client

    cw = client(settings, "logs")
    group = "/aws/sagemaker/TrainingJobs"
    try:
        streams = cw.describe_log_streams(logGroupName=group, logStreamNamePrefix=name)["logStreams"]
    except cw.exceptions.ResourceNotFoundException:
        return []
    lines = []
    for stream in streams:
        for event in cw.get_log_events(logGroupName=group, logStreamName=stream["logStreamName"], startFromHead=True)["events"]:
            lines.append(f"[{stream['logStreamName']}] {event['message']}")
    return lines


def ensure_s3_endpoint(settings, runner, vpc_id: str) -> str | None:
    """The S3 gateway endpoint for a VPC (so training in that VPC reaches S3); idempotent."""
    from .aws import client, lookup

    ec2 = client(settings, "ec2")
    service = f"com.amazonaws.{settings.aws_region}.s3"
    live = lookup(runner, f"S3 gateway endpoint in {vpc_id}", lambda: _s3_endpoints(settings, ec2, vpc_id), unknown=[])
    if live:
        ui.say(f"S3 gateway endpoint {live[0]} exists in {vpc_id}")
        return live[0]
    tables = lookup(runner, f"route tables of {vpc_id}", lambda: [
        t["RouteTableId"] for t in ec2.describe_route_tables(Filters=[{"Name": "vpc-id", "Values": [vpc_id]}])["RouteTables"]],
        unknown=["<route tables of the VPC>"])
    created = runner.call(ec2, "create_vpc_endpoint", VpcEndpointType="Gateway", VpcId=vpc_id, ServiceName=service,
                          RouteTableIds=tables, TagSpecifications=[{"ResourceType": "vpc-endpoint", "Tags": [{"Key": "doeks", "Value": "s3"}]}])
    return created["VpcEndpoint"]["VpcEndpointId"] if created else None


def _s3_endpoints(settings, ec2, vpc_id: str) -> list[str]:
    """The live S3 gateway endpoints of a VPC."""
    service = f"com.amazonaws.{settings.aws_region}.s3"
    found = ec2.describe_vpc_endpoints(Filters=[{"Name": "vpc-id", "Values": [vpc_id]}, {"Name": "service-name", "Values": [service]}])["VpcEndpoints"]
    return [e["VpcEndpointId"] for e in found if e.get("State", "").lower() not in ("deleted", "deleting")]


def delete_s3_endpoint(settings, runner, vpc_id: str) -> int:
    from .aws import client, lookup

    ec2 = client(settings, "ec2")
    ids = lookup(runner, f"S3 gateway endpoints in {vpc_id}", lambda: _s3_endpoints(settings, ec2, vpc_id),
                 unknown=["<S3 gateway endpoint>"])
    if ids:
        runner.call(ec2, "delete_vpc_endpoints", VpcEndpointIds=ids)
    else:
        ui.say(f"no S3 gateway endpoint in {vpc_id}: nothing to delete")
    return len(ids)


def upload_data(settings, runner, local: Path) -> int:
    """Copy a local data folder (train/, val/) to s3://S3_BUCKET/DATA_S3_PREFIX/ (a bucket of another account
    refused in one line first)."""
    from .aws import client
    from .quotas import require_own_bucket

    require_own_bucket(settings, runner)
    s3 = client(settings, "s3")
    try:
        s3.head_bucket(Bucket=settings.s3_bucket)
    except Exception:  # noqa: BLE001 - absent bucket
        runner.call(s3, "create_bucket", Bucket=settings.s3_bucket,
                    **({} if settings.aws_region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": settings.aws_region}}))
    files = [p for p in local.rglob("*") if p.is_file()]
    for path in files:
        key = f"{settings.data_s3_prefix.strip('/')}/{path.relative_to(local).as_posix()}"
        if runner.dry_run:
            continue
        s3.upload_file(str(path), settings.s3_bucket, key)
    runner.note(f"{len(files)} files {'would be ' if runner.dry_run else ''}uploaded to s3://{settings.s3_bucket}/{settings.data_s3_prefix}/")
    return len(files)

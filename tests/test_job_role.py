"""The training jobs' own S3 role (doeks.jobpaths.job_s3_policy: CHECKPOINT_URI's and MODEL_URI's prefixes, each job
under its name), with moto's IAM enforcing it: a user holding exactly that policy makes every call the checkpoints and
model make, and nothing outside those prefixes. Here the user's keys stand in for the role's session; the role itself,
with its session from EKS Auth against doeks' server: tests/test_rehearsal_iam.py."""
from __future__ import annotations

import json
import boto3
import pytest
from botocore.exceptions import ClientError

from doeks import jobpaths
from doeks import settings as S


def _denied(call) -> bool:
    try:
        call()
    except ClientError as error:
        return error.response["ResponseMetadata"]["HTTPStatusCode"] == 403 or "AccessDenied" in error.response["Error"]["Code"]
    return False


def test_policy_names_exactly_the_checkpoint_and_model_prefixes(monkeypatch):
    """CHECKPOINT_URI's and MODEL_URI's prefixes, under which each job writes its own <JOB_NAME>/: the cluster's
    jobs share the role (one service account per namespace), so a policy naming one job's prefix would be replaced by
    the next job's deploy while the first still saves."""
    s = S.load({"CHECKPOINT_URI": "s3://ml-bucket/checkpoints", "MODEL_URI": "s3://ml-bucket/models", "JOB_NAME": "resnet"})
    policy = jobpaths.job_s3_policy(s)
    listing, objects = policy["Statement"]
    assert listing["Resource"] == "arn:aws:s3:::ml-bucket"
    assert listing["Condition"]["StringLike"]["s3:prefix"] == ["checkpoints", "checkpoints/*", "models", "models/*"]
    assert objects["Resource"] == ["arn:aws:s3:::ml-bucket/checkpoints/*", "arn:aws:s3:::ml-bucket/models/*"]
    assert jobpaths.job_s3_policy(s.with_overrides(job_name="other")) == policy  # every job of the cluster: one policy
    assert sorted(objects["Action"] + [listing["Action"]]) == sorted(jobpaths.JOB_S3_CALLS)
    assert not any("*" in a for a in objects["Action"])
    assert jobpaths.pod_env(s) == {"AWS_REGION": s.aws_region}
    assert jobpaths.job_s3_policy(S.load({"CHECKPOINT_URI": "", "MODEL_URI": ""})) is None  # the shared volume: no role
    whole = jobpaths.job_s3_policy(S.load({"CHECKPOINT_URI": "s3://ml-bucket", "MODEL_URI": "/models"}))
    assert whole["Statement"][0] == {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::ml-bucket"}
    assert whole["Statement"][1]["Resource"] == ["arn:aws:s3:::ml-bucket/*"]  # a whole bucket named: the user's choice


def test_a_user_with_exactly_the_job_policy_makes_the_checkpoint_calls_and_nothing_else():
    """Every S3 call doeks/workload/checkpoints.py makes (through s3fs and DCP's writer: list the job's prefix, head,
    get, a ranged get (a restore's streams), put, a multipart upload and its abort, the copy of DCP's rename, delete) by a user holding exactly the job's
    policy, with moto enforcing IAM (in process: moto's server refuses every signed ListObjectsV2 whose prefix holds
    a '/' with SignatureDoesNotMatch, its query re-encoded differently from botocore's); then what it must not do."""
    from moto import mock_aws
    from moto.core import set_initial_no_auth_action_count

    s = S.load({"CHECKPOINT_URI": "s3://ml-bucket/checkpoints", "MODEL_URI": "s3://ml-bucket/models", "JOB_NAME": "resnet"})

    @set_initial_no_auth_action_count(4)  # the set-up below runs as root; then every call is checked
    @mock_aws
    def run():
        root_s3, iam = boto3.client("s3", region_name="us-west-2"), boto3.client("iam", region_name="us-west-2")
        root_s3.create_bucket(Bucket="ml-bucket", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
        iam.create_user(UserName="job")
        iam.put_user_policy(UserName="job", PolicyName="job-s3", PolicyDocument=json.dumps(jobpaths.job_s3_policy(s)))
        key = iam.create_access_key(UserName="job")["AccessKey"]
        job = boto3.client("s3", region_name="us-west-2", aws_access_key_id=key["AccessKeyId"],
                           aws_secret_access_key=key["SecretAccessKey"])
        prefix = "checkpoints/resnet"
        job.put_object(Bucket="ml-bucket", Key=f"{prefix}/step-10/__0_0.distcp", Body=b"x" * 10)
        upload = job.create_multipart_upload(Bucket="ml-bucket", Key=f"{prefix}/step-10/__1_0.distcp")["UploadId"]
        part = job.upload_part(Bucket="ml-bucket", Key=f"{prefix}/step-10/__1_0.distcp", UploadId=upload, PartNumber=1,
                               Body=b"y" * 10)
        job.complete_multipart_upload(Bucket="ml-bucket", Key=f"{prefix}/step-10/__1_0.distcp", UploadId=upload,
                                      MultipartUpload={"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]})
        dead = job.create_multipart_upload(Bucket="ml-bucket", Key=f"{prefix}/step-20/__0_0.distcp")["UploadId"]
        job.abort_multipart_upload(Bucket="ml-bucket", Key=f"{prefix}/step-20/__0_0.distcp", UploadId=dead)
        job.put_object(Bucket="ml-bucket", Key=f"{prefix}/step-10/.metadata.tmp", Body=b"m")
        job.copy_object(Bucket="ml-bucket", Key=f"{prefix}/step-10/.metadata",
                        CopySource={"Bucket": "ml-bucket", "Key": f"{prefix}/step-10/.metadata.tmp"})
        job.delete_object(Bucket="ml-bucket", Key=f"{prefix}/step-10/.metadata.tmp")
        job.put_object(Bucket="ml-bucket", Key=f"{prefix}/latest", Body=b"step-10\n")
        listed = job.list_objects_v2(Bucket="ml-bucket", Prefix=f"{prefix}/", Delimiter="/")
        assert [p["Prefix"] for p in listed["CommonPrefixes"]] == [f"{prefix}/step-10/"]
        assert job.head_object(Bucket="ml-bucket", Key=f"{prefix}/step-10/.metadata")["ContentLength"] == 1
        assert job.get_object(Bucket="ml-bucket", Key=f"{prefix}/latest")["Body"].read() == b"step-10\n"
        ranged = job.get_object(Bucket="ml-bucket", Key=f"{prefix}/step-10/__1_0.distcp", Range="bytes=2-5")  # (a restore)
        assert ranged["Body"].read() == b"yyyy"
        job.delete_objects(Bucket="ml-bucket", Delete={"Objects": [{"Key": f"{prefix}/step-10/__0_0.distcp"}]})
        job.put_object(Bucket="ml-bucket", Key="models/resnet/model.pt", Body=b"model")

        assert _denied(lambda: job.put_object(Bucket="ml-bucket", Key="checkpoints-other/x", Body=b"x"))
        assert _denied(lambda: job.get_object(Bucket="ml-bucket", Key="data/imagenet/x"))
        # (moto does not evaluate the s3:prefix condition of ListBucket: the first test checks the condition itself)
        assert _denied(lambda: job.delete_object(Bucket="ml-bucket", Key="models.pt"))
        assert _denied(lambda: job.put_object(Bucket="ml-bucket", Key="data/imagenet/train/x.JPEG", Body=b"x"))
        assert _denied(lambda: job.create_bucket(Bucket="another", CreateBucketConfiguration={"LocationConstraint": "us-west-2"}))

    run()

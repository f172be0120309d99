"""S3 bucket names are global (issue 55, 3c): the default S3_BUCKET `doeks-training` may be another account's. Before
`up` makes anything, a bucket that exists and is not this account's is refused in one line naming a name of one's
own; this account's bucket and a missing one (doeks makes it) pass. Against the moto server, where another account
(STS AssumeRole into 111111111111) made the bucket first."""
from __future__ import annotations

import boto3
import pytest

from doeks import quotas
from doeks import settings as S
from doeks.errors import DoeksError

from . import moto_eks
from .conftest import invoke

OTHER = "111111111111"


@pytest.fixture
def account(state_dir, tmp_path):
    server = moto_eks.server(state_dir)
    server.start()
    plain = dict(region_name="us-west-2", endpoint_url=server.endpoint(), aws_access_key_id="testing",
                 aws_secret_access_key="testing")
    creds = boto3.client("sts", **plain).assume_role(RoleArn=f"arn:aws:iam::{OTHER}:role/someone-else",
                                                     RoleSessionName="other")["Credentials"]
    other = boto3.client("s3", region_name="us-west-2", endpoint_url=server.endpoint(),
                         aws_access_key_id=creds["AccessKeyId"], aws_secret_access_key=creds["SecretAccessKey"],
                         aws_session_token=creds["SessionToken"])
    other.create_bucket(Bucket="doeks-training", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    boto3.client("s3", **plain).create_bucket(Bucket="mine", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    yield {"TARGET": "eks", "AWS_ENDPOINT_URL": server.endpoint(), "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "DOEKS_CACHE": str(tmp_path / "cache"), "COLUMNS": "250"}
    server.stop()


def test_a_bucket_of_another_account_is_refused_in_one_line_and_ours_or_none_pass(account):
    s = S.load(environ=account)
    assert quotas.bucket_owner(s, "mine") == "ours"
    assert quotas.bucket_owner(s, "nobody-has-this-one") == "absent"
    assert quotas.bucket_owner(s, "doeks-training") == "not 123456789012"
    quotas.require_own_bucket(s, buckets=["mine", "nobody-has-this-one"])
    with pytest.raises(DoeksError, match=r"S3_BUCKET=doeks-training: that bucket exists and is not this account's "
                                         r"\(123456789012\).*S3_BUCKET=doeks-123456789012-us-west-2"):
        quotas.require_own_bucket(s)


def test_eks_create_refuses_another_accounts_bucket_before_anything(account):
    result = invoke("eks.create", "--dry-run", env=account)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-2000:]
    assert "S3_BUCKET=doeks-training: that bucket exists and is not this account's" in errors[0]
    assert "Traceback" not in result.stderr and "eksctl create cluster" not in result.stderr

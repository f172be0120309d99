"""TARGET=eks with a user's own script (issue 31, failure 5) and the staging Job (failure 3), against the moto server
as the account and a recording kubectl: `up` needs no ImageNet data for a user's script; a deploy after a code edit
(a new content tag that no push has made) is refused in one line naming the command; a new staging Job replaces the
previous one instead of being applied over it (a Job's pod template is immutable: "field is immutable")."""
from __future__ import annotations

import json
import os
import shutil

import boto3
import pytest
import yaml

from . import moto_eks
from .conftest import ROOT, invoke


@pytest.fixture
def account(state_dir, tmp_path):
    server = moto_eks.server(state_dir)
    server.start()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(ROOT / "tests" / "recorder.py", bin_dir / "kubectl")
    os.chmod(bin_dir / "kubectl", 0o755)
    env = {"TARGET": "eks", "AWS_ENDPOINT_URL": server.endpoint(), "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "RECORD": str(tmp_path / "record.jsonl"), "DOEKS_CACHE": str(tmp_path / "cache"), "COLUMNS": "250",
           "GPU_INSTANCE_TYPE": "g5.2xlarge", "S3_BUCKET": "user-bucket"}
    yield env, boto3.client("s3", region_name="us-west-2", endpoint_url=server.endpoint(), aws_access_key_id="testing",
                            aws_secret_access_key="testing")
    server.stop()


def recorded(env) -> list[dict]:
    path = env["RECORD"]
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def test_a_users_script_needs_no_imagenet_data(account):
    env, s3 = account
    mine = {**env, "TRAIN_SCRIPT": str(ROOT / "examples" / "ddp-plain" / "train.py")}
    plan = invoke("up", "--dry-run", "--full", env=mine)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "no data under s3://user-bucket/data/imagenet/: nothing staged" in plan.stderr
    assert "Job" not in {d.get("kind") for d in yaml.safe_load_all(plan.stdout) if d}  # no staging Job
    s3.create_bucket(Bucket="user-bucket", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    s3.put_object(Bucket="user-bucket", Key="data/imagenet/tokens.bin", Body=b"x")  # any data: staged as it is
    staged = invoke("up", "--dry-run", "--full", env=mine)
    assert staged.returncode == 0 and "nothing staged" not in staged.stderr
    assert "Job" in {d.get("kind") for d in yaml.safe_load_all(staged.stdout) if d}
    builtin = invoke("up", "--dry-run", "--full", env={**env, "S3_BUCKET": "empty-bucket"})  # the ImageNet job still needs it
    assert builtin.returncode != 0 and "no training data under s3://empty-bucket/data/imagenet/train/" in builtin.stderr


def test_a_deploy_after_a_code_edit_is_refused_until_the_image_is_pushed(account, tmp_path):
    env, _ = account
    script = tmp_path / "code" / "train.py"
    script.parent.mkdir()
    script.write_text("print('step 1')\n")
    mine = {**env, "TRAIN_SCRIPT": str(script)}
    boto3.client("ecr", region_name="us-west-2", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_repository(repositoryName="doeks-train")
    refused = invoke("elasticjob.deploy", env=mine)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    lines = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "is not in ECR" in lines[0] and "invoke elasticjob.build elasticjob.push" in lines[0]
    assert not [c for c in recorded(env) if c["argv"][:1] == ["apply"]]  # nothing applied


def test_a_new_staging_job_replaces_the_previous_one(account):
    env, s3 = account
    s3.create_bucket(Bucket="user-bucket", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    boto3.client("eks", region_name="us-west-2", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_cluster(
        name="doeks", roleArn="arn:aws:iam::123456789012:role/eks", resourcesVpcConfig={"subnetIds": ["subnet-1"]})
    staged = invoke("csi.data.stage", env={**env, "TRAIN_IMAGE": "123456789012.dkr.ecr.us-west-2.amazonaws.com/x:2"})
    assert staged.returncode == 0, staged.stderr[-2000:]
    calls = [c for c in recorded(env) if c["argv"][:1] in (["apply"], ["delete"])]
    job = next(i for i, c in enumerate(calls) if c["argv"][0] == "apply" and "kind: Job" in c["stdin"])
    deleted = [i for i, c in enumerate(calls) if c["argv"][0] == "delete" and "kind: Job" in c["stdin"]]
    assert deleted and deleted[0] < job, calls  # the previous Job goes first, with its pods
    assert "imagenet-stage" in calls[deleted[0]]["stdin"]


def test_a_push_of_a_tag_ecr_has_already_pushes_nothing(account, tmp_path):
    """Failure 3 (`up` cannot run twice): the ECR repository is IMMUTABLE (a tag is the content's hash) and the push
    was unconditional, so the second `up` pushed a tag ECR already had, which ECR refuses. The eks target's own push
    (trainimage.push; the rehearsal has its own copy of this check) now asks ECR first: with the tag there,
    `elasticjob.push` exits 0 and never reaches docker (this code's image is not even built here). On the previous
    code it went on to docker (one line: the image is not built), the step that on AWS is the refused second push."""
    from doeks import settings as S
    from doeks import trainimage
    from doeks.runner import Runner

    env, _ = account
    script = tmp_path / "code" / "train.py"
    script.parent.mkdir()
    script.write_text("print('pushed once')\n")  # a script of its own: a tag no docker image here has
    mine = {**env, "TRAIN_SCRIPT": str(script)}
    s = S.load(environ={**os.environ, **mine}, path=ROOT / ".env")
    remote = trainimage.reference(s, on_this_machine=False)
    host, tag = remote.split("/", 1)[0], remote.rsplit(":", 1)[1]
    assert host == "123456789012.dkr.ecr.us-west-2.amazonaws.com", remote  # this account's ECR, as moto answers STS
    trainimage.ensure_repository(s, Runner(echo=False))  # as the first `up` made it
    ecr = boto3.client("ecr", region_name="us-west-2", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                       aws_secret_access_key="testing")
    assert ecr.describe_repositories(repositoryNames=["doeks-train"])["repositories"][0]["imageTagMutability"] == "IMMUTABLE"
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "size": 2,
                                      "digest": "sha256:" + "4" * 64}, "layers": []})
    ecr.put_image(repositoryName="doeks-train", imageManifest=manifest, imageTag=tag)  # the first `up`'s push
    again = invoke("elasticjob.push", env=mine)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"{remote} is in ECR already: not pushed again" in again.stdout + again.stderr
    assert "Traceback" not in again.stderr
    assert [i["imageTag"] for i in ecr.list_images(repositoryName="doeks-train")["imageIds"]] == [tag]

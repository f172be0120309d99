"""The EKS rehearsal's IAM (doeks.rehearsal): doeks' moto server with IAM enforced, doeks itself as an administrator,
and a workload's calls made with the credentials EKS Pod Identity gives its pods: a service-account token exchanged
with EKS Auth's AssumeRoleForPodIdentity for the associated role's session. The staging Job's role (doeks/identity.py)
stages its prefix with the real stager and is refused everything else, as on AWS.

The token here is signed by the test's own key (the server checks it against DOEKS_SA_PUBLIC_KEY, as it checks the
cluster's service-account key in the rehearsal); tests/test_rehearsal_cluster.py gets one from the API server."""
from __future__ import annotations

import base64
import json
import time

import boto3
import pytest
from botocore.exceptions import ClientError

from doeks import datastage, identity, rehearsal
from doeks import settings as S
from doeks.errors import DoeksError
from doeks.runner import Runner

from . import moto_eks
from .conftest import ROOT

REGION = "us-west-2"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    folder = tmp_path_factory.mktemp("sa")
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (folder / "sa.pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return folder / "sa.pub", key, other


def token(key, namespace: str, account: str, audience: str = "pods.eks.amazonaws.com", expires: float = 3600) -> str:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    head = _b64(json.dumps({"alg": "RS256", "kid": "x"}).encode())
    claims = {"aud": [audience], "exp": int(time.time() + expires), "iss": "https://kubernetes.default.svc.cluster.local",
              "kubernetes.io": {"namespace": namespace, "serviceaccount": {"name": account, "uid": "u"}},
              "sub": f"system:serviceaccount:{namespace}:{account}"}
    payload = _b64(json.dumps(claims).encode())
    signature = key.sign(f"{head}.{payload}".encode(), padding.PKCS1v15(), hashes.SHA256())
    return f"{head}.{payload}.{_b64(signature)}"


@pytest.fixture
def account(state_dir, keys, monkeypatch):
    """An account with data in S3 and a cluster, then IAM enforced with doeks as the administrator."""
    public, _, _ = keys
    server = moto_eks.server(state_dir, env={"DOEKS_SA_PUBLIC_KEY": str(public)})
    server.start()
    endpoint = server.endpoint()
    plain = dict(region_name=REGION, endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing")
    s3 = boto3.client("s3", **plain)
    s3.create_bucket(Bucket="doeks-training", CreateBucketConfiguration={"LocationConstraint": REGION})
    for key in ("data/imagenet/train/n01/a.JPEG", "data/imagenet/val/n01/b.JPEG", "private/secret.txt"):
        s3.put_object(Bucket="doeks-training", Key=key, Body=b"x" * 100)
    boto3.client("eks", **plain).create_cluster(name="doeks", roleArn="arn:aws:iam::123456789012:role/eks",
                                                resourcesVpcConfig={"subnetIds": ["subnet-1"]})
    admin = rehearsal.enforce_iam(endpoint, state_dir, REGION)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", admin["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", admin["aws_secret_access_key"])
    settings = S.load(environ={"TARGET": "eks", "AWS_ENDPOINT_URL": endpoint, "STATE_DIR": str(state_dir),
                               "AWS_ACCESS_KEY_ID": admin["aws_access_key_id"],
                               "AWS_SECRET_ACCESS_KEY": admin["aws_secret_access_key"]}, path=ROOT / ".env")
    yield settings, endpoint, admin
    server.stop()


def test_iam_is_enforced_and_doeks_acts_as_the_administrator(account):
    settings, endpoint, admin = account
    stranger = boto3.client("s3", region_name=REGION, endpoint_url=endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing")
    with pytest.raises(ClientError, match="InvalidAccessKeyId"):
        stranger.list_buckets()
    assert rehearsal.enforce_iam(endpoint, settings.state_dir, REGION) == admin  # safe twice
    assert oct(rehearsal.admin_file(settings.state_dir).stat().st_mode & 0o777) == "0o600"


def test_the_staging_jobs_pods_get_its_role_and_can_do_what_its_policy_allows_and_nothing_else(account, keys, tmp_path):
    settings, endpoint, admin = account
    _, key, _ = keys
    workload = identity.get("data-stage")
    identity.ensure(settings, Runner(echo=False), workload)  # the role, its policy, the association: doeks' own code
    creds = rehearsal.pod_credentials(endpoint, REGION, "doeks", token(key, settings.namespace, workload.service_account), admin)
    assert creds["role"].startswith(f"arn:aws:sts::123456789012:assumed-role/{identity.role_name(settings, workload)}/")
    assert creds["subject"] == f"{settings.namespace}/{workload.service_account}"
    session = {k: creds[k] for k in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")}
    result = datastage.stage("s3://doeks-training/data/imagenet", tmp_path / "data", region=REGION, credentials=session,
                             endpoint_url=endpoint, concurrency=4)
    assert result.files == 2 and (tmp_path / "data" / "train" / "n01" / "a.JPEG").read_bytes() == b"x" * 100
    s3 = boto3.client("s3", region_name=REGION, endpoint_url=endpoint, **session)
    for call in (lambda: s3.get_object(Bucket="doeks-training", Key="private/secret.txt"),
                 lambda: s3.put_object(Bucket="doeks-training", Key="data/imagenet/train/n01/c.JPEG", Body=b"y"),
                 lambda: s3.list_objects_v2(Bucket="doeks-training", Prefix="private/"),
                 lambda: s3.list_objects_v2(Bucket="doeks-training"),
                 lambda: boto3.client("ec2", region_name=REGION, endpoint_url=endpoint, **session).describe_vpcs(),
                 lambda: boto3.client("iam", region_name=REGION, endpoint_url=endpoint, **session).list_roles()):
        with pytest.raises(ClientError, match="AccessDenied"):
            call()


def test_eks_auth_refuses_a_pod_without_association_or_with_a_bad_token(account, keys):
    settings, endpoint, admin = account
    _, key, other = keys
    with pytest.raises(DoeksError, match="ResourceNotFoundException: no pod identity association for default/nobody"):
        rehearsal.pod_credentials(endpoint, REGION, "doeks", token(key, "default", "nobody"), admin)
    for bad, why in ((token(other, "default", "doeks-stage"), "signature"),
                     (token(key, "default", "doeks-stage", audience="sts.amazonaws.com"), "audience"),
                     (token(key, "default", "doeks-stage", expires=-10), "expired")):
        with pytest.raises(DoeksError, match=f"InvalidTokenException: .*{why}"):
            rehearsal.pod_credentials(endpoint, REGION, "doeks", bad, admin)
    with pytest.raises(DoeksError, match="AccessDenied|InvalidClientTokenId|signature"):  # an unknown agent key
        rehearsal.pod_credentials(endpoint, REGION, "doeks", token(key, "default", "doeks-stage"),
                                  {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"})


# -- the training job's pods: their own role (identity row `train`), its checkpoints and model in S3 ----------------------
SAVE = """
import sys, torch
sys.path.insert(0, {root!r})
from doeks.workload.checkpoints import Store, save_file
Store(sys.argv[1]).save({{"model": {{"w": torch.ones(64)}}}}, 10, {{"epoch": 0}}, background=False)
state = {{"model": {{"w": torch.zeros(64)}}}}
meta = Store(sys.argv[1]).resume(state)
assert meta["step"] == 10 and float(state["model"]["w"].sum()) == 64.0, meta
print("model at", save_file(sys.argv[2], "model.pt", {{"w": torch.ones(3)}}), flush=True)
"""


def _as_training_pod(creds, endpoint, checkpoints, model):
    """The built-in job's checkpoint and model code (doeks/workload/checkpoints.py: s3fs, DCP) in a process with the
    environment a rehearsal training pod gets: the role's session and the account's endpoint, nothing else of AWS."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(rehearsal.pod_environment(creds, endpoint, REGION))
    return subprocess.run([sys.executable, "-c", SAVE.format(root=str(ROOT)), checkpoints, model], env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_training_pods_role_saves_checkpoints_and_the_model_and_iam_can_say_no(account, keys, monkeypatch, tmp_path):
    """TARGET=eks with nothing named keeps checkpoints and the model in S3; the deploy's identity step (the eks
    target's own code) makes the `train` role and its association; a pod of the job's service account gets that
    role's session from EKS Auth and saves a checkpoint, resumes it and writes model.pt; outside its prefixes it is
    refused; and with PutObject taken out of the role's policy the same save fails (IAM enforced says no)."""
    from doeks import jobpaths, targets

    settings, endpoint, admin = account
    _, key, _ = keys
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))  # the eks target points this process's kubectl there
    target = targets.get(settings)
    s = target.settings
    assert (s.checkpoint_uri, s.model_uri) == ("s3://doeks-training/doeks/checkpoints", "s3://doeks-training/doeks/models")
    target.job_identity(targets.Job(s), Runner(echo=False))  # what the deploy's step runs before the manifests
    workload = identity.get("train")
    creds = rehearsal.pod_credentials(endpoint, REGION, "doeks", token(key, s.namespace, "doeks-train"), admin)
    assert creds["role"].startswith(f"arn:aws:sts::123456789012:assumed-role/{identity.role_name(s, workload)}/")

    checkpoints, model = jobpaths.checkpoint_uri(s), jobpaths.model_uri(s)
    assert (checkpoints, model) == ("s3://doeks-training/doeks/checkpoints/imagenet", "s3://doeks-training/doeks/models/imagenet")
    ran = _as_training_pod(creds, endpoint, checkpoints, model)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert f"model at {model}/model.pt" in ran.stdout
    s3 = boto3.client("s3", region_name=REGION, endpoint_url=endpoint, **{k: admin[k] for k in ("aws_access_key_id",
                                                                                              "aws_secret_access_key")})
    assert s3.get_object(Bucket="doeks-training", Key="doeks/checkpoints/imagenet/latest")["Body"].read().strip() == b"step-10"
    assert s3.head_object(Bucket="doeks-training", Key="doeks/models/imagenet/model.pt")["ContentLength"] > 0
    session = boto3.client("s3", region_name=REGION, endpoint_url=endpoint,
                           **{k: creds[k] for k in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")})
    for call in (lambda: session.put_object(Bucket="doeks-training", Key="data/imagenet/train/n01/c.JPEG", Body=b"y"),
                 lambda: session.get_object(Bucket="doeks-training", Key="private/secret.txt"),
                 lambda: session.delete_object(Bucket="doeks-training", Key="data/imagenet/val/n01/b.JPEG")):
        with pytest.raises(ClientError, match="AccessDenied"):
            call()

    # the role's policy without s3:PutObject: the same code, another job's prefix, is refused by IAM
    policy = identity.train_policy(s)
    for statement in policy["Statement"]:
        if isinstance(statement["Action"], list):
            statement["Action"] = [a for a in statement["Action"] if a != "s3:PutObject"]
    iam = boto3.client("iam", region_name=REGION, endpoint_url=endpoint, **{k: admin[k] for k in ("aws_access_key_id",
                                                                                                "aws_secret_access_key")})
    iam.put_role_policy(RoleName=identity.role_name(s, workload), PolicyName=identity.policy_name(workload),
                        PolicyDocument=json.dumps(policy))
    other = s.with_overrides(job_name="second")
    refused = _as_training_pod(creds, endpoint, jobpaths.checkpoint_uri(other), jobpaths.model_uri(other))
    assert refused.returncode != 0 and "AccessDenied" in refused.stderr, refused.stderr[-3000:]
    listed = s3.list_objects_v2(Bucket="doeks-training", Prefix="doeks/checkpoints/second/").get("Contents", [])
    assert not [o for o in listed if o["Key"].endswith(("/latest", "/.metadata"))]  # nothing complete was written


def test_the_save_model_jobs_role_copies_a_folder_to_its_prefix_and_nothing_else(account, keys, tmp_path):
    """csi.data.save-model's Job on eks (`python -m doeks.datastage --upload`, the command its containers run) with
    the save-model role's session from EKS Auth: the claim's model folder lands under s3://S3_BUCKET/doeks/saved/;
    anywhere else is AccessDenied, one line, exit 1."""
    import os
    import subprocess
    import sys

    settings, endpoint, admin = account
    _, key, _ = keys
    workload = identity.get("save-model")
    identity.ensure(settings, Runner(echo=False), workload)
    creds = rehearsal.pod_credentials(endpoint, REGION, "doeks", token(key, settings.namespace, "doeks-save-model"), admin)
    folder = tmp_path / "models" / "imagenet"
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"m" * 1000)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(rehearsal.pod_environment(creds, endpoint, REGION), PYTHONPATH=str(ROOT))

    def upload(destination):
        return subprocess.run([sys.executable, "-m", "doeks.datastage", "--upload", str(folder), destination], env=env,
                              capture_output=True, text=True, timeout=120)

    done = upload("s3://doeks-training/doeks/saved/imagenet/2026-11-26-000000/model")
    assert done.returncode == 0 and "copied 1 files" in done.stdout, done.stderr[-2000:]
    s3 = boto3.client("s3", region_name=REGION, endpoint_url=endpoint, **{k: admin[k] for k in ("aws_access_key_id",
                                                                                              "aws_secret_access_key")})
    assert s3.head_object(Bucket="doeks-training", Key="doeks/saved/imagenet/2026-11-26-000000/model/model.pt")["ContentLength"] == 1000
    refused = upload("s3://doeks-training/doeks/models/imagenet")
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 1 and len(errors) == 1 and "AccessDenied" in errors[0], refused.stderr[-2000:]

"""What must outlive `invoke down` on TARGET=eks (issue 34): the FSx volume is deleted by `down`, so the job's
checkpoints and model go to S3 unless the user names another place; the training pods reach S3 with a role of their
own (Pod Identity: identity row `train`), made by the deploy and removed by `down`; `down` says where each job's model
and last checkpoint are, and refuses while a model is only on the volume it deletes (unless --force).

moto is the account (with the EKS operations it lacks, tests/moto_eks.py); eksctl, kubectl and helm are the stand-ins
of tests/cluster_standins.py (no EKS here). The pods' side, with IAM enforced and EKS Auth's session, is in
tests/test_rehearsal_iam.py; on doeks' own cluster, tests/test_rehearsal_eks.py.
"""
from __future__ import annotations

import json

import boto3
import pytest
import yaml

from doeks import identity, jobpaths, targets
from doeks import settings as S

from .conftest import ROOT, invoke
from .test_teardown import account, calls  # noqa: F401 - the moto account + stand-ins fixture


def test_the_target_decides_where_checkpoints_and_the_model_go_when_the_user_names_nothing(state_dir):
    base = S.load(environ={"S3_BUCKET": "team-bucket", "JOB_NAME": "resnet"}, path=ROOT / ".env")
    eks = targets.settled(base.with_overrides(target="eks"))
    assert (eks.checkpoint_uri, eks.model_uri) == ("s3://team-bucket/doeks/checkpoints", "s3://team-bucket/doeks/models")
    assert (jobpaths.checkpoint_uri(eks), jobpaths.model_uri(eks)) == ("s3://team-bucket/doeks/checkpoints/resnet",
                                                                        "s3://team-bucket/doeks/models/resnet")
    assert eks.raw("CHECKPOINT_URI") == "" and "TARGET=eks's default" in str(eks.rows())  # `invoke config` says why
    assert eks.with_overrides(job_name="other").model_uri == eks.model_uri  # kept through a flag
    for name in ("local", "docker", "kubernetes", "sagemaker"):  # elsewhere: the shared volume (SageMaker: its channels)
        other = targets.settled(base.with_overrides(target=name))
        assert (other.checkpoint_uri, other.model_uri) == ("", ""), name
        assert eks.with_overrides(target=name).checkpoint_uri == "", name  # not carried to another target
    named = targets.settled(base.with_overrides(target="eks", checkpoint_uri="s3://mine/ck", model_uri="/fsx-shared/m"))
    assert (named.checkpoint_uri, named.model_uri) == ("s3://mine/ck", "/fsx-shared/m")  # the user's values win


def test_eks_dry_run_shows_the_pods_identity_and_s3_and_none_where_nothing_is_in_s3(account):  # noqa: F811
    env = account["env"]
    dry = invoke("elasticjob.deploy", "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr[-3000:]
    docs = [d for d in yaml.safe_load_all(dry.stdout) if d]
    assert docs[0] == {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {
        "name": "doeks-train", "namespace": "default", "labels": {"app.kubernetes.io/part-of": "doeks"}}}
    pod = docs[-1]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["serviceAccountName"] == "doeks-train"
    # the hang watchdog acts through the API server as the pods' one service account: its rights are bound to it
    bound = [d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert len(bound) == 2 and all(d["subjects"] == [{"kind": "ServiceAccount", "name": "doeks-train",
                                                      "namespace": "default"}] for d in bound), bound
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"] == ["doeks-train"]
    container = pod["containers"][0]
    values = {e["name"]: e.get("value") for e in container["env"]}
    assert values["DOEKS_MODEL_URI"] == "s3://teardown-data/doeks/models/imagenet"
    assert values["DOEKS_CHECKPOINT_URI"] == "s3://teardown-data/doeks/checkpoints/imagenet" and values["AWS_REGION"] == "us-west-2"
    assert "AWS_ACCESS_KEY_ID" not in values and "envFrom" not in container  # on EKS the Pod Identity Agent gives it
    planned = [line for line in dry.stderr.splitlines() if "the job's own AWS identity" in line]
    assert len(planned) == 1 and "role doeks-doeks-us-west-2-train" in planned[0], dry.stderr[-3000:]
    assert "arn:aws:s3:::teardown-data/doeks/checkpoints/*" in planned[0] and "default/doeks-train" in planned[0]
    assert not boto3.client("iam", **account["kw"]).list_roles()["Roles"]  # a dry run makes nothing
    volume = invoke("elasticjob.deploy", "--dry-run", env={**env, "CHECKPOINT_URI": "/fsx-shared/ck", "MODEL_URI": "/fsx-shared/m"})
    assert volume.returncode == 0, volume.stderr[-3000:]
    docs = [d for d in yaml.safe_load_all(volume.stdout) if d]
    # no AWS identity: the pods run as the hang watchdog's own account (HANG_TIMEOUT's default is on)
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"] == ["imagenet-watchdog"]
    assert "AWS identity" not in volume.stderr
    assert docs[-1]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["serviceAccountName"] == "imagenet-watchdog"
    # the jobs doeks submits otherwise run as other service accounts, without that role: they keep the claim
    for args in (("kubeflow.pytorchjob.submit", "--dry-run"), ("kubeflow.trainjob.submit", "--dry-run")):
        other = invoke(*args, env=env)
        assert other.returncode == 0 and "/fsx-shared/checkpoints/imagenet" in other.stdout, other.stderr[-2000:]
        assert "s3://teardown-data/doeks" not in other.stdout, args


def _put(account, key: str, body: bytes = b"x") -> None:
    boto3.client("s3", **account["kw"]).put_object(Bucket="teardown-data", Key=key, Body=body)


def test_deploy_makes_the_pods_role_and_down_names_the_model_then_removes_the_role(account):  # noqa: F811
    env = account["env"]
    assert invoke("eks.create", env=env).returncode == 0
    for _ in range(2):  # a deploy again (the job replaced) finds what the first made
        deploy = invoke("elasticjob.deploy", "--fresh", env=env)
        assert deploy.returncode == 0, deploy.stderr[-3000:]
    applied = [d for c in calls(account) if c["argv"][:1] == ["apply"] for d in yaml.safe_load_all(c["stdin"]) if d]
    assert any(d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "doeks-train" for d in applied)
    job = [d for d in applied if d["kind"] == "PyTorchJob"][-1]
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["serviceAccountName"] == "doeks-train"
    iam, eks = boto3.client("iam", **account["kw"]), boto3.client("eks", **account["kw"])
    s = targets.settled(S.load(environ=env, path=ROOT / ".env"))
    role = identity.role_name(s, identity.get("train"))
    policy = iam.get_role_policy(RoleName=role, PolicyName="doeks-train")["PolicyDocument"]
    assert (json.loads(policy) if isinstance(policy, str) else policy) == identity.train_policy(s)
    found = eks.list_pod_identity_associations(clusterName="doeks", namespace="default", serviceAccount="doeks-train")
    assert len(found["associations"]) == 1

    _put(account, "doeks/models/imagenet/model.pt")
    _put(account, "doeks/checkpoints/imagenet/latest", b"step-20\n")
    down = invoke("down", "--yes", env=env)
    said = down.stdout + down.stderr
    assert down.returncode == 0, said[-3000:]
    assert "job imagenet: model s3://teardown-data/doeks/models/imagenet/model.pt (kept" in said, said[:3000]
    assert "s3://teardown-data/doeks/checkpoints/imagenet/step-20 (kept" in said, said[:3000]
    assert role not in [r["RoleName"] for r in iam.list_roles()["Roles"]]
    assert boto3.client("s3", **account["kw"]).head_object(Bucket="teardown-data", Key="doeks/models/imagenet/model.pt")
    audit = invoke("audit", env=env)
    assert audit.returncode == 0, audit.stdout + audit.stderr


def test_down_refuses_while_a_model_is_only_on_the_volume_it_deletes(account):  # noqa: F811
    env = {**account["env"], "MODEL_URI": "/fsx-shared/models"}  # the model on the claim; checkpoints in S3
    assert invoke("eks.create", env=env).returncode == 0
    assert invoke("elasticjob.deploy", env=env).returncode == 0
    kw = account["kw"]
    subnet = boto3.client("eks", **kw).describe_cluster(name="doeks")["cluster"]["resourcesVpcConfig"]["subnetIds"][0]
    fsx = boto3.client("fsx", **kw)
    fs = fsx.create_file_system(FileSystemType="LUSTRE", StorageCapacity=1200, SubnetIds=[subnet],
                                Tags=[{"Key": "doeks/cluster", "Value": "doeks"}])["FileSystem"]["FileSystemId"]
    for args in (("--dry-run",), ("--yes",)):
        refused = invoke("down", *args, env=env)
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert refused.returncode == 1 and len(errors) == 1, refused.stderr[-3000:]
        assert "pvc://default/fsx-pvc/models/imagenet/model.pt" in errors[0]
        assert "`invoke csi.data.save-model --job-name imagenet`" in errors[0] and "--force" in errors[0], errors
        assert "job imagenet: model pvc://default/fsx-pvc/models/imagenet/model.pt (on the shared volume" in refused.stderr
    assert boto3.client("eks", **kw).list_clusters()["clusters"] == ["doeks"]  # nothing deleted
    assert [f["FileSystemId"] for f in fsx.describe_file_systems()["FileSystems"]] == [fs]
    forced = invoke("down", "--dry-run", "--force", env=env)
    assert forced.returncode == 0 and "--force: the model(s) on the shared volume go with it" in forced.stderr, forced.stderr[-3000:]
    _put(account, "doeks/saved/imagenet/2026-11-26-063419/model/model.pt")  # what csi.data.save-model's Job writes
    saved = invoke("down", "--dry-run", env=env)
    assert saved.returncode == 0, saved.stderr[-3000:]  # a copy in S3: named, not refused
    assert "a copy saved by csi.data.save-model at s3://teardown-data/doeks/saved/imagenet/2026-11-26-063419/" in saved.stderr
    boto3.client("s3", **kw).delete_object(Bucket="teardown-data", Key="doeks/saved/imagenet/2026-11-26-063419/model/model.pt")
    fsx.delete_file_system(FileSystemId=fs)  # the volume gone already (a second `down`): nothing to refuse
    assert invoke("down", "--dry-run", env=env).returncode == 0


def test_save_model_on_eks_copies_what_is_on_the_claim_and_down_then_goes_on(account):  # noqa: F811
    """csi.data.save-model on eks works on the paths it names: a Job in the training image mounts the claim and
    copies the model's folder (pvc://.../models/<job>) to s3://S3_BUCKET/doeks/saved/<job>/<date>/ as the save-model
    role; what is in S3 already is said, not copied; a destination its role cannot write is one line (`down` with a
    copy there: the test above)."""
    env = {**account["env"], "MODEL_URI": "/fsx-shared/models"}
    dry = invoke("csi.data.save-model", "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr[-3000:]
    docs = [d for d in yaml.safe_load_all(dry.stdout) if d]
    job = next(d for d in docs if d["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "doeks-save-model" and [c["name"] for c in pod["containers"]] == ["model"]
    command = pod["containers"][0]["command"]
    assert command[:5] == ["python", "-m", "doeks.datastage", "--upload", "/fsx-shared/models/imagenet"]
    assert command[5].startswith("s3://teardown-data/doeks/saved/imagenet/") and command[5].endswith("/model")
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "fsx-pvc"
    assert pod["containers"][0]["volumeMounts"][0] == {"name": "shared", "mountPath": "/fsx-shared", "readOnly": True}
    assert '"RoleName": "doeks-doeks-us-west-2-save-model"' in dry.stderr and "wait for Job default/imagenet-save-model" in dry.stderr
    assert not boto3.client("iam", **account["kw"]).list_roles()["Roles"]  # a dry run makes nothing

    in_s3 = invoke("csi.data.save-model", "--dry-run", env=account["env"])  # eks' default: both in S3 already
    assert in_s3.returncode == 0 and "in S3 already" in in_s3.stderr and "kind: Job" not in in_s3.stdout, in_s3.stderr
    elsewhere = invoke("csi.data.save-model", "--dry-run", "--destination", "s3://other-bucket/x", env=env)
    errors = [line for line in elsewhere.stderr.splitlines() if line.startswith("error:")]
    assert elsewhere.returncode == 1 and len(errors) == 1 and "writes under s3://teardown-data/doeks/saved/imagenet/" in errors[0]


"""The identity contract: which identity each pod doeks puts on the cluster runs as, and what its policy allows.

Each workload that calls AWS must have a Pod Identity association in the plan (or come with its add-on's), for the
service account its pods really use, to a role whose policies allow every action the workload's code or upstream
driver calls (listed in doeks.identity with the upstream source), and nothing broader.
Requests and responses go through moto + the EKS operations it lacks (tests/moto_eks.py), checked against AWS's model.
"""
from __future__ import annotations

import json
import re

import boto3
import pytest
import yaml

from doeks import identity, storage
from doeks import trainimage
from doeks import settings as S

from .conftest import invoke
from .test_csi import cloud, recorded  # noqa: F401 - the moto VPC + cluster fixture


def planned_calls(stderr: str, operation: str) -> list[dict]:
    """The request parameters of every `would call: <service>.<operation> {json}` line of a dry run."""
    found = []
    for line in stderr.splitlines():
        match = re.search(rf"would call: \w+\.{operation} (\{{.*\}})\s*$", line)
        if match:
            found.append(json.loads(match.group(1)))
    return found


def settings_for(env, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return S.load()


# -- the table itself ---------------------------------------------------------------------------------------------
def test_every_workload_policy_allows_what_it_calls_and_nothing_broader(state_dir, monkeypatch):
    from doeks import targets

    monkeypatch.setenv("FSX_IMPORT_PATH", "s3://doeks-training/data")
    s = targets.settled(S.load().with_overrides(target="eks"))  # eks' checkpoints and model in S3: the train row's
    assert {w.key for w in identity.WORKLOADS} >= {"fsx-csi", "efs-csi", "ebs-csi", "cloudwatch-observability",
                                                   "cloudwatch-agent-gpu", "data-stage", "pipeline-runner", "train"}
    for workload in identity.WORKLOADS:
        docs = identity.policies(s, workload)
        assert docs, workload.key
        for action in workload.calls:
            assert identity.allows(docs, action), f"{workload.key}: {action} not allowed ({workload.source})"
        for doc in docs:
            for statement in doc["Statement"]:
                actions = identity._listify(statement["Action"])
                assert "*" not in actions and not any(a.endswith(":*") for a in actions), (workload.key, actions)
        assert not any("FullAccess" in arn for arn in workload.managed), workload.key
        assert workload.source  # where the list of calls comes from
        # the trust lets EKS Pod Identity (and only it) hand the role to pods
        assert identity.POD_IDENTITY_TRUST["Statement"][0]["Principal"] == {"Service": "pods.eks.amazonaws.com"}


def test_stage_policy_is_read_only_on_the_data_prefix(state_dir):
    s = S.load()
    docs = identity.policies(s, identity.get("data-stage"))
    prefix = f"arn:aws:s3:::{s.s3_bucket}/{s.data_s3_prefix}"
    assert identity.allows(docs, "s3:GetObject", f"{prefix}/train/n01440764/x.JPEG")
    assert identity.allows(docs, "s3:ListBucket", f"arn:aws:s3:::{s.s3_bucket}")
    assert not identity.allows(docs, "s3:GetObject", f"arn:aws:s3:::{s.s3_bucket}/models/x.pt")
    assert not identity.allows(docs, "s3:PutObject", f"{prefix}/x")
    assert not identity.allows(docs, "s3:GetObject", "arn:aws:s3:::someone-elses-bucket/data/imagenet/x")


def test_agent_policy_puts_metrics_only_into_its_namespace(state_dir):
    from doeks import gpumetrics

    doc = identity.policies(S.load(), identity.get("cloudwatch-agent-gpu"))[0]
    put = next(st for st in doc["Statement"] if "cloudwatch:PutMetricData" in identity._listify(st["Action"]))
    assert put["Condition"] == {"StringEquals": {"cloudwatch:namespace": gpumetrics.NAMESPACE}}


# -- issue example 1: the FSx controller gets its identity --------------------------------------------------------
def test_fsx_deploy_associates_the_controller_service_account_with_its_role(cloud, state_dir):  # noqa: F811
    env, kw = cloud["env"], cloud["kw"]
    dry = invoke("csi.fsx.deploy", "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    planned = planned_calls(dry.stderr, "create_pod_identity_association")
    assert [(p["namespace"], p["serviceAccount"]) for p in planned] == [("kube-system", "fsx-csi-controller-sa")]
    assert planned[0]["roleArn"].endswith("role/doeks-doeks-us-west-2-fsx-csi")
    assert "identity: kube-system/fsx-csi-controller-sa -> role doeks-doeks-us-west-2-fsx-csi" in dry.stderr

    result = invoke("csi.fsx.deploy", env=env)
    assert result.returncode == 0, result.stderr
    helm = next(c for c in recorded(cloud) if c["tool"] == "helm")["argv"]
    assert "controller.serviceAccount.name=fsx-csi-controller-sa" in helm  # the chart's SA is the associated one
    eks, iam = boto3.client("eks", **kw), boto3.client("iam", **kw)
    found = eks.list_pod_identity_associations(clusterName="doeks", namespace="kube-system",
                                               serviceAccount="fsx-csi-controller-sa")["associations"]
    assert len(found) == 1
    association = eks.describe_pod_identity_association(clusterName="doeks", associationId=found[0]["associationId"])["association"]
    role = iam.get_role(RoleName="doeks-doeks-us-west-2-fsx-csi")["Role"]
    assert association["roleArn"] == role["Arn"]
    trust = role["AssumeRolePolicyDocument"]
    trust = json.loads(trust) if isinstance(trust, str) else trust
    assert trust["Statement"][0]["Principal"] == {"Service": "pods.eks.amazonaws.com"}
    policy = iam.get_role_policy(RoleName="doeks-doeks-us-west-2-fsx-csi", PolicyName="doeks-fsx-csi")["PolicyDocument"]
    assert identity.allows([policy], "fsx:CreateFileSystem") and identity.allows([policy], "fsx:DeleteFileSystem")
    # the driver tags what it creates, so teardown can wait for it and audit can find it
    applied = [d for c in recorded(cloud) if c["tool"] == "kubectl" for d in yaml.safe_load_all(c["stdin"]) if d]
    sc = next(d for d in applied if d["kind"] == "StorageClass")
    assert sc["parameters"]["extraTags"] == "doeks/cluster=doeks"
    assert invoke("csi.fsx.deploy", env=env).returncode == 0  # twice: one association, not two
    assert len(eks.list_pod_identity_associations(clusterName="doeks")["associations"]) == 1


# -- issue example 2: the CloudWatch agent (or add-on) has an identity, and series stay per node --------------------
def test_gpu_metrics_deploy_shows_each_identity(cloud, state_dir):  # noqa: F811
    env = cloud["env"]
    addon = invoke("gpu-metrics.deploy", "--dry-run", env=env)
    assert addon.returncode == 0, addon.stderr
    created = planned_calls(addon.stderr, "create_addon")
    assert [c["addonName"] for c in created] == ["amazon-cloudwatch-observability"]
    assert created[0]["podIdentityAssociations"][0]["serviceAccount"] == "cloudwatch-agent"
    assert "identity: amazon-cloudwatch/cloudwatch-agent -> role doeks-doeks-us-west-2-cloudwatch-observability" in addon.stderr
    agent = invoke("gpu-metrics.deploy", "--agent", "--dry-run", env=env)
    assert agent.returncode == 0, agent.stderr
    planned = planned_calls(agent.stderr, "create_pod_identity_association")
    daemonset = next(d for d in yaml.safe_load_all(agent.stdout) if d and d["kind"] == "DaemonSet")
    account = daemonset["spec"]["template"]["spec"]["serviceAccountName"]
    assert [(p["namespace"], p["serviceAccount"]) for p in planned] == [(daemonset["metadata"]["namespace"], account)]
    assert "would call: iam.put_role_policy" in agent.stderr and "cloudwatch:PutMetricData" in agent.stderr


def agent_dimensions(config: dict, hostname: str, instance: str, index: str) -> dict[str, str]:
    """The dimensions the CloudWatch agent (in a container) puts on an nvidia_gpu metric, per its translator rules
    (aws/amazon-cloudwatch-agent translator/translate/agent/ruleOmitHostname.go: omit_hostname defaults to true in a
    container; translator/translate/metrics/ruleAppendDimensions.go: top-level append_dimensions takes only ImageId,
    InstanceId, InstanceType, AutoScalingGroupName with their ${aws:...} value; nvidia_gpu adds index, name, arch)."""
    allowed = {"ImageId": "${aws:ImageId}", "InstanceId": "${aws:InstanceId}", "InstanceType": "${aws:InstanceType}",
               "AutoScalingGroupName": "${aws:AutoScalingGroupName}"}
    dims = {"index": index, "name": "NVIDIA A100-SXM4-40GB", "arch": "Ampere"}
    if config["agent"].get("omit_hostname", True) is False:
        dims["host"] = hostname
    for key, value in config["metrics"].get("append_dimensions", {}).items():
        if allowed.get(key) == value:
            dims[key] = instance
    dims.update(config["metrics"]["metrics_collected"]["nvidia_gpu"].get("append_dimensions", {}))
    return dims


def test_agent_series_stay_per_node(cloud, state_dir):  # noqa: F811
    from datetime import datetime, timedelta, timezone

    from doeks import gpumetrics

    config = gpumetrics.agent_config(S.load(), 60)
    cw = boto3.client("cloudwatch", **cloud["kw"])
    now = datetime.now(timezone.utc)
    for host, instance, value in (("ip-10-0-1-1", "i-0aaa", 90.0), ("ip-10-0-1-2", "i-0bbb", 10.0)):
        dims = agent_dimensions(config, host, instance, "0")
        cw.put_metric_data(Namespace=gpumetrics.NAMESPACE, MetricData=[{
            "MetricName": "nvidia_smi_utilization_gpu", "Dimensions": [{"Name": k, "Value": v} for k, v in dims.items()],
            "Value": value, "Timestamp": now}])
    data = gpumetrics.series(cw, timedelta(minutes=10), period=60)
    nodes = data["nvidia_smi_utilization_gpu"]
    assert len(nodes) == 2, nodes  # one series per node, not one for the cluster
    assert sorted(points[-1][1] for points in nodes.values()) == [10.0, 90.0]


def test_show_reads_the_addon_series_per_node(cloud, state_dir):  # noqa: F811
    from datetime import datetime, timedelta, timezone

    from doeks import gpumetrics

    cw = boto3.client("cloudwatch", **cloud["kw"])
    now = datetime.now(timezone.utc)
    for node, value in (("ip-10-0-1-1.ec2.internal", 70.0), ("ip-10-0-1-2.ec2.internal", 30.0)):
        cw.put_metric_data(Namespace="ContainerInsights", MetricData=[{
            "MetricName": "node_gpu_utilization", "Value": value, "Timestamp": now, "Dimensions": [
                {"Name": "ClusterName", "Value": "doeks"}, {"Name": "InstanceId", "Value": "i-" + node[:4]},
                {"Name": "NodeName", "Value": node}]}])
    cw.put_metric_data(Namespace="ContainerInsights", MetricData=[{  # a cluster aggregate: not a node
        "MetricName": "node_gpu_utilization", "Value": 50.0, "Timestamp": now, "Dimensions": [{"Name": "ClusterName", "Value": "doeks"}]}])
    data = gpumetrics.series(cw, timedelta(minutes=10), period=60)
    assert sorted(data["node_gpu_utilization"]) == ["ip-10-0-1-1.ec2.internal", "ip-10-0-1-2.ec2.internal"]


# -- issue example 3: the staging Job's image and identity -----------------------------------------------------------
def test_stage_job_runs_a_pullable_image_as_an_account_with_s3_read(cloud, state_dir):  # noqa: F811
    env = cloud["env"]
    result = invoke("csi.data.stage", "--dry-run", env=env)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    job = next(d for d in docs if d["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    image = pod["containers"][0]["image"]
    s = S.load()
    # the content-tagged training image (it holds doeks' stager), in this account's ECR
    assert image == f"123456789012.dkr.ecr.{s.aws_region}.amazonaws.com/{trainimage.local_ref(trainimage.base_image(s, False))}"
    registry = image.split("/", 1)[0]
    assert "/" in image and ("." in registry or ":" in registry), f"{image} would resolve to Docker Hub"
    account = pod["serviceAccountName"]
    assert any(d["kind"] == "ServiceAccount" and d["metadata"]["name"] == account for d in docs)
    planned = planned_calls(result.stderr, "create_pod_identity_association")
    assert [(p["namespace"], p["serviceAccount"]) for p in planned] == [(job["metadata"]["namespace"], account)]
    policy = json.loads(planned_calls(result.stderr, "put_role_policy")[0]["PolicyDocument"])
    assert identity.allows([policy], "s3:GetObject", f"arn:aws:s3:::{s.s3_bucket}/{s.data_s3_prefix}/train/a.JPEG")


# -- issue example 6: EBS CSI driver (Pod Identity) and a gp3 default StorageClass -----------------------------------
def test_cluster_gets_the_ebs_driver_with_identity_and_a_default_gp3_class(cloud, state_dir):  # noqa: F811
    from doeks import eks

    result = invoke("eks.create", "--dry-run", env=cloud["env"])
    assert result.returncode == 0, result.stderr
    config = next(d for d in yaml.safe_load_all(result.stdout) if d and d.get("kind") == "ClusterConfig")
    assert {"name": "eks-pod-identity-agent"} in config["addons"]  # every association needs the agent
    created = planned_calls(result.stderr, "create_addon")
    assert [c["addonName"] for c in created] == ["aws-ebs-csi-driver"]
    assert created[0]["podIdentityAssociations"][0]["serviceAccount"] == "ebs-csi-controller-sa"
    assert created[0]["podIdentityAssociations"][0]["roleArn"].endswith("role/doeks-doeks-us-west-2-ebs-csi")
    classes = [d for d in yaml.safe_load_all(result.stdout) if d and d.get("kind") == "StorageClass"]
    defaults = [c for c in classes if c["metadata"].get("annotations", {}).get("storageclass.kubernetes.io/is-default-class") == "true"]
    assert len(defaults) == 1 and defaults[0]["provisioner"] == "ebs.csi.aws.com" and defaults[0]["parameters"]["type"] == "gp3"
    assert eks.gp3_storage_class("doeks") == defaults[0]
    assert "storageclass.kubernetes.io/is-default-class=false" in result.stderr  # gp2 no longer a second default


def test_dry_runs_change_nothing(cloud, state_dir):  # noqa: F811
    kw = cloud["kw"]
    for args in (("csi.fsx.deploy", "--dry-run"), ("gpu-metrics.deploy", "--dry-run"), ("eks.create", "--dry-run")):
        assert invoke(*args, env=cloud["env"]).returncode == 0
    roles = [r["RoleName"] for r in boto3.client("iam", **kw).list_roles()["Roles"]]
    assert not [r for r in roles if r.startswith("doeks-")]
    assert not boto3.client("eks", **kw).list_pod_identity_associations(clusterName="doeks")["associations"]


@pytest.mark.slow
def test_remove_is_idempotent_and_leaves_no_role(cloud, state_dir, monkeypatch):  # noqa: F811
    from doeks.runner import Runner

    s = settings_for(cloud["env"], monkeypatch)
    iam = boto3.client("iam", **cloud["kw"])
    for w in identity.WORKLOADS:
        identity.ensure(s, Runner(echo=False), w)
        if w.addon:  # the add-on brings the association
            storage._client(s, "eks").create_addon(clusterName="doeks", addonName=w.addon,
                                                  podIdentityAssociations=identity.addon_associations(s, Runner(echo=False), w))
            assert identity.associations(s, w)
            storage.delete_addon(s, Runner(echo=False), w.addon, timeout=5)
        for _ in range(2):
            identity.remove(s, Runner(echo=False), w)
        assert identity.role_name(s, w) not in [r["RoleName"] for r in iam.list_roles()["Roles"]]
        assert not identity.associations(s, w)


def test_recorded_managed_policies_match_aws_documents():
    """doeks.identity.MANAGED (what the tests evaluate) against the AWS managed policy documents as moto ships them
    (moto/iam/aws_managed_policies.py, a copy of the AWS Managed Policy Reference)."""
    import fnmatch

    from moto.iam.aws_managed_policies import aws_managed_policies_data

    documents = json.loads(aws_managed_policies_data)
    for arn, actions in identity.MANAGED.items():
        document = documents[arn.rsplit("/", 1)[-1]]["Document"]
        allowed = [a for st in document["Statement"] if st["Effect"] == "Allow" for a in identity._listify(st["Action"])]
        for action in actions:
            assert any(fnmatch.fnmatchcase(action, pattern) for pattern in allowed), f"{arn} does not allow {action}"


def _allowed(docs, action: str, request_tags: dict | None = None, resource_tags: dict | None = None) -> bool:
    """IAM's answer for an action on `*` with these tags: an Allow statement whose action matches and whose
    StringEquals conditions on aws:RequestTag/K and aws:ResourceTag/K all hold (other condition kinds fail closed)."""
    import fnmatch

    context = {**{f"aws:RequestTag/{k}": v for k, v in (request_tags or {}).items()},
               **{f"aws:ResourceTag/{k}": v for k, v in (resource_tags or {}).items()}}
    for doc in docs:
        for statement in doc["Statement"]:
            if statement["Effect"] != "Allow" or not any(fnmatch.fnmatchcase(action, a) for a in identity._listify(statement["Action"])):
                continue
            conditions = statement.get("Condition", {})
            if set(conditions) - {"StringEquals"}:
                continue
            if all(context.get(key) in identity._listify(value) for key, value in conditions.get("StringEquals", {}).items()):
                return True
    return False


def test_no_doeks_policy_deletes_on_every_resource_and_the_fsx_driver_only_its_clusters_file_systems(state_dir):
    """The FSx CSI controller could delete any file system of the account (Delete* on `*`): it now creates only with
    this cluster's tag in the request and updates or deletes only what carries it, the tag its StorageClass puts on
    every file system it makes."""
    s = S.load()
    for workload in identity.WORKLOADS:
        for doc in ([workload.inline(s)] if workload.inline else []):  # doeks' own (AWS's managed ones are AWS's)
            for statement in (doc or {}).get("Statement", []):
                broad = [a for a in identity._listify(statement["Action"]) if ":Delete" in a]
                if broad and "*" in identity._listify(statement.get("Resource", "*")):
                    assert statement.get("Condition"), (workload.key, statement)
    docs = identity.policies(s, identity.get("fsx-csi"))
    storage_class = next(m for m in storage.fsx_manifests(s, "subnet-0123456789abcdef0", "sg-0123456789abcdef0")
                         if m["kind"] == "StorageClass")
    tags = dict(pair.split("=", 1) for pair in storage_class["parameters"]["extraTags"].split(","))
    created = {**tags, "CSIVolumeName": "pvc-1"}  # what the driver's CreateFileSystem request carries
    assert _allowed(docs, "fsx:CreateFileSystem", request_tags=created)
    assert _allowed(docs, "fsx:TagResource", request_tags=created)
    assert _allowed(docs, "fsx:DeleteFileSystem", resource_tags=created)
    assert _allowed(docs, "fsx:UpdateFileSystem", resource_tags=created)
    assert _allowed(docs, "fsx:DescribeFileSystems")
    others = {"doeks/cluster": "another-cluster"}
    for action in ("fsx:DeleteFileSystem", "fsx:UpdateFileSystem"):
        assert not _allowed(docs, action, resource_tags=others) and not _allowed(docs, action, resource_tags={})
    assert not _allowed(docs, "fsx:CreateFileSystem", request_tags={"CSIVolumeName": "pvc-1"})


# -- IAM is global: one cluster name in two regions (issue 55, 3) ---------------------------------------------------
def test_the_up_plans_of_one_cluster_name_in_two_regions_share_no_role(state_dir, tmp_path):
    """The roles of CLUSTER_NAME in us-west-2 and in eu-central-1 are different roles: with one name, the second
    region's `up` would rewrite the first's policies and its `down` delete roles the first cluster's pods run as."""
    offline = {"TARGET": "eks", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
               "DOEKS_CACHE": str(tmp_path / "cache")}
    roles = {}
    for region in ("us-west-2", "eu-central-1"):
        plan = invoke("up", "--dry-run", "--full", env={**offline, "AWS_REGION": region, "CLUSTER_NAME": "team"})
        assert plan.returncode == 0, plan.stderr[-3000:]
        roles[region] = {call["RoleName"] for call in planned_calls(plan.stderr, "create_role")}
    assert {"team-us-west-2-ebs-csi", "team-us-west-2-fsx-csi", "team-us-west-2-cloudwatch-observability",
            "team-us-west-2-data-stage"} <= {r.removeprefix("doeks-") for r in roles["us-west-2"]}, roles
    assert len(roles["eu-central-1"]) == len(roles["us-west-2"]) >= 4
    assert not roles["us-west-2"] & roles["eu-central-1"], roles
    long = {region: {identity.role_name(S.load(environ={"AWS_REGION": region, "CLUSTER_NAME": "c" * 60}), w)
                     for w in identity.WORKLOADS} for region in ("us-west-2", "ap-southeast-2")}
    assert not long["us-west-2"] & long["ap-southeast-2"]
    assert all(len(name) <= 64 for names in long.values() for name in names)
    assert len(long["us-west-2"]) == len(identity.WORKLOADS)
    # and the SageMaker execution role (its policy names the region's logs), unless SAGEMAKER_ROLE_NAME names one
    execution = {region: S.load(environ={"AWS_REGION": region}).sagemaker_role_name for region in ("us-west-2", "eu-central-1")}
    assert execution == {"us-west-2": "doeks-sagemaker-execution-us-west-2",
                         "eu-central-1": "doeks-sagemaker-execution-eu-central-1"}
    assert S.load(environ={"AWS_REGION": "eu-central-1", "SAGEMAKER_ROLE_NAME": "mine"}).sagemaker_role_name == "mine"


def test_down_and_audit_of_one_region_leave_the_other_regions_roles_alone(cloud, state_dir, monkeypatch):  # noqa: F811
    from doeks import audit
    from doeks.runner import Runner

    here = settings_for(cloud["env"], monkeypatch)
    there = here.with_overrides(aws_region="eu-central-1")
    for s in (here, there):
        for key in ("ebs-csi", "data-stage"):
            identity.ensure_role(s, Runner(echo=False), identity.get(key))
    iam = boto3.client("iam", **cloud["kw"])
    legacy = identity.legacy_role_name(here, identity.get("fsx-csi"))  # as doeks named it before (no region)
    iam.create_role(RoleName=legacy, AssumeRolePolicyDocument="{}", Tags=[{"Key": identity.TAG, "Value": "doeks"}])

    def audited(s):
        return {f.ident: f.detail for f in audit.roles_of(s, iam)}

    assert set(audited(here)) == {identity.role_name(here, identity.get(k)) for k in ("ebs-csi", "data-stage")} | {legacy}
    assert "without its region" in audited(here)[legacy]
    assert set(audited(there)) == {identity.role_name(there, identity.get(k)) for k in ("ebs-csi", "data-stage")} | {legacy}
    for key in ("ebs-csi", "data-stage"):
        identity.remove(here, Runner(echo=False), identity.get(key))
    assert set(audited(here)) == {legacy}
    assert set(audited(there)) == {identity.role_name(there, identity.get(k)) for k in ("ebs-csi", "data-stage")} | {legacy}

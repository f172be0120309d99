"""The identity table: every workload doeks puts on the cluster that calls AWS -> namespace/service account -> IAM
role (trusted by EKS Pod Identity, with its association made and deleted with it) -> policy.

Without an association a pod falls back to the node role (worker, ECR read-only, SSM), which allows none of the
calls below: the FSx controller cannot CreateFileSystem, the CloudWatch agent cannot PutMetricData, the staging Job
cannot read S3. Each row lists the AWS actions its code (or the upstream driver) calls, with the upstream source; the
tests check that the policy allows each of them and nothing broader (no `*` action, no FullAccess policy).

Rows whose `addon` is set get their association through the EKS add-on API (`podIdentityAssociations` of
CreateAddon); the others through CreatePodIdentityAssociation. Both are deleted before the role.
"""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from . import ui
from .jobpaths import JOB_S3_CALLS, TRAIN_SERVICE_ACCOUNT

TAG = "doeks/cluster"
REGION_TAG = "doeks/region"
POD_IDENTITY_TRUST = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"Service": "pods.eks.amazonaws.com"},
                                                              "Action": ["sts:AssumeRole", "sts:TagSession"]}]}

# AWS managed policies used below, with the actions they allow (as published in the AWS Managed Policy Reference,
# docs.aws.amazon.com/aws-managed-policy/latest/reference/<name>.html; versions noted). Tests evaluate these.
MANAGED = {
    # AmazonEBSCSIDriverPolicy v3: snapshots/volumes, scoped by the ebs.csi.aws.com tags in its conditions
    "arn:aws:iam::aws:policy/service-role/AmazonEBSCSIDriverPolicy": [
        "ec2:CreateSnapshot", "ec2:AttachVolume", "ec2:DetachVolume", "ec2:ModifyVolume", "ec2:DescribeAvailabilityZones",
        "ec2:DescribeInstances", "ec2:DescribeSnapshots", "ec2:DescribeTags", "ec2:DescribeVolumes",
        "ec2:DescribeVolumesModifications", "ec2:CreateTags", "ec2:CreateVolume", "ec2:DeleteVolume", "ec2:DeleteSnapshot",
        "ec2:EnableFastSnapshotRestores"],
    # AmazonEFSCSIDriverPolicy v3
    "arn:aws:iam::aws:policy/service-role/AmazonEFSCSIDriverPolicy": [
        "elasticfilesystem:DescribeAccessPoints", "elasticfilesystem:DescribeFileSystems",
        "elasticfilesystem:DescribeMountTargets", "ec2:DescribeAvailabilityZones", "elasticfilesystem:CreateAccessPoint",
        "elasticfilesystem:TagResource", "elasticfilesystem:DeleteAccessPoint"],
    # CloudWatchAgentServerPolicy v2 (what the amazon-cloudwatch-observability add-on docs attach)
    "arn:aws:iam::aws:policy/CloudWatchAgentServerPolicy": [
        "cloudwatch:PutMetricData", "ec2:DescribeVolumes", "ec2:DescribeTags", "logs:PutLogEvents", "logs:PutRetentionPolicy",
        "logs:DescribeLogStreams", "logs:DescribeLogGroups", "logs:CreateLogStream", "logs:CreateLogGroup",
        "xray:PutTraceSegments", "xray:PutTelemetryRecords", "xray:GetSamplingRules", "xray:GetSamplingTargets",
        "xray:GetSamplingStatisticSummaries", "ssm:GetParameter"],
}


@dataclass(frozen=True)
class Workload:
    key: str  # role name suffix: doeks-<cluster>-<region>-<key>
    unit: str
    what: str
    namespace: str
    service_account: str
    calls: tuple[str, ...]  # AWS actions the workload's code or upstream driver calls
    source: str  # where `calls` comes from
    managed: tuple[str, ...] = ()
    inline: Callable[[Any], dict] | None = None
    addon: str | None = None  # the association comes with this EKS add-on
    namespace_of: Callable[[Any], str] | None = field(default=None, compare=False)
    service_account_of: Callable[[Any], str] | None = field(default=None, compare=False)

    def ns(self, settings) -> str:
        return self.namespace_of(settings) if self.namespace_of else self.namespace

    def sa(self, settings) -> str:
        return self.service_account_of(settings) if self.service_account_of else self.service_account


def service_account(settings, workload: Workload) -> dict:
    """The workload's Kubernetes ServiceAccount (what its Pod Identity association names)."""
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": workload.sa(settings), "namespace": workload.ns(settings),
                         "labels": {"app.kubernetes.io/part-of": "doeks"}}}


def role_name(settings, workload: Workload) -> str:
    """doeks-<cluster>-<region>-<key>: IAM is global, so the clusters of one name in two regions have roles of their
    own (one's `down` would otherwise delete the other's, one's `up` rewrite the other's policies). Where that passes
    IAM's 64 characters, the cluster part is cut and a digest of the cluster name and region keeps the roles of two
    clusters (and the workloads of one) apart."""
    region = settings.aws_region
    name = f"doeks-{settings.cluster_name}-{region}-{workload.key}"
    if len(name) <= 64:
        return name
    import hashlib

    digest = hashlib.sha256(f"{settings.cluster_name}/{region}".encode()).hexdigest()[:8]
    room = 64 - len(f"doeks--{region}-{digest}-{workload.key}")
    return f"doeks-{settings.cluster_name[:room].rstrip('-')}-{region}-{digest}-{workload.key}"


def legacy_role_name(settings, workload: Workload) -> str:
    """The name doeks gave the role before names carried the region (one role for every region's cluster of the
    name): what `invoke audit` still looks for."""
    name = f"doeks-{settings.cluster_name}-{workload.key}"
    if len(name) <= 64:
        return name
    import hashlib

    digest = hashlib.sha256(settings.cluster_name.encode()).hexdigest()[:8]
    room = 64 - len(f"doeks--{digest}-{workload.key}")
    return f"doeks-{settings.cluster_name[:room].rstrip('-')}-{digest}-{workload.key}"


def role_tags(settings) -> list[dict[str, str]]:
    """The tags of every role doeks makes for a cluster: its name and its region (`invoke audit` of one region does
    not count the other's)."""
    return [{"Key": TAG, "Value": settings.cluster_name}, {"Key": REGION_TAG, "Value": settings.aws_region}]


def policy_name(workload: Workload) -> str:
    return f"doeks-{workload.key}"


# -- policies -----------------------------------------------------------------------------------------------------
def fsx_driver_policy(settings) -> dict[str, Any]:
    """What the FSx CSI controller calls, as the driver's docs/install.md policy gives it (kubernetes-sigs/
    aws-fsx-csi-driver, the policy for the chart doeks pins, FSX_CHART_VERSION), less what doeks' StorageClass never
    asks the driver to do: no s3ImportPath, so neither s3:ListBucket nor the s3.data-source.lustre service-linked
    role. The data repository association (FSX_IMPORT_PATH) and its S3 side are doeks' own calls, made with doeks'
    credentials (storage.fsx_associate); the StorageClass names subnet and security group, so no ec2:Describe*.

    Scoped to this cluster's own file systems by the tag the StorageClass's extraTags put on every one the driver
    makes (doeks/cluster=<cluster>, storage.fsx_manifests): it creates (and tags) only with that tag in the
    request, and updates or deletes only file systems that carry it; no other file system of the account."""
    mine = {"StringEquals": {f"aws:RequestTag/{TAG}": settings.cluster_name}}
    owned = {"StringEquals": {f"aws:ResourceTag/{TAG}": settings.cluster_name}}
    return {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["fsx:CreateFileSystem", "fsx:TagResource"], "Resource": "*", "Condition": mine},
        {"Effect": "Allow", "Action": ["fsx:DeleteFileSystem", "fsx:UpdateFileSystem"], "Resource": "*", "Condition": owned},
        {"Effect": "Allow", "Action": "fsx:DescribeFileSystems", "Resource": "*"},  # no resource-level scope in FSx
        {"Effect": "Allow", "Action": "iam:CreateServiceLinkedRole", "Resource": "*",
         "Condition": {"StringLike": {"iam:AWSServiceName": ["fsx.amazonaws.com"]}}},
    ]}


def fsx_policy(settings) -> dict[str, Any]:
    return fsx_driver_policy(settings)


def bucket_and_prefix(settings) -> tuple[str, str]:
    return settings.s3_bucket, settings.data_s3_prefix.strip("/")


def stage_policy(settings) -> dict[str, Any]:
    """S3 read on the data prefix only: ListBucket limited by s3:prefix, GetObject on the prefix's objects."""
    bucket, prefix = bucket_and_prefix(settings)
    return {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}",
         "Condition": {"StringLike": {"s3:prefix": [prefix, f"{prefix}/*"]}}},
        {"Effect": "Allow", "Action": "s3:GetObject", "Resource": f"arn:aws:s3:::{bucket}/{prefix}/*"}]}


def cloudwatch_agent_policy(settings) -> dict[str, Any]:
    """PutMetricData into CWAgent only (cloudwatch:namespace condition key), and the EC2 reads of the agent's ec2tagger."""
    from .gpumetrics import NAMESPACE

    return {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "cloudwatch:PutMetricData", "Resource": "*",
         "Condition": {"StringEquals": {"cloudwatch:namespace": NAMESPACE}}},
        {"Effect": "Allow", "Action": ["ec2:DescribeTags", "ec2:DescribeInstances", "ec2:DescribeVolumes"], "Resource": "*"}]}


def pipeline_runner_policy(settings) -> dict[str, Any]:
    """The KFP pipeline's sagemaker branch (doeks.pipeline.train_sagemaker): upload the source archive under the
    bucket's doeks/ prefix, create/describe/stop training jobs named after JOB_NAME (and tag them: CreateTrainingJob
    with Tags needs sagemaker:AddTags), and pass the execution role to SageMaker only."""
    from .sagemaker import name_prefix

    region, bucket = settings.aws_region, settings.s3_bucket
    return {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["sagemaker:CreateTrainingJob", "sagemaker:DescribeTrainingJob",
                                       "sagemaker:StopTrainingJob", "sagemaker:AddTags"],
         "Resource": f"arn:aws:sagemaker:{region}:*:training-job/{name_prefix(settings)}-*"},
        {"Effect": "Allow", "Action": "iam:PassRole", "Resource": f"arn:aws:iam::*:role/{settings.sagemaker_role_name}",
         "Condition": {"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}}},
        {"Effect": "Allow", "Action": "s3:PutObject", "Resource": f"arn:aws:s3:::{bucket}/doeks/*"}]}


def train_policy(settings) -> dict[str, Any] | None:
    """The training jobs' S3: CHECKPOINT_URI's and MODEL_URI's prefixes (doeks.jobpaths.job_s3_policy); None when
    neither is in S3 (the pods then need no AWS identity)."""
    from .jobpaths import job_s3_policy

    return job_s3_policy(settings)


def save_model_policy(settings) -> dict[str, Any]:
    """csi.data.save-model's Job: write (and abort a failed multipart upload) under s3://S3_BUCKET/doeks/saved/ only,
    where it copies each job's model and checkpoints (doeks.jobpaths.saved_uri); no read, no list, no delete."""
    from .jobpaths import STORE_PREFIX

    return {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["s3:PutObject", "s3:AbortMultipartUpload"],
         "Resource": f"arn:aws:s3:::{settings.s3_bucket}/{STORE_PREFIX}/saved/*"}]}


# -- the table ----------------------------------------------------------------------------------------------------
WORKLOADS: tuple[Workload, ...] = (
    Workload("fsx-csi", "csi", "FSx for Lustre CSI controller", "kube-system", "fsx-csi-controller-sa",
             calls=("fsx:CreateFileSystem", "fsx:DeleteFileSystem", "fsx:DescribeFileSystems", "fsx:TagResource",
                    "fsx:UpdateFileSystem", "iam:CreateServiceLinkedRole"),
             # kubernetes-sigs/aws-fsx-csi-driver v1.11.0 (chart 1.11.0): docs/install.md (example IAM policy),
             # pkg/cloud/cloud.go (CreateFileSystem, DeleteFileSystem, DescribeFileSystems, UpdateFileSystem on resize);
             # chart values controller.serviceAccount.name = fsx-csi-controller-sa
             source="kubernetes-sigs/aws-fsx-csi-driver v1.11.0 docs/install.md, pkg/cloud/cloud.go, charts/aws-fsx-csi-driver/values.yaml",
             inline=fsx_policy),
    Workload("efs-csi", "csi", "EFS CSI controller (EKS add-on aws-efs-csi-driver)", "kube-system", "efs-csi-controller-sa",
             calls=("elasticfilesystem:DescribeAccessPoints", "elasticfilesystem:DescribeFileSystems",
                    "elasticfilesystem:DescribeMountTargets", "elasticfilesystem:CreateAccessPoint",
                    "elasticfilesystem:DeleteAccessPoint", "elasticfilesystem:TagResource", "ec2:DescribeAvailabilityZones"),
             source="kubernetes-sigs/aws-efs-csi-driver v2.1 docs/iam-policy-example.json, pkg/cloud/cloud.go",
             managed=("arn:aws:iam::aws:policy/service-role/AmazonEFSCSIDriverPolicy",), addon="aws-efs-csi-driver"),
    Workload("ebs-csi", "eks", "EBS CSI controller (EKS add-on aws-ebs-csi-driver, gp3 default StorageClass)", "kube-system",
             "ebs-csi-controller-sa",
             calls=("ec2:CreateVolume", "ec2:DeleteVolume", "ec2:AttachVolume", "ec2:DetachVolume", "ec2:DescribeVolumes",
                    "ec2:DescribeInstances", "ec2:CreateTags", "ec2:ModifyVolume", "ec2:DescribeAvailabilityZones"),
             source="kubernetes-sigs/aws-ebs-csi-driver v1.48 docs/example-iam-policy.json, pkg/cloud/cloud.go",
             managed=("arn:aws:iam::aws:policy/service-role/AmazonEBSCSIDriverPolicy",), addon="aws-ebs-csi-driver"),
    Workload("cloudwatch-observability", "gpu-metrics", "CloudWatch agent of the amazon-cloudwatch-observability add-on "
             "(Container Insights, DCGM exporter)", "amazon-cloudwatch", "cloudwatch-agent",
             calls=("cloudwatch:PutMetricData", "logs:PutLogEvents", "logs:CreateLogStream", "logs:CreateLogGroup",
                    "logs:DescribeLogStreams", "ec2:DescribeTags", "ec2:DescribeVolumes"),
             # docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/install-CloudWatch-Observability-EKS-addon.html
             # (attach CloudWatchAgentServerPolicy; service account amazon-cloudwatch/cloudwatch-agent)
             source="AWS docs install-CloudWatch-Observability-EKS-addon; aws/amazon-cloudwatch-agent-operator helm values (cloudwatch-agent SA)",
             managed=("arn:aws:iam::aws:policy/CloudWatchAgentServerPolicy",), addon="amazon-cloudwatch-observability"),
    Workload("cloudwatch-agent-gpu", "gpu-metrics", "CloudWatch agent DaemonSet on GPU nodes (fallback)", "amazon-cloudwatch",
             "cloudwatch-agent-gpu",
             calls=("cloudwatch:PutMetricData", "ec2:DescribeTags", "ec2:DescribeInstances"),
             # aws/amazon-cloudwatch-agent: plugins/outputs/cloudwatch (PutMetricData), plugins/processors/ec2tagger
             # (DescribeTags, DescribeVolumes) and its docs' "ec2:DescribeTags" requirement
             source="aws/amazon-cloudwatch-agent plugins/outputs/cloudwatch/cloudwatch.go, plugins/processors/ec2tagger/ec2tagger.go",
             inline=cloudwatch_agent_policy),
    Workload("data-stage", "csi", "staging Job (csi.data.stage on the cluster)", "", "doeks-stage",
             calls=("s3:ListBucket", "s3:GetObject"),
             source="doeks/datastage.py: list_objects_v2 (s3:ListBucket), get_object (s3:GetObject)",
             inline=stage_policy, namespace_of=lambda s: s.namespace),
    Workload("train", "elasticjob", "the training job's pods (checkpoints and the model in S3: CHECKPOINT_URI, MODEL_URI)",
             "", TRAIN_SERVICE_ACCOUNT, calls=JOB_S3_CALLS,
             # doeks/workload/checkpoints.py through s3fs and DCP's fsspec writer/reader (or s3torchconnector):
             # ListObjectsV2 (names), HeadObject/GetObject (complete, latest, reads), PutObject and the multipart calls
             # (data, .metadata, latest, model.pt, the connector's probe), CopyObject (DCP's rename: GetObject +
             # PutObject), DeleteObject(s) (prune, clear_after, the probe), AbortMultipartUpload (a failed upload)
             source="doeks/workload/checkpoint_s3.py (_S3), checkpoints.py (Store, save_file); doeks/jobpaths.py JOB_S3_CALLS",
             inline=train_policy, namespace_of=lambda s: s.namespace),
    Workload("save-model", "csi", "csi.data.save-model's Job (a job's model and checkpoints on the claim to S3)", "",
             "doeks-save-model", calls=("s3:PutObject", "s3:AbortMultipartUpload"),
             # boto3's upload_file: PutObject, or CreateMultipartUpload/UploadPart/CompleteMultipartUpload (all
             # authorized as s3:PutObject) and AbortMultipartUpload when a part fails
             source="doeks/datastage.py _upload (upload_tree: boto3 S3 upload_file)",
             inline=save_model_policy, namespace_of=lambda s: s.namespace),
    Workload("pipeline-runner", "kubeflow", "KFP pipeline pods in the profile namespace (the sagemaker branch)", "",
             "default-editor",
             calls=("s3:PutObject", "sagemaker:CreateTrainingJob", "sagemaker:DescribeTrainingJob",
                    "sagemaker:StopTrainingJob", "sagemaker:AddTags", "iam:PassRole"),
             # doeks/pipeline.py train_sagemaker: put_object, create_training_job (with Tags -> sagemaker:AddTags, and
             # the execution role -> iam:PassRole), describe_training_job; StopTrainingJob to stop what it started.
             # Multi-user KFP runs a profile's pipeline pods as default-editor (kubeflow/manifests 26.03 README,
             # "kubectl -n $KF_PROFILE_NAMESPACE create token default-editor"); KFP_SERVICE_ACCOUNT names it.
             source="doeks/pipeline.py train_sagemaker; AWS docs sagemaker/latest/dg/sagemaker-roles.html (iam:PassRole, "
                    "sagemaker:AddTags with Tags)",
             inline=pipeline_runner_policy, namespace_of=lambda s: s.kfp_namespace,
             service_account_of=lambda s: s.kfp_service_account),
)
BY_KEY = {w.key: w for w in WORKLOADS}


def get(key: str) -> Workload:
    return BY_KEY[key]


def policies(settings, workload: Workload) -> list[dict[str, Any]]:
    """Every policy document the workload's role carries (managed ones as recorded in MANAGED)."""
    docs = [{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": MANAGED[arn], "Resource": "*"}]}
            for arn in workload.managed]
    inline = workload.inline(settings) if workload.inline else None
    return docs + ([inline] if inline else [])


def _listify(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def allows(documents: list[dict[str, Any]], action: str, resource: str | None = None) -> bool:
    """Whether any Allow statement matches the action (and the resource, when one is given); conditions are not evaluated."""
    for doc in documents:
        for statement in doc["Statement"]:
            if statement.get("Effect") != "Allow":
                continue
            if not any(fnmatch.fnmatchcase(action, pattern) for pattern in _listify(statement["Action"])):
                continue
            if resource is None or any(fnmatch.fnmatchcase(resource, r) for r in _listify(statement.get("Resource", "*"))):
                return True
    return False


def describe(settings, workload: Workload) -> str:
    what = ", ".join([arn.rsplit("/", 1)[-1] for arn in workload.managed] + ([policy_name(workload) + " (inline)"] if workload.inline else []))
    via = f"add-on {workload.addon}" if workload.addon else "pod identity association"
    return f"identity: {workload.ns(settings)}/{workload.sa(settings)} -> role {role_name(settings, workload)} [{what}] via {via}"


# -- make and remove ----------------------------------------------------------------------------------------------
def _client(settings, service):
    from .aws import client

    return client(settings, service)


def ensure_role(settings, runner, workload: Workload) -> str:
    """The role (trusted by pods.eks.amazonaws.com, tagged), its managed and inline policies; returns its ARN."""
    iam = _client(settings, "iam")
    name = role_name(settings, workload)
    ui.say(describe(settings, workload))
    try:
        arn = iam.get_role(RoleName=name)["Role"]["Arn"]
    except Exception as error:  # noqa: BLE001 - NoSuchEntity; in a dry run also no credentials / no account at all
        if not (runner.dry_run or type(error).__name__ == "NoSuchEntityException"):
            raise
        created = runner.call(iam, "create_role", RoleName=name, AssumeRolePolicyDocument=json.dumps(POD_IDENTITY_TRUST),
                              Description=f"doeks: {workload.what}", Tags=role_tags(settings))
        arn = created["Role"]["Arn"] if created else f"arn:aws:iam::<account>:role/{name}"
    for policy in workload.managed:
        runner.call(iam, "attach_role_policy", RoleName=name, PolicyArn=policy)
    inline = workload.inline(settings) if workload.inline else None
    if inline:
        runner.call(iam, "put_role_policy", RoleName=name, PolicyName=policy_name(workload),
                    PolicyDocument=json.dumps(inline))
    return arn


def associations(settings, workload: Workload) -> list[dict[str, Any]]:
    eks = _client(settings, "eks")
    try:
        return eks.list_pod_identity_associations(clusterName=settings.cluster_name, namespace=workload.ns(settings),
                                                  serviceAccount=workload.sa(settings))["associations"]
    except eks.exceptions.ResourceNotFoundException:
        return []


def ensure(settings, runner, workload: Workload) -> str:
    """Role + policies + (unless an add-on brings it) the Pod Identity association; returns the role ARN."""
    arn = ensure_role(settings, runner, workload)
    if workload.addon:
        return arn
    eks = _client(settings, "eks")
    try:
        found = [] if runner.dry_run and "<account>" in arn else associations(settings, workload)
    except Exception:  # noqa: BLE001 - a dry run without credentials shows the plan all the same
        if not runner.dry_run:
            raise
        found = []
    for association in found:
        current = eks.describe_pod_identity_association(clusterName=settings.cluster_name,
                                                        associationId=association["associationId"])["association"]
        if current["roleArn"] == arn:
            ui.say(f"pod identity association {workload.ns(settings)}/{workload.sa(settings)} exists")
            return arn
        runner.call(eks, "update_pod_identity_association", clusterName=settings.cluster_name,
                    associationId=association["associationId"], roleArn=arn)
        return arn
    runner.call(eks, "create_pod_identity_association", clusterName=settings.cluster_name, namespace=workload.ns(settings),
                serviceAccount=workload.sa(settings), roleArn=arn, tags={TAG: settings.cluster_name})
    return arn


def remove(settings, runner, workload: Workload) -> None:
    """The association(s) first, then the role with its policies; what is gone already is fine."""
    from . import aws as cluster

    if runner.dry_run:
        runner.call(_client(settings, "eks"), "delete_pod_identity_association", clusterName=settings.cluster_name,
                    associationId=f"<{workload.ns(settings)}/{workload.sa(settings)}>")
    elif cluster.describe_cluster(settings) is not None:
        eks = _client(settings, "eks")
        for association in associations(settings, workload):
            try:
                runner.call(eks, "delete_pod_identity_association", clusterName=settings.cluster_name,
                            associationId=association["associationId"])
            except eks.exceptions.ResourceNotFoundException:
                pass
    iam = _client(settings, "iam")
    name = role_name(settings, workload)
    try:
        attached = iam.list_attached_role_policies(RoleName=name)["AttachedPolicies"]
        inline = iam.list_role_policies(RoleName=name)["PolicyNames"]
    except Exception as error:  # noqa: BLE001 - NoSuchEntity; in a dry run also no credentials
        if not (runner.dry_run or type(error).__name__ == "NoSuchEntityException"):
            raise
        if runner.dry_run:
            runner.call(iam, "delete_role", RoleName=name)
        else:
            ui.say(f"role {name} is gone already")
        return
    for policy in attached:
        runner.call(iam, "detach_role_policy", RoleName=name, PolicyArn=policy["PolicyArn"])
    for policy in inline:
        runner.call(iam, "delete_role_policy", RoleName=name, PolicyName=policy)
    runner.call(iam, "delete_role", RoleName=name)


def addon_associations(settings, runner, workload: Workload) -> list[dict[str, str]]:
    """The `podIdentityAssociations` argument of CreateAddon for an add-on row (the role made first)."""
    return [{"serviceAccount": workload.sa(settings), "roleArn": ensure_role(settings, runner, workload)}]


def rows(settings) -> list[list[str]]:
    return [[w.unit, w.what, f"{w.ns(settings)}/{w.sa(settings)}", role_name(settings, w),
             ", ".join([a.rsplit("/", 1)[-1] for a in w.managed] + (["inline " + policy_name(w)] if w.inline else []))]
            for w in WORKLOADS]

"""csi: shared ReadWriteMany storage for training pods (EFS, FSx for Lustre) and data staging from S3.

On TARGET=local/docker the shared volume is a folder (STATE_DIR/volumes/SHARED_PVC) and every AWS call goes to the local
AWS-API endpoint; the EFS/FSx tasks need a cluster (TARGET=eks) and say so.
"""
from invoke import Collection

from doeks.taskkit import Unit, runner, settings, task


def _cluster_settings():
    from doeks.errors import DoeksError

    s = settings()
    if s.on_this_machine:
        raise DoeksError("EFS and FSx attach to a cluster: set TARGET=eks (on local the shared volume is the folder "
                         "STATE_DIR/volumes/SHARED_PVC, made by `invoke csi.deploy`)")
    return s


# -- EFS ----------------------------------------------------------------------------------------------------------
@task(name="create", help={"dry_run": "print the AWS requests; change nothing"})
def efs_create(c, dry_run=False):
    """Encrypted EFS for the cluster, an NFS-only security group, mount targets in its private subnets."""
    from doeks import storage, ui

    fs = storage.efs_create(_cluster_settings(), runner(dry_run))
    ui.say(f"EFS: {fs}")


@task(name="deploy", help={"dry_run": "print the manifests and requests; change nothing"})
def efs_deploy(c, dry_run=False):
    """EFS CSI driver (EKS add-on, Pod Identity role), StorageClass efs-sc, PV + PVC efs-pvc (RWX)."""
    from doeks import storage

    storage.efs_deploy(_cluster_settings(), runner(dry_run))


@task(name="delete", help={"dry_run": "print; change nothing"})
def efs_delete(c, dry_run=False):
    """Delete the Kubernetes objects, the driver add-on and its role; safe to run twice."""
    from doeks import storage

    storage.efs_delete(_cluster_settings(), runner(dry_run))


@task(name="destroy", help={"yes": "confirm: the file system and its data are deleted", "dry_run": "print; change nothing"})
def efs_destroy(c, yes=False, dry_run=False):
    """Delete mount targets (waits until gone), the file system and its security group; safe to run twice."""
    from doeks import storage
    from doeks.errors import DoeksError

    s = _cluster_settings()
    if not yes and not dry_run:
        raise DoeksError(f"csi.efs.destroy deletes the EFS of {s.cluster_name} and all data on it: pass --yes to confirm")
    storage.efs_destroy(s, runner(dry_run))


# -- FSx ----------------------------------------------------------------------------------------------------------
@task(name="deploy", help={"dry_run": "print the manifests, commands and requests; change nothing"})
def fsx_deploy(c, dry_run=False):
    """FSx CSI driver (pinned chart), scoped IAM, Lustre SG, fsx-sc and PVC; FSX_IMPORT_PATH: an S3 link once the PVC binds."""
    from doeks import storage

    storage.fsx_deploy(_cluster_settings(), runner(dry_run))


@task(name="delete", help={"force": "delete even while the PVC is bound", "dry_run": "print; change nothing"})
def fsx_delete(c, force=False, dry_run=False):
    """Reverse fsx.deploy: S3 link, objects, driver, policy and role, security group. Refuses while the PVC is bound."""
    from doeks import storage

    storage.fsx_delete(_cluster_settings(), runner(dry_run), force=force)


# -- data ---------------------------------------------------------------------------------------------------------
@task(name="stage", help={"source": "s3://bucket/prefix (default: s3://S3_BUCKET/DATA_S3_PREFIX)",
                          "relayout_val": "also turn a flat ImageNet val/ into class folders", "dry_run": "print; change nothing"})
def data_stage(c, source=None, relayout_val=False, dry_run=False):
    """Copy an S3 prefix into the shared volume: parallel, resumable, verified, with progress."""
    from doeks import aws, datastage, ui
    from doeks.local import runtime

    s = settings()
    source = source or f"s3://{s.s3_bucket}/{s.data_s3_prefix}"
    datastage.split_s3(source)
    if not s.on_this_machine:
        from doeks import identity, kube

        r = runner(dry_run)
        identity.ensure(s, r, identity.get("data-stage"))  # S3 read on the data prefix, for the Job's service account
        kube.apply(r, stage_manifests(s, source, relayout_val))
        return
    destination = runtime.shared_volume(s) / "data"
    r = runner(dry_run)
    if dry_run:
        r.step(f"stage {source} -> {destination} with {s.stage_threads} requests in flight", lambda: None)
        return
    with ui.progress() as bar:
        task_id = bar.add_task(f"staging {source}", total=None)
        result = datastage.stage(source, destination, region=s.aws_region, credentials=_credentials(s),
                                 endpoint_url=aws.endpoint_url(s), concurrency=s.stage_threads,
                                 progress=lambda done, total: bar.update(task_id, completed=done, total=total))
    ui.say(f"staged {result.files} files ({result.bytes / 1e6:.1f} MB) into {destination} in {result.seconds:.1f} s: "
           f"{result.downloaded} downloaded, {result.skipped} already there; verified")
    if relayout_val:
        ui.say(f"val re-layout: {datastage.relayout_val(destination)} files moved into class folders")


def _credentials(s):
    from doeks import aws

    creds = aws.session(s).get_credentials()
    if creds is None:
        return aws.LOCAL_CREDENTIALS
    frozen = creds.get_frozen_credentials()
    return {"aws_access_key_id": frozen.access_key, "aws_secret_access_key": frozen.secret_key, "aws_session_token": frozen.token}


def stage_manifests(s, source: str, relayout_val: bool) -> list[dict]:
    """The staging Job's service account (its Pod Identity association gives it S3 read) and the Job."""
    from doeks import identity

    workload = identity.get("data-stage")
    account = {"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": workload.service_account, "namespace": s.namespace, "labels": {"app.kubernetes.io/part-of": "doeks"}}}
    return [account, stage_job(s, source, relayout_val)]


def stage_job(s, source: str, relayout_val: bool) -> dict:
    """The Kubernetes Job that stages data on the cluster, in the training image (TRAIN_IMAGE: it has doeks'
    datastage), as the doeks-stage service account, with the shared PVC mounted."""
    from doeks import identity, trainimage

    image = trainimage.reference(s, on_this_machine=False)
    args = ["python", "-m", "doeks.datastage", source, f"{s.shared_mount}/data", "--threads", str(s.stage_threads)]
    if relayout_val:
        args.append("--relayout-val")
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{s.job_name}-stage", "namespace": s.namespace, "labels": {"app.kubernetes.io/part-of": "doeks"}},
            "spec": {"backoffLimit": 3, "ttlSecondsAfterFinished": 86400, "template": {"spec": {
                "restartPolicy": "OnFailure", "serviceAccountName": identity.get("data-stage").service_account,
                "containers": [{"name": "stage", "image": image, "command": args,
                                "env": [{"name": "AWS_REGION", "value": s.aws_region}],
                                "resources": {"requests": {"cpu": "2", "memory": "2Gi"}},
                                "volumeMounts": [{"name": "shared", "mountPath": s.shared_mount}]}],
                "volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": s.shared_pvc}}]}}}}


@task(name="save-model", help={"destination": "s3://bucket/prefix (default: s3://S3_BUCKET/models/JOB_NAME)",
                               "dry_run": "print; change nothing"})
def data_save_model(c, destination=None, dry_run=False):
    """Upload the job's checkpoints and final model to S3 under a dated prefix."""
    import time

    from doeks import aws, datastage, ui
    from doeks.errors import DoeksError

    s = settings()
    folder = _checkpoints_here(s)
    if not folder.is_dir() or not any(folder.iterdir()):
        raise DoeksError(f"no checkpoints in {folder}: train first (invoke elasticjob.deploy)")
    target = f"{(destination or f's3://{s.s3_bucket}/models/{s.job_name}').rstrip('/')}/{time.strftime('%Y-%m-%d-%H%M%S')}"
    datastage.split_s3(target)
    if dry_run:
        runner(True).step(f"upload {folder} -> {target}", lambda: None)
        return
    client = datastage.s3_client(aws.endpoint_url(s), s.aws_region, 16, _credentials(s))
    count = datastage.upload_tree(client, folder, target)
    ui.say(f"uploaded {count} files to {target}")


def _checkpoints_here(s):
    """The job's checkpoint folder when its target keeps it on this machine; one line saying where it is otherwise."""
    from doeks import targets

    return targets.get(s).local_artifact("checkpoints", "csi.data.save-model", "the checkpoints are in {where}, not on "
                                         "this machine (SageMaker keeps the model in S3 already)")


@task(help={"dry_run": "print; change nothing"})
def deploy(c, dry_run=False):
    """Make the shared volume ready (TARGET=local/docker: its folder; eks: FSx, the default for training data)."""
    from doeks.local import runtime

    s = settings()
    if s.on_this_machine or s.own_cluster:
        folder = runtime.shared_volume(s)
        runner(dry_run).step(f"create shared volume folder {folder}", folder.mkdir, parents=True, exist_ok=True)
    if s.on_this_machine:
        return
    if s.target == "kubernetes":
        from doeks import kube

        kube.use(s)
        r, claim = runner(dry_run), kube.shared_claim(s)  # the folder's volume on doeks' cluster; else STORAGE_CLASS
        kube.move_volume(r, s, claim)
        kube.apply(r, claim)
        return
    fsx_deploy(c, dry_run=dry_run)


@task(help={"force": "delete even while the PVC is bound or a pod uses it", "dry_run": "print; change nothing"})
def delete(c, force=False, dry_run=False):
    """Reverse csi.deploy (TARGET=local/docker: the folder and its data are kept).

    TARGET=kubernetes: a claim a pod still uses is left in place with one line naming the pods (doeks' own cluster:
    asked to go without waiting, since `down` stops the cluster with them; --force: the same elsewhere)."""
    from doeks import ui
    from doeks.local import runtime

    s = settings()
    if s.on_this_machine:
        ui.say(f"TARGET=local/docker: keeping {runtime.shared_volume(s)} (data and checkpoints); remove it by hand if unwanted")
        return
    if s.target == "kubernetes":
        from doeks import kube

        kube.use(s)
        if not dry_run and kube.own_cluster_stopped(s):
            ui.say(f"doeks' cluster is not running: no claim on it; keeping {runtime.shared_volume(s)}")
            return
        # the claim first (claim protection: it goes once no pod uses it), then its volume; the folder stays
        kube.delete_claim(runner(dry_run), s, s.namespace, s.shared_pvc, list(reversed(kube.shared_claim(s))), force)
        if s.own_cluster:
            ui.say(f"keeping {runtime.shared_volume(s)} (data and checkpoints); remove it by hand if unwanted")
        return
    from doeks import storage

    r = runner(dry_run)
    fsx_delete(c, force=force, dry_run=dry_run)
    if dry_run or storage.find_efs(s):  # EFS made by csi.efs.create: its driver, then mount targets, file system, group
        storage.efs_delete(s, r)
        storage.efs_destroy(s, r)


efs = Collection("efs", efs_create, efs_deploy, efs_delete, efs_destroy)
fsx = Collection("fsx", fsx_deploy, fsx_delete)
data = Collection("data", data_stage, data_save_model)
ns = Collection("csi", deploy, delete)
ns.add_collection(efs)
ns.add_collection(fsx)
ns.add_collection(data)
UNIT = Unit("csi", order=20, up=deploy, down=delete)

"""csi: shared ReadWriteMany storage for training pods (EFS, FSx for Lustre) and data staging from S3.

deploy/delete and data.stage ask the target (doeks.targets: `volume_deploy`, `volume_delete`, `stage_data`): on
TARGET=local/docker the shared volume is a folder (STATE_DIR/volumes/SHARED_PVC) and every AWS call goes to the local
AWS-API endpoint; the EFS/FSx tasks need an EKS cluster and say so elsewhere (`aws_storage`).
"""
from invoke import Collection

from doeks.taskkit import Unit, runner, settings, target, task


def _cluster_settings():
    s = settings()
    target(s).aws_storage("EFS and FSx")
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
    """Copy an S3 prefix into the shared volume: parallel, resumable, verified, with progress (on a cluster: a Job)."""
    from doeks import datastage

    s = settings()
    source = source or f"s3://{s.s3_bucket}/{s.data_s3_prefix}"
    datastage.split_s3(source)
    target(s).stage_data(runner(dry_run), source, relayout_val)


def stage_manifests(s, source: str, relayout_val: bool) -> list[dict]:
    """The staging Job's service account and the Job (doeks.storage.stage_manifests)."""
    from doeks import storage

    return storage.stage_manifests(s, source, relayout_val)


@task(name="save-model", help={"destination": "s3://bucket/prefix (default: s3://S3_BUCKET/models/JOB_NAME; eks: "
                                              "s3://S3_BUCKET/doeks/saved/JOB_NAME)",
                               "job_name": "the job whose model and checkpoints to copy (JOB_NAME)",
                               "dry_run": "print; change nothing"})
def data_save_model(c, destination=None, job_name=None, dry_run=False):
    """Copy the job's checkpoints and final model to S3 under a dated prefix (eks: a Job reads them on the claim)."""
    target(settings(job_name=job_name)).save_model(runner(dry_run), destination)


@task(help={"dry_run": "print; change nothing"})
def deploy(c, dry_run=False):
    """Make the shared volume ready (TARGET=local/docker: its folder; eks: FSx, the default for training data)."""
    target().volume_deploy(runner(dry_run))


@task(help={"force": "delete even while the PVC is bound or a pod uses it", "dry_run": "print; change nothing"})
def delete(c, force=False, dry_run=False):
    """Reverse csi.deploy (TARGET=local/docker: the folder and its data are kept).

    TARGET=kubernetes: a claim a pod still uses is left in place with one line naming the pods (doeks' own cluster:
    asked to go without waiting, since `down` stops the cluster with them; --force: the same elsewhere)."""
    target().volume_delete(runner(dry_run), force=force)


efs = Collection("efs", efs_create, efs_deploy, efs_delete, efs_destroy)
fsx = Collection("fsx", fsx_deploy, fsx_delete)
data = Collection("data", data_stage, data_save_model)
ns = Collection("csi", deploy, delete)
ns.add_collection(efs)
ns.add_collection(fsx)
ns.add_collection(data)
UNIT = Unit("csi", order=20, up=deploy, down=delete)

"""sagemaker: the same training script and data as a SageMaker training job, the scoped execution role, and the S3
gateway endpoint for the cluster's VPC. Mounted at the root as `sagemaker.*`."""
from invoke import Collection

from doeks.taskkit import Int, runner, settings, task


@task(help={"dry_run": "print the IAM requests; change nothing"})
def role(c, dry_run=False):
    """Create (or update) the SageMaker execution role with scoped permissions."""
    from doeks import sagemaker, ui

    arn = sagemaker.ensure_role(settings(), runner(dry_run))
    ui.say(f"execution role: {arn}")


@task(name="role-delete", help={"dry_run": "print the IAM requests; change nothing"})
def role_delete(c, dry_run=False):
    """Delete the execution role and its policy; safe to run twice."""
    from doeks import sagemaker

    sagemaker.delete_role(settings(), runner(dry_run))


@task(help={"max_steps": "stop after this many steps (0 = all epochs)", "dry_run": "print the full CreateTrainingJob request"},
      flags={"max_steps": Int(0, 10**9)})
def train(c, max_steps=0, dry_run=False):
    """Submit a SageMaker training job running doeks/workload/train.py under torchrun."""
    import json
    import sys

    from doeks import sagemaker

    from doeks.taskkit import int_flag

    request = sagemaker.submit(settings(), runner(dry_run), int_flag("max_steps", max_steps, 0, 10**9))
    if dry_run:
        sys.stdout.write(json.dumps(request, indent=2) + "\n")


@task(help={"name": "training job name (default: the newest of JOB_NAME)"})
def status(c, name=None):
    """Show a training job's status, times and model artifact as a table."""
    from doeks import sagemaker, ui

    s = settings()
    job = sagemaker.describe(s, name or sagemaker.latest_job(s))
    ui.table(f"SageMaker training job {job['TrainingJobName']}", ["field", "value"], [
        ["status", job["TrainingJobStatus"]], ["secondary", job.get("SecondaryStatus", "")],
        ["instances", f"{job['ResourceConfig']['InstanceCount']} x {job['ResourceConfig']['InstanceType']}"],
        ["spot", job.get("EnableManagedSpotTraining", False)], ["model", job.get("ModelArtifacts", {}).get("S3ModelArtifacts", "")],
        ["failure", job.get("FailureReason", "")]])


@task(help={"name": "training job name (default: the newest of JOB_NAME)"})
def logs(c, name=None):
    """Print the job's CloudWatch logs."""
    import sys

    from doeks import sagemaker, ui

    s = settings()
    job = name or sagemaker.latest_job(s)
    lines = sagemaker.logs(s, job)
    if not lines:
        ui.say(f"no CloudWatch logs for {job} (yet): a local AWS-API endpoint runs no training and keeps none")
    for line in lines:
        sys.stdout.write(line + "\n")


@task(help={"name": "training job name (default: the newest of JOB_NAME)", "dry_run": "print the request"})
def stop(c, name=None, dry_run=False):
    """Stop a running training job; a finished one is left alone."""
    from doeks import sagemaker

    from doeks.aws import lookup

    s = settings()
    r = runner(dry_run)
    name = name or lookup(r, f"latest SageMaker training job of {s.job_name}", lambda: sagemaker.latest_job(s))
    if name is None:  # a dry run without credentials
        r.note(f"would stop the latest SageMaker training job of {s.job_name} if it is InProgress")
        return
    sagemaker.stop(s, r, name)


@task(name="s3-endpoint", help={"vpc": "VPC id (default: the cluster's)", "dry_run": "print the request"})
def s3_endpoint(c, vpc=None, dry_run=False):
    """Create the S3 gateway VPC endpoint so training in that VPC reaches S3; idempotent."""
    from doeks import eks, sagemaker

    from doeks.aws import lookup

    s = settings()
    r = runner(dry_run)
    vpc = vpc or lookup(r, f"VPC of cluster {s.cluster_name}", lambda: _cluster_vpc(s, eks), unknown="<cluster VPC>")
    sagemaker.ensure_s3_endpoint(s, r, vpc)


@task(name="s3-endpoint-delete", help={"vpc": "VPC id (default: the cluster's)", "dry_run": "print the request"})
def s3_endpoint_delete(c, vpc=None, dry_run=False):
    """Delete the S3 gateway VPC endpoint; safe to run twice."""
    from doeks import eks, sagemaker

    from doeks.aws import lookup

    s = settings()
    r = runner(dry_run)
    vpc = vpc or lookup(r, f"VPC of cluster {s.cluster_name}", lambda: _cluster_vpc(s, eks), unknown="<cluster VPC>")
    sagemaker.delete_s3_endpoint(s, r, vpc)


def _cluster_vpc(s, eks):
    from doeks.errors import DoeksError

    from doeks import storage

    if eks.describe(s) is None:
        raise DoeksError(f"cluster {s.cluster_name} not found: pass --vpc vpc-... or create the cluster first")
    return storage.cluster_network(s)["vpc"]


ns = Collection("sagemaker", role, role_delete, train, status, logs, stop, s3_endpoint, s3_endpoint_delete)

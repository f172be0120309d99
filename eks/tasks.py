"""eks: the cluster, made, scaled and removed by eksctl from `.env`; read back with boto3 and kubernetes.

create/delete/status ask the target (doeks.targets: `cluster_create`, `cluster_delete`, `cluster_status`): on
TARGET=local/docker they bring the local runtime (etcd, the moto AWS-API endpoint, the volume folder) up and down, so
the same setup and teardown order works everywhere; on TARGET=kubernetes they start and stop doeks' own single-node
cluster (KUBECONFIG empty), or check the user's cluster is reachable and leave it as it is.
"""
from invoke import Collection

from doeks.taskkit import Choice, Int, Unit, runner, settings, target, task


@task(help={"out": "write the ClusterConfig to this file instead of stdout"})
def config(c, out=None):
    """Render the eksctl ClusterConfig (eksctl.io/v1alpha5) from .env (or show EKS_YAML as-is)."""
    import sys
    from pathlib import Path

    from doeks import eks, ui

    text = eks.config_yaml(settings())
    if out:
        Path(out).write_text(text)
        ui.say(f"ClusterConfig written to {out}")
    else:
        sys.stdout.write(text)


@task(help={"dry_run": "print the ClusterConfig and the eksctl commands; change nothing"})
def create(c, dry_run=False):
    """Create the cluster with eksctl and connect kubectl (TARGET=local/docker: start the local runtime)."""
    target().cluster_create(runner(dry_run))


@task(help={"dry_run": "print the eksctl command; change nothing", "yes": "do not ask for confirmation"})
def delete(c, dry_run=False, yes=False):
    """Delete the cluster with eksctl and wait (TARGET=local/docker: stop the local runtime); safe to run twice."""
    target().cluster_delete(runner(dry_run), yes=yes)


@task
def status(c):
    """Cluster, node groups (boto3) and nodes (kubernetes, when reachable) as tables."""
    target().cluster_status()


@task(help={"nodegroup": "node group name (sys, cpu, gpu)", "size": "desired nodes", "min": "new minimum",
            "max": "new maximum", "dry_run": "print the eksctl command; change nothing"},
      flags={"size": Int(0, 1000), "min": Int(0, 1000), "max": Int(0, 1000)})
def scale(c, nodegroup, size, min=None, max=None, dry_run=False):  # noqa: A002 - flag names users expect
    """Scale a node group with `eksctl scale nodegroup`."""
    from doeks import eks

    eks.scale(settings(), runner(dry_run), nodegroup, size, min, max)


@task(help={"dry_run": "print the command; change nothing"})
def connect(c, dry_run=False):
    """Write the cluster's kubeconfig (eksctl utils write-kubeconfig)."""
    from doeks import eks

    eks.connect(settings(), runner(dry_run))


@task(help={"principal": "IAM role or user ARN", "access": "admin, edit or view", "namespace": "limit to namespaces (repeatable)",
            "dry_run": "print the API requests; change nothing"}, iterable=["namespace"],
      flags={"access": Choice("admin", "edit", "view")})
def authorize(c, principal, access="admin", namespace=None, dry_run=False):
    """Give an IAM principal access to the cluster with an EKS access entry."""
    from doeks import eks

    eks.authorize(settings(), runner(dry_run), principal, access, tuple(namespace or ()))


ns = Collection("eks", config, create, delete, status, scale, connect, authorize)
UNIT = Unit("eks", order=10, up=create, down=delete)

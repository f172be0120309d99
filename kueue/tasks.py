"""kueue: Kueue on the cluster (quotas per queue, all-or-nothing admission of a job's pods, one network block per job),
a ResourceFlavor per node type, the ClusterQueue with QUEUE_CPU/QUEUE_MEMORY/QUEUE_GPUS/QUEUE_EFA, and the LocalQueue
jobs go to with QUEUE set.

deploy/delete/status ask the target (doeks.targets: `queue_deploy`, `queue_delete`, `queue_status`): doeks' own
cluster runs the Kueue built here (`invoke setup --kueue`), EKS and the user's cluster the release's manifests; the
targets on this machine and SageMaker have no queue.
"""
from invoke import Collection

from doeks.taskkit import Unit, runner, target, task


@task(help={"dry_run": "print the kustomization and the queue objects (stdout) and the commands; change nothing"})
def deploy(c, dry_run=False):
    """Deploy Kueue (v0.19.2, PyTorchJob and TrainJob admitted, waitForPodsReady on) and the queue: flavors, quotas.

    A ResourceFlavor per node type, the ClusterQueue `doeks` with QUEUE_CPU, QUEUE_MEMORY, QUEUE_GPUS and QUEUE_EFA
    on each, a Topology of EKS' network layers where the node type has them, and the LocalQueue QUEUE in NAMESPACE."""
    target().queue_deploy(runner(dry_run))


@task(help={"dry_run": "print what would be deleted; change nothing"})
def delete(c, dry_run=False):
    """Delete the queues and Kueue itself (its CRDs, webhooks, namespace); safe to run twice."""
    target().queue_delete(runner(dry_run))


@task
def status(c):
    """Quota and usage per node type, and every queued job: admitted, or why it waits (quota, topology)."""
    target().queue_status()


ns = Collection("kueue", deploy, delete, status)
UNIT = Unit("kueue", order=55, up=deploy, down=delete)

"""eks: the cluster, made and removed by eksctl from `.env` (on TARGET=local: the local runtime instead)."""
from invoke import Collection

from doeks.taskkit import Unit, runner, settings, task


@task(help={"dry_run": "print what would be created; change nothing"})
def create(c, dry_run=False):
    """Create the cluster (TARGET=local: start etcd and the local AWS-API endpoint)."""
    from doeks.local import runtime

    s = settings()
    if s.target == "local":
        runtime.up(s, runner(dry_run))
        return
    from doeks.errors import DoeksError

    raise DoeksError("eks.create for TARGET=eks is not built yet (issue 4)")


@task(help={"dry_run": "print what would be deleted; change nothing", "yes": "do not ask for confirmation"})
def delete(c, dry_run=False, yes=False):
    """Delete the cluster (TARGET=local: stop the local runtime); safe to run twice."""
    from doeks.local import runtime

    s = settings()
    if s.target == "local":
        runtime.down(s, runner(dry_run))
        return
    from doeks.errors import DoeksError

    raise DoeksError("eks.delete for TARGET=eks is not built yet (issue 4)")


@task
def status(c):
    """Show the cluster (TARGET=local: the local runtime's servers) as a table."""
    from doeks import ui
    from doeks.local import runtime

    s = settings()
    ui.table("local runtime", ["server", "state", "endpoint", "pid"], runtime.rows(s))


ns = Collection("eks", create, delete, status)
UNIT = Unit("eks", order=10, up=create, down=delete)

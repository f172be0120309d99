"""eks: the cluster, made, scaled and removed by eksctl from `.env`; read back with boto3 and kubernetes.

On TARGET=local/docker, create/delete bring the local runtime (etcd, the moto AWS-API endpoint, the volume folder) up and
down instead, so the same setup and teardown order works everywhere. On TARGET=kubernetes they start and stop doeks'
own single-node cluster (KUBECONFIG empty), or check the user's cluster is reachable and leave it as it is.
"""
from invoke import Collection

from doeks.taskkit import Choice, Int, Unit, runner, settings, task


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
    from doeks import eks, ui
    from doeks.local import runtime

    s = settings()
    if s.on_this_machine:
        ui.say(f"TARGET=local/docker: no cluster; {'the plan for' if dry_run else 'starting'} the local runtime "
               "(etcd, AWS-API endpoint, volume folder)")
        runtime.up(s, runner(dry_run))
        return
    if s.target == "kubernetes":
        _kubernetes_up(s, runner(dry_run))
        return
    eks.create(s, runner(dry_run))


def _kubernetes_up(s, r):
    """doeks' own cluster started (KUBECONFIG empty), or the user's cluster checked; the KUBECONFIG line to export."""
    from doeks import kube, ui
    from doeks.cluster import lifecycle, versions

    if s.own_cluster:
        ui.say(f"TARGET=kubernetes, KUBECONFIG empty: {'the plan for' if r.dry_run else 'starting'} doeks' own "
               f"single-node cluster (Kubernetes v{versions.KUBERNETES})")
        path = lifecycle.up(r, nodes=s.kube_nodes)
    else:
        path = kube.kubeconfig_path(s)
        ui.say(f"TARGET=kubernetes: using the cluster in {s.kubeconfig}"
               + (f" (context {s.kube_context})" if s.kube_context else "") + "; nothing to create")
        if not r.dry_run:
            kube.use(s)
            r.run([kube.kubectl(), "get", "nodes"], mutating=False)
    if r.dry_run:
        ui.say(f"kubeconfig: {path}")   # stdout stays the plan's YAML stream
    else:
        print(f"export KUBECONFIG={path}")


@task(help={"dry_run": "print the eksctl command; change nothing", "yes": "do not ask for confirmation"})
def delete(c, dry_run=False, yes=False):
    """Delete the cluster with eksctl and wait (TARGET=local/docker: stop the local runtime); safe to run twice."""
    from doeks import eks, ui
    from doeks.errors import DoeksError
    from doeks.local import runtime

    s = settings()
    if s.on_this_machine:
        ui.say("TARGET=local/docker: stopping the local runtime (jobs, etcd, AWS-API endpoint); volumes are kept")
        runtime.down(s, runner(dry_run))
        return
    if s.target == "kubernetes":
        from doeks.cluster import lifecycle

        if not s.own_cluster:
            ui.say(f"TARGET=kubernetes: the cluster in {s.kubeconfig} is the user's; it keeps running")
            return
        ui.say("TARGET=kubernetes: stopping doeks' own cluster (every process, mount, network namespace, iptables "
               "rule, bridge and cgroup it made); built binaries and images stay cached")
        if not lifecycle.down(runner(dry_run)) and not dry_run:
            ui.say("doeks' cluster was not running")
        return
    if not dry_run and not yes:
        import sys

        if not sys.stdin.isatty():
            raise DoeksError(f"eks.delete removes cluster {s.cluster_name} and all it runs: pass --yes to confirm")
        answer = input(f"Delete cluster {s.cluster_name} in {s.aws_region}? Type its name to confirm: ")
        if answer.strip() != s.cluster_name:
            raise DoeksError("not confirmed: nothing deleted")
    eks.delete(s, runner(dry_run))


@task
def status(c):
    """Cluster, node groups (boto3) and nodes (kubernetes, when reachable) as tables."""
    from doeks import eks, ui
    from doeks.local import runtime

    s = settings()
    if s.on_this_machine:
        ui.table("local runtime (TARGET=local/docker)", ["server", "state", "endpoint", "pid"], runtime.rows(s))
        return
    if s.target == "kubernetes":
        from doeks.cluster import guard, lifecycle, versions

        if s.own_cluster:
            ui.table(f"doeks' cluster (Kubernetes v{versions.KUBERNETES})", ["component", "state", "pid", "log"],
                     lifecycle.status_rows())
            ui.say(f"network guard: {'installed' if guard.installed() else 'not installed'}, "
                   f"{guard.dropped()} packets dropped")
        return
    head, groups = eks.status_rows(s)
    ui.table(f"EKS cluster ({s.aws_region})", ["cluster", "status", "version", "endpoint", "platform"], head)
    if groups:
        ui.table("node groups", ["node group", "status", "instance types", "min/desired/max", "capacity", "processor"], groups)
    try:
        ui.table("nodes", ["node", "instance type", "ready", "nvidia.com/gpu", "vpc.amazonaws.com/efa"], eks.node_rows())
    except Exception as error:  # noqa: BLE001 - the cluster API may be unreachable from here
        ui.say(f"nodes: Kubernetes API not reachable ({type(error).__name__}): run `invoke eks.connect`")


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

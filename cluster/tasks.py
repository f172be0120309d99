"""cluster: doeks' own cluster's nodes (TARGET=kubernetes, KUBECONFIG empty): list them, lose one and bring it back.

`KUBE_NODES=3 TARGET=kubernetes invoke up` starts three nodes (doeks, doeks-1, doeks-2: doeks.cluster.node); a test
or a bench loses one with `invoke cluster.node-stop doeks-2` (its kubelet, kube-proxy, containers and containerd
stopped, its link down, as a machine that is lost) and `invoke cluster.node-start doeks-2` brings it back. Not a unit:
`up` and `down` start and stop every node through the eks unit.
"""
from invoke import Collection

from doeks.taskkit import runner, settings, task


def _own_cluster():
    from doeks.errors import DoeksError

    s = settings()
    if not s.own_cluster:  # (TARGET=kubernetes and KUBECONFIG empty or doeks' own: Settings.own_cluster)
        raise DoeksError("cluster.* works on doeks' own cluster: TARGET=kubernetes with KUBECONFIG empty "
                         f"(now TARGET={s.target}" + (f", KUBECONFIG={s.kubeconfig}" if s.kubeconfig else "") + ")")
    return s


@task
def nodes(c):
    """doeks' own cluster's nodes: address, pod range, processes, and what the API server says (Ready, cordoned)."""
    from doeks import ui
    from doeks.cluster import lifecycle

    _own_cluster()
    ui.table("doeks' cluster: nodes", ["node", "address", "pods", "processes", "API server"], lifecycle.node_rows())


@task(help={"name": "the node to lose (doeks-1, doeks-2, ...: `invoke cluster.nodes` lists them)",
            "dry_run": "print what would be stopped; change nothing"})
def node_stop(c, name, dry_run=False):
    """Lose one node as a machine is lost: its kubelet, kube-proxy, containers and containerd stopped, its link down."""
    from doeks import ui
    from doeks.cluster import lifecycle

    _own_cluster()
    if lifecycle.stop_node(runner(dry_run), name):
        ui.say(f"node {name} stopped: its pods' processes are gone; the API server marks it NotReady after the "
               "controller manager's grace period (`invoke cluster.node-start " + name + "` brings it back)")


@task(help={"name": "the node to start again (`invoke cluster.nodes` lists them)",
            "dry_run": "print what would be started; change nothing"})
def node_start(c, name, dry_run=False):
    """Start a stopped node again: its processes, the images its pods name; waits until it is Ready."""
    from doeks import ui
    from doeks.cluster import lifecycle

    _own_cluster()
    if lifecycle.start_node(runner(dry_run), name):
        ui.say(f"node {name} is back and Ready: the pods bound to it start again")
    elif not dry_run:
        ui.say(f"node {name} was running; it is Ready")


ns = Collection("cluster", nodes, node_stop, node_start)

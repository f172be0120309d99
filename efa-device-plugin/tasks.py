"""efa: the EFA device plugin and MPI operator, and an NCCL all-reduce test that proves EFA is really used.

Every verb but `report` asks the target (doeks.targets: `efa_deploy`, `efa_delete`, `efa_status`, `efa_test`).
On TARGET=local/docker there is no EFA hardware: deploy/delete say so and change nothing, and `efa.test` runs the same
message-size sweep with torch.distributed all_reduce across local processes, reported the same way.
On doeks' own cluster (TARGET=kubernetes, KUBECONFIG empty) there is no EFA either: deploy skips the device plugin
and runs the MPI operator (built from its Go module, deployed from the module's manifest), and `efa.test` runs the
MPIJob for real with a local stand-in of the nccl-tests image: an MPI all-reduce on CPU over TCP, said as such.
"""
from pathlib import Path

from invoke import Collection

from doeks.taskkit import Int, Size, Unit, runner, settings, target, task


@task(help={"dry_run": "print the manifests and commands; change nothing"})
def deploy(c, dry_run=False):
    """Deploy the EFA device plugin DaemonSet (EFA instance types only) and the MPI operator (server-side apply).

    doeks' own cluster: the MPI operator alone (no EFA there), built from its Go module and deployed from its manifest."""
    target().efa_deploy(runner(dry_run))


@task(help={"dry_run": "print what would be deleted; change nothing"})
def delete(c, dry_run=False):
    """Delete the MPI operator and the EFA device plugin; safe to run twice."""
    target().efa_delete(runner(dry_run))


@task
def status(c):
    """Show the device plugin DaemonSet and allocatable EFA per node (doeks' cluster: the MPI operator)."""
    target().efa_status()


@task(help={"nodes": "nodes to test across (default: GPU_NODES, at least 2)",
            "end": "largest message (default 1G; 64M on local; 1M on CPU, e.g. doeks' cluster)",
            "dry_run": "print the MPIJob; change nothing"}, flags={"nodes": Int(1, 1000), "end": Size()})
def test(c, nodes=None, end=None, dry_run=False):
    """nccl-tests all_reduce_perf across nodes, parsed into a table and a chart; fails if NCCL fell back to TCP.

    doeks' own cluster: the same MPIJob on CPU with a stand-in image (an MPI all-reduce over TCP), reported as such."""
    target().efa_test(runner(dry_run), nodes, end)


@task(help={"file": "a saved nccl-tests log (all_reduce_perf's output, e.g. `invoke efa.test`'s)",
            "require_efa": "exit 1 unless the log shows NCCL used the EFA provider",
            "out": "the chart: a .png path, or a folder (default: STATE_DIR/plots); named <FILE's stem>-busbw.png"})
def report(c, file, require_efa=False, out=None):
    """Parse a saved nccl-tests log into a table and a bus-bandwidth chart (STATE_DIR/plots/<stem>-busbw.png)."""
    from doeks import nccl, plots
    from doeks.errors import DoeksError

    path = Path(file)
    if not path.is_file():
        raise DoeksError(f"{file}: no such file")
    nccl.report(path.read_text(errors="replace"), plots.plot_path(settings(), f"{path.stem}-busbw.png", out), path.name,
                require_efa)


ns = Collection("efa", deploy, delete, status, test, report)
UNIT = Unit("efa", order=30, up=deploy, down=delete)

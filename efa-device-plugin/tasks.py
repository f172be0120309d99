"""efa: the EFA device plugin and MPI operator, and an NCCL all-reduce test that proves EFA is really used.

On TARGET=local/docker there is no EFA hardware: deploy/delete say so and change nothing, and `efa.test` runs the same
message-size sweep with torch.distributed all_reduce across local processes, reported the same way.
On doeks' own cluster (TARGET=kubernetes, KUBECONFIG empty) there is no EFA either: deploy skips the device plugin
and runs the MPI operator (built from its Go module, deployed from the module's manifest), and `efa.test` runs the
MPIJob for real with a local stand-in of the nccl-tests image: an MPI all-reduce on CPU over TCP, said as such.
"""
from pathlib import Path

from invoke import Collection

from doeks.taskkit import Int, Size, Unit, runner, settings, task


def _report(text: str, png: Path, title: str, require_efa: bool):
    from doeks import nccl, ui
    from doeks.errors import DoeksError

    report = nccl.parse(text)
    if not report.rows:
        raise DoeksError("no nccl-tests result rows found in the output: is it all_reduce_perf output?")
    ui.table(title, ["size", "type", "time us", "algbw GB/s", "busbw GB/s", "in-place algbw", "in-place busbw"],
             nccl.table_rows(report))
    png = nccl.chart(report, png, title)
    ui.say(f"transport: {report.transport}; avg bus bandwidth {report.avg_busbw or 0:.3f} GB/s; max {report.max_busbw:.2f} GB/s")
    ui.say(f"chart: {png}")
    if require_efa and report.transport == "mpi-tcp":
        raise DoeksError("no EFA: this log is doeks' CPU stand-in of all_reduce_perf (an MPI all-reduce over TCP on "
                         "doeks' own cluster; no NCCL, GPU or EFA)")
    if require_efa and not report.efa:
        raise DoeksError(f"NCCL did not use EFA (transport: {report.transport}; no 'Selected Provider is efa' line): "
                         "check the EFA device plugin, the pod's vpc.amazonaws.com/efa request and the aws-ofi-nccl plugin")
    return report


@task(help={"dry_run": "print the manifests and commands; change nothing"})
def deploy(c, dry_run=False):
    """Deploy the EFA device plugin DaemonSet (EFA instance types only) and the MPI operator (server-side apply).

    doeks' own cluster: the MPI operator alone (no EFA there), built from its Go module and deployed from its manifest."""
    from doeks import efa, kube, ui

    s = settings()
    if s.on_this_machine:
        ui.say("TARGET=local/docker: no EFA devices here; nothing to deploy (efa.test runs a local all-reduce sweep)")
        return
    if s.own_cluster:
        if not dry_run and kube.own_cluster_stopped(s):
            ui.say("doeks' cluster is not running: nothing to deploy on it (`TARGET=kubernetes invoke up` starts it)")
            return
        ui.say("doeks' cluster: EFA is an AWS network adapter and this machine has none: the EFA device plugin is "
               f"skipped; the MPI operator {efa.MPI_OPERATOR_VERSION} is deployed from its Go module's "
               "deploy/v2beta1/mpi-operator.yaml")
        efa.mpi_operator_deploy(s, runner(dry_run))
        return
    if s.target == "kubernetes":
        ui.say("TARGET=kubernetes: EFA is an AWS network adapter; no device plugin to deploy on this cluster")
        return
    r = runner(dry_run)
    # one plugin, one owner: eksctl's efaEnabled installs its own DaemonSet of the same name (v0.3.3, fields such as
    # runAsNonRoot that an apply would keep); doeks replaces it rather than merging into it, and efa.delete removes it
    kube.run(r, efa.replace_eksctl_plugin_argv())
    kube.apply(r, efa.device_plugin(s))
    efa.mpi_operator_deploy(s, r)


@task(help={"dry_run": "print what would be deleted; change nothing"})
def delete(c, dry_run=False):
    """Delete the MPI operator and the EFA device plugin; safe to run twice."""
    from doeks import efa, kube, ui

    s = settings()
    if s.own_cluster:
        if not dry_run and kube.own_cluster_stopped(s):
            ui.say("doeks' cluster is not running: nothing on it to delete")
            return
        ui.say("doeks' cluster: no EFA device plugin was deployed; deleting the MPI operator")
        efa.mpi_operator_delete(s, runner(dry_run))
        return
    if s.on_this_machine or s.target == "kubernetes":
        ui.say(f"TARGET={s.target}: no EFA device plugin was deployed; nothing to delete")
        return
    r = runner(dry_run)
    efa.mpi_operator_delete(s, r)
    kube.delete(r, efa.device_plugin(s))


@task
def status(c):
    """Show the device plugin DaemonSet and allocatable EFA per node (doeks' cluster: the MPI operator)."""
    from doeks import efa, eks, kube, ui

    s = settings()
    if s.own_cluster:
        ui.say("doeks' cluster: no EFA devices; the MPI operator:")
        kube.show(runner(), ["deployment", "-n", efa.MPI_OPERATOR_NAMESPACE, efa.MPI_OPERATOR_DEPLOYMENT])
        return
    if s.on_this_machine or s.target == "kubernetes":
        ui.say(f"TARGET={s.target}: no EFA devices")
        return
    kube.show(runner(), ["daemonset", "-n", "kube-system", "aws-efa-k8s-device-plugin-daemonset"])
    ui.table("nodes", ["node", "instance type", "ready", "nvidia.com/gpu", "vpc.amazonaws.com/efa"], eks.node_rows())


@task(help={"nodes": "nodes to test across (default: GPU_NODES, at least 2)",
            "end": "largest message (default 1G; 64M on local; 1M on CPU, e.g. doeks' cluster)",
            "dry_run": "print the MPIJob; change nothing"}, flags={"nodes": Int(1, 1000), "end": Size()})
def test(c, nodes=None, end=None, dry_run=False):
    """nccl-tests all_reduce_perf across nodes, parsed into a table and a chart; fails if NCCL fell back to TCP.

    doeks' own cluster: the same MPIJob on CPU with a stand-in image (an MPI all-reduce over TCP), reported as such."""
    import subprocess
    import sys

    from doeks import efa, kube, plots, ui
    from doeks.errors import DoeksError

    s = settings()
    out_dir = s.state_dir / "efa"
    if s.on_this_machine:
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(s.nproc_per_node),
                "--standalone", str(Path(__file__).resolve().parents[1] / "doeks" / "workload" / "allreduce.py"),
                "-b", "8", "-e", end or "64M", "-f", "2"]
        r = runner(dry_run)
        if dry_run:
            r.run(argv)
            return
        ui.say(f"TARGET=local/docker: all_reduce sweep with {s.nproc_per_node} processes (gloo on CPU, nccl on GPUs)")
        result = subprocess.run(argv, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", **__import__("os").environ})
        if result.returncode != 0:
            raise DoeksError(f"the all-reduce sweep failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "allreduce-local.txt").write_text(result.stdout)
        ui.say(f"log: {out_dir / 'allreduce-local.txt'}")
        _report(result.stdout, plots.plot_path(s, "allreduce-local-busbw.png"),
                f"all_reduce, {s.nproc_per_node} local processes", require_efa=False)
        return
    from doeks import jobspec

    cpu = efa.on_cpu(s)
    if s.target != "kubernetes" and jobspec.idle_gpus_warning(s):  # the test uses every GPU of a node; the job would not
        ui.say(jobspec.idle_gpus_warning(s) + "; efa.test measures all of them", style="yellow")
    job = efa.nccl_mpijob(s, nodes, end=end or efa.default_end(s))
    r = runner(dry_run)
    if s.own_cluster:
        if not dry_run and kube.own_cluster_stopped(s):
            raise DoeksError("doeks' cluster is not running: `TARGET=kubernetes invoke up` starts it")
        ui.say(f"doeks' cluster: {efa.NCCL_TESTS_IMAGE} is doeks' stand-in (no registry, GPU or EFA here): an MPI "
               "all-reduce on CPU over TCP, run by the MPI operator's launcher over ssh to its workers")
        from doeks.cluster import images

        images.nccl_tests_image(r)
        if not dry_run and r.run([kube.kubectl(), "get", "crd", efa.MPIJOB_CRD], mutating=False, check=False,
                                 capture=True).returncode != 0:
            raise DoeksError(f"the MPI operator is not deployed (no {efa.MPIJOB_CRD}): `invoke efa.deploy` deploys it")
    name, namespace = job["metadata"]["name"], s.namespace
    # a finished MPIJob is not run again by an apply: the previous run goes first, with its launcher Job and pods
    # (foreground: the new launcher Job of the same name must not meet the old one)
    kube.run(r, ["delete", "mpijob", name, "-n", namespace, "--ignore-not-found", "--cascade=foreground", "--wait=true",
                 "--timeout=300s"])
    kube.apply(r, [job])
    if dry_run:
        return
    wait_s = 600 if cpu else 1800
    ui.say(f"waiting for MPIJob {name} to succeed or fail (at most {wait_s // 60} min)")
    state, said = efa.wait_for_mpijob(name, namespace, timeout_s=wait_s)
    logs = r.run([kube.kubectl(), "logs", "-n", namespace, "-l", efa.launcher_selector(name), "--tail=-1"],
                 mutating=False, capture=True, check=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.txt").write_text(logs.stdout)
    ui.say(f"log: {out_dir / f'{name}.txt'}")
    if state != "Succeeded":
        tail = "\n".join((logs.stdout.strip() or said).splitlines()[-15:]) or "(none: no launcher ran)"
        raise DoeksError(f"MPIJob {name} {state}: the launcher's last lines:\n{tail}\n(`kubectl describe mpijob {name}`)")
    if cpu:
        _report(logs.stdout, plots.plot_path(s, f"{name}-busbw.png"), f"{name}: MPI all-reduce on CPU over TCP (no EFA)",
                require_efa=False)
        ui.say("this ran on CPU over TCP with no EFA (and no GPU, no NCCL): it shows the MPIJob launcher/worker "
               "contract, not EFA bandwidth; `efa.report --require-efa` on this log fails", style="yellow")
        return
    _report(logs.stdout, plots.plot_path(s, f"{name}-busbw.png"), f"{name}: all_reduce_perf", require_efa=True)


@task(help={"require_efa": "exit 1 unless the log shows NCCL used the EFA provider",
            "out": "the chart: a .png path, or a folder (default: STATE_DIR/plots); named <FILE's stem>-busbw.png"})
def report(c, file, require_efa=False, out=None):
    """Parse a saved nccl-tests log into a table and a bus-bandwidth chart (STATE_DIR/plots/<stem>-busbw.png)."""
    from doeks import plots
    from doeks.errors import DoeksError

    path = Path(file)
    if not path.is_file():
        raise DoeksError(f"{file}: no such file")
    _report(path.read_text(errors="replace"), plots.plot_path(settings(), f"{path.stem}-busbw.png", out), path.name,
            require_efa)


ns = Collection("efa", deploy, delete, status, test, report)
UNIT = Unit("efa", order=30, up=deploy, down=delete)

"""efa: the EFA device plugin and MPI operator, and an NCCL all-reduce test that proves EFA is really used.

On TARGET=local/docker there is no EFA hardware: deploy/delete say so and change nothing, and `efa.test` runs the same
message-size sweep with torch.distributed all_reduce across local processes, reported the same way.
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
    if require_efa and not report.efa:
        raise DoeksError(f"NCCL did not use EFA (transport: {report.transport}; no 'Selected Provider is efa' line): "
                         "check the EFA device plugin, the pod's vpc.amazonaws.com/efa request and the aws-ofi-nccl plugin")
    return report


@task(help={"dry_run": "print the manifests and commands; change nothing"})
def deploy(c, dry_run=False):
    """Deploy the EFA device plugin DaemonSet (EFA instance types only) and the MPI operator (server-side apply)."""
    from doeks import efa, kube, ui

    s = settings()
    if s.on_this_machine:
        ui.say("TARGET=local/docker: no EFA devices here; nothing to deploy (efa.test runs a local all-reduce sweep)")
        return
    if s.target == "kubernetes":
        ui.say("TARGET=kubernetes: EFA is an AWS network adapter; no device plugin to deploy on this cluster")
        return
    r = runner(dry_run)
    # one plugin, one owner: eksctl's efaEnabled installs its own DaemonSet of the same name (v0.3.3, fields such as
    # runAsNonRoot that an apply would keep); doeks replaces it rather than merging into it, and efa.delete removes it
    kube.run(r, efa.replace_eksctl_plugin_argv())
    kube.apply(r, efa.device_plugin(s))
    kube.run(r, ["apply", "--server-side", "-f", efa.MPI_OPERATOR_MANIFEST])


@task(help={"dry_run": "print what would be deleted; change nothing"})
def delete(c, dry_run=False):
    """Delete the MPI operator and the EFA device plugin; safe to run twice."""
    from doeks import efa, kube, ui

    s = settings()
    if s.on_this_machine or s.target == "kubernetes":
        ui.say(f"TARGET={s.target}: no EFA device plugin was deployed; nothing to delete")
        return
    r = runner(dry_run)
    kube.run(r, ["delete", "--ignore-not-found", "-f", efa.MPI_OPERATOR_MANIFEST])
    kube.delete(r, efa.device_plugin(s))


@task
def status(c):
    """Show the device plugin DaemonSet and allocatable EFA per node."""
    from doeks import eks, kube, ui

    s = settings()
    if s.on_this_machine or s.target == "kubernetes":
        ui.say(f"TARGET={s.target}: no EFA devices")
        return
    kube.show(runner(), ["daemonset", "-n", "kube-system", "aws-efa-k8s-device-plugin-daemonset"])
    ui.table("nodes", ["node", "instance type", "ready", "nvidia.com/gpu", "vpc.amazonaws.com/efa"], eks.node_rows())


@task(help={"nodes": "nodes to test across (default: GPU_NODES, at least 2)", "end": "largest message (default 1G; 64M on local)",
            "dry_run": "print the MPIJob; change nothing"}, flags={"nodes": Int(1, 1000), "end": Size()})
def test(c, nodes=None, end=None, dry_run=False):
    """nccl-tests all_reduce_perf across nodes, parsed into a table and a chart; fails if NCCL fell back to TCP."""
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

    if jobspec.idle_gpus_warning(s):  # the test uses every GPU of a node; the training job would not
        ui.say(jobspec.idle_gpus_warning(s) + "; efa.test measures all of them", style="yellow")
    job = efa.nccl_mpijob(s, nodes, end=end or "1G")
    r = runner(dry_run)
    kube.apply(r, [job])
    if dry_run:
        return
    name, namespace = job["metadata"]["name"], s.namespace
    selector = f"training.kubeflow.org/job-name={name},training.kubeflow.org/job-role=launcher"
    r.run([kube.kubectl(), "wait", "-n", namespace, "--for=condition=Succeeded", f"mpijob/{name}", "--timeout=30m"], mutating=False)
    logs = r.run([kube.kubectl(), "logs", "-n", namespace, "-l", selector, "--tail=-1"], mutating=False, capture=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.txt").write_text(logs.stdout)
    ui.say(f"log: {out_dir / f'{name}.txt'}")
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

"""elasticjob: the elastic, fault-tolerant PyTorch training job (etcd or c10d rendezvous, min:max nodes, checkpoints).

On TARGET=local it runs here as torchrun processes; on TARGET=eks the same PyTorchJob is applied to the cluster.
"""
from invoke import Collection

from doeks.taskkit import Unit, runner, settings, task

_JOB_FLAGS = {
    "replicas": "nodes to start with (REPLICAS)",
    "min_replicas": "fewest nodes (MIN_REPLICAS)",
    "max_replicas": "most nodes (MAX_REPLICAS)",
    "nproc_per_node": "processes per node (NPROC_PER_NODE)",
    "arch": "torchvision model (ARCH)",
    "epochs": "epochs (EPOCHS)",
    "rdzv_backend": "etcd or c10d (RDZV_BACKEND)",
    "dry_run": "print the manifests (stdout) and local commands (stderr); change nothing",
}


def _job_settings(**flags):
    return settings(**{k: v for k, v in flags.items() if k != "dry_run"})


@task(help={"dry_run": "print what would be generated"})
def data(c, dry_run=False):
    """Generate the small synthetic ImageNet-layout data set (JPEGs) in the shared volume."""
    from doeks import elastic

    s = settings()
    if s.target != "local":
        from doeks.errors import DoeksError

        raise DoeksError("elasticjob.data writes the local volume; on eks stage data with `invoke csi.data.stage`")
    elastic.make_data(s, runner(dry_run))


@task(help={**_JOB_FLAGS, "follow": "stream all nodes' logs with a progress bar until the job ends",
            "fresh": "remove this job's old checkpoints and metrics first (else it resumes)",
            "train_args": "extra arguments for the training script, e.g. '--log-every 1'"})
def deploy(c, replicas=None, min_replicas=None, max_replicas=None, nproc_per_node=None, arch=None, epochs=None,
           rdzv_backend=None, follow=False, fresh=False, train_args="", dry_run=False):
    """Launch the elastic job (etcd + PyTorchJob); returns at once unless --follow."""
    from doeks import elastic, jobspec, ui

    s = _job_settings(replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas,
                      nproc_per_node=nproc_per_node, arch=arch, epochs=epochs, rdzv_backend=rdzv_backend)
    import shlex

    r = runner(dry_run)
    manifests = jobspec.manifests(s, shlex.split(train_args or ""))
    if s.target == "local":
        r.emit(manifests)
        elastic.deploy_local(s, r, fresh=fresh, job=manifests[-1])
        if dry_run:
            return
        ui.say(f"job {s.job_name} started: {s.replicas} nodes x {s.nproc_per_node} processes, rendezvous {s.rdzv_backend}")
        if follow:
            _finish(s, elastic.follow(s))
    else:
        from doeks import kube

        kube.apply(r, manifests)
        if follow and not dry_run:
            kube.follow_logs(r, s.namespace, f"doeks/job={s.job_name}")


def _finish(s, status):
    from doeks import elastic, ui
    from doeks.errors import DoeksError

    if status.get("state") != "Succeeded":
        raise DoeksError(f"job {s.job_name} ended {status.get('state')}: see `invoke elasticjob.logs`")
    result = elastic.final_result(s) or {}
    ui.say(f"job {s.job_name} succeeded: final validation accuracy {result.get('val_accuracy', float('nan')):.3f} "
           f"after {result.get('step', '?')} steps", style="green")
    return result


@task
def status(c):
    """Show the job's replicas: state, restarts, step, samples/s."""
    from doeks import elastic, ui

    s = settings()
    if s.target != "local":
        from doeks import kube

        kube.show(runner(), ["pytorchjob", s.job_name, "-n", s.namespace, "-o", "wide"])
        return
    from doeks.local import jobs

    st = jobs.read_status(elastic.home(s))
    if not st:
        ui.say(f"job {s.job_name}: not deployed")
        return
    ui.table(f"job {s.job_name}: {st['state']} ({st['desired']} nodes wanted, {st['min']}:{st['max']}, {st['restarts']} restarts)",
             ["replica", "state", "restarts", "pid", "step", "samples/s", "world"], elastic.status_rows(s))


@task(help={"follow": "keep streaming until the job ends", "replica": "only this node"})
def logs(c, follow=False, replica=None):
    """Print the nodes' logs with node prefixes (--follow to stream)."""
    from doeks import elastic

    s = settings()
    if s.target != "local":
        from doeks import kube

        kube.follow_logs(runner(), s.namespace, f"doeks/job={s.job_name}", follow=follow)
        return
    if follow:
        elastic.follow(s)
        return
    import sys

    for log in sorted(elastic.home(s).glob("replicas/*/agent.log")):
        if replica is not None and log.parent.name != str(replica):
            continue
        for line in log.read_text(errors="replace").splitlines():
            sys.stdout.write(f"[node-{log.parent.name}] {line}\n")


@task(help={"replicas": "new number of nodes, within MIN_REPLICAS:MAX_REPLICAS", "dry_run": "print, change nothing"})
def scale(c, replicas, dry_run=False):
    """Grow or shrink the running job; training goes on through a re-rendezvous."""
    from doeks import elastic

    s = settings()
    replicas = int(replicas)
    if s.target == "local":
        elastic.scale_local(s, runner(dry_run), replicas)
    else:
        from doeks import kube

        kube.patch_replicas(runner(dry_run), s, replicas)


@task(help={"dry_run": "print what would be stopped"})
def delete(c, dry_run=False):
    """Stop the job and everything it started (checkpoints are kept); safe to run twice."""
    from doeks import elastic, jobspec

    s = settings()
    r = runner(dry_run)
    if s.target == "local":
        elastic.delete_local(s, r)
    else:
        from doeks import kube

        kube.delete(r, list(reversed(jobspec.manifests(s))))


@task(help={"out": "PNG path (default: the job's metrics folder)"})
def plot(c, out=None):
    """Draw loss, accuracy and throughput of the job as a PNG."""
    from pathlib import Path

    from doeks import elastic, plots, ui

    s = settings()
    target = Path(out) if out else elastic.metrics_dir(s) / "training.png"
    plots.training(elastic.metrics_dir(s) / "metrics.csv", target, title=f"{s.job_name} ({s.arch})")
    ui.say(f"plot: {target}")


@task(help={"replicas": "comma-separated node counts to try, e.g. 1,2", "out": "PNG path", "dry_run": "print the runs"})
def scaling(c, replicas="1,2", out=None, dry_run=False):
    """Run one epoch at each size and plot epoch time against ideal linear scaling."""
    from pathlib import Path

    from doeks import elastic, plots, ui
    from doeks.errors import DoeksError

    try:
        sizes = [int(x) for x in str(replicas).split(",") if x.strip()]
    except ValueError:
        raise DoeksError(f"--replicas {replicas!r}: expected comma-separated integers such as 1,2") from None
    base = settings()
    points = []
    for size in sizes:
        s = base.with_overrides(replicas=size, min_replicas=size, max_replicas=size, epochs=1,
                                job_name=f"{base.job_name}-scale{size}")
        elastic.deploy_local(s, runner(dry_run), fresh=True)
        if dry_run:
            continue
        _finish(s, elastic.follow(s, quiet=True))
        seconds = elastic.epoch_seconds(elastic.metrics_dir(s) / "metrics.csv")
        points.append((size * s.nproc_per_node, seconds))
        ui.say(f"{size} nodes x {s.nproc_per_node} processes: epoch {seconds:.1f}s")
    if points:
        target = Path(out) if out else elastic.metrics_dir(base) / "scaling.png"
        plots.scaling(points, target)
        ui.table("scaling", ["processes", "epoch s", "ideal s"],
                 [[n, f"{t:.1f}", f"{points[0][1] * points[0][0] / n:.1f}"] for n, t in points])
        ui.say(f"plot: {target}")


@task(help={"port": "port to serve on"})
def tensorboard(c, port=6006):
    """Serve the job's TensorBoard event files (Ctrl-C to stop)."""
    import shutil
    import subprocess

    from doeks import elastic
    from doeks.errors import MissingTool

    s = settings()
    if shutil.which("tensorboard") is None:
        raise MissingTool("tensorboard is not installed: pip install -e '.[train]'")
    subprocess.run(["tensorboard", "--logdir", str(elastic.metrics_dir(s) / "tensorboard"), "--port", str(port),
                    "--host", "127.0.0.1"], check=False)


def _up(c, dry_run=False):
    """`invoke up`'s step: on local, make the synthetic data first when the volume has none; then deploy."""
    from doeks import elastic
    from doeks.errors import DoeksError

    s = settings()
    if s.target == "local":
        try:
            elastic.check_data(s)
        except DoeksError:
            data(c, dry_run=dry_run)
    deploy(c, dry_run=dry_run)


ns = Collection("elasticjob", data, deploy, status, logs, scale, delete, plot, scaling, tensorboard)
UNIT = Unit("elasticjob", order=60, up=_up, down=delete)

"""elasticjob: the elastic, fault-tolerant PyTorch training job (etcd or c10d rendezvous, min:max nodes, checkpoints).

Every task goes through the job's target (`doeks.targets`, chosen by TARGET): local processes, docker containers of
the training image, the EKS cluster, or SageMaker. A verb a target cannot do says so in one line.
"""
from invoke import Collection

from doeks.taskkit import Int, Unit, runner, settings, task

JOB_NAME_HELP = ("the job's name (JOB_NAME; default from the code: imagenet for the built-in workload, else the "
                 "script's name)")
_JOB_FLAGS = {
    "job_name": JOB_NAME_HELP,
    "replicas": "nodes to start with (REPLICAS)",
    "min_replicas": "fewest nodes (MIN_REPLICAS)",
    "max_replicas": "most nodes (MAX_REPLICAS)",
    "nproc_per_node": "processes per node (NPROC_PER_NODE)",
    "arch": "torchvision model (ARCH)",
    "epochs": "epochs (EPOCHS)",
    "rdzv_backend": "etcd or c10d (RDZV_BACKEND)",
    "train_script": "your training script, a .py file or '-m module' (TRAIN_SCRIPT; empty = the built-in ImageNet job)",
    "train_source": "the folder of your code (TRAIN_SOURCE; default the script's folder)",
    "train_requirements": "a pip requirements file for the training image (TRAIN_REQUIREMENTS)",
    "train_image": "a prebuilt training image (TRAIN_IMAGE)",
    "dry_run": "print the plan: manifests and requests (stdout), commands and steps (stderr); change nothing",
}


def _job_settings(**flags):
    return settings(**{k: v for k, v in flags.items() if k != "dry_run"})


def _target(s=None, job_name=None):
    from doeks import targets

    return targets.get(s or _chosen(job_name))


def _chosen(job_name=None):
    """The settings of the job a task acts on (doeks.lastjob): the one --job-name, JOB_NAME or TRAIN_SCRIPT names,
    else the one last deployed from here to TARGET (said in one line)."""
    from doeks import lastjob, ui

    return lastjob.choose(settings(job_name=job_name), ui.say)


_NAME = {"job_name": JOB_NAME_HELP}


@task(help={"dry_run": "print what would be generated"})
def data(c, dry_run=False):
    """Generate the small synthetic ImageNet-layout data set (JPEGs) in the shared volume on this machine."""
    from doeks import elastic
    from doeks.targets import NotSupported

    s = settings()
    if not _target(s).on_this_machine:
        raise NotSupported(s.target, "elasticjob.data", "it writes this machine's volume; stage data with `invoke csi.data.stage`")
    elastic.make_data(s, runner(dry_run))


_CODE_FLAGS = {k: _JOB_FLAGS[k] for k in ("train_script", "train_source", "train_requirements")}


@task(help={"dry_run": "print the docker build; change nothing", **_CODE_FLAGS})
def build(c, train_script=None, train_source=None, train_requirements=None, dry_run=False):
    """Build the training image: the job's code (TRAIN_SOURCE, or doeks/workload) and requirements, content-tagged.

    The code goes to /workspace on TRAIN_BASE_IMAGE (elasticjob/Dockerfile)."""
    from doeks import trainimage, ui

    s = settings(train_script=train_script, train_source=train_source, train_requirements=train_requirements)
    ref = trainimage.build(s, runner(dry_run), on_this_machine=_target(s).on_this_machine)
    ui.say(f"training image: {ref}")


@task(help={"dry_run": "print the ECR requests and the push; change nothing"})
def push(c, dry_run=False):
    """Push the training image to REGISTRY or this account's ECR (repository created if missing)."""
    from doeks import trainimage, ui

    s = settings()
    target = _target(s)
    if target.on_this_machine:
        ref = trainimage.push(s, runner(dry_run), on_this_machine=True)
    else:  # where the cluster pulls from, the target's way (the EKS rehearsal's registry is on this machine)
        ref = target.image_push(runner(dry_run), build=False)
    ui.say(f"training image: {ref}")


@task(help={**_JOB_FLAGS, "follow": "stream all nodes' logs with a progress bar until the job ends",
            "fresh": "remove this job's old checkpoints and metrics first (else it resumes)",
            "train_args": "more arguments for the training script, after TRAIN_ARGS, e.g. '--log-every 1'"})
def deploy(c, job_name=None, replicas=None, min_replicas=None, max_replicas=None, nproc_per_node=None, arch=None,
           epochs=None, rdzv_backend=None, train_script=None, train_source=None, train_requirements=None,
           train_image=None, follow=False, fresh=False, train_args="", dry_run=False):
    """Launch the elastic job on TARGET; returns at once unless --follow."""
    import shlex

    from doeks import lastjob, targets, ui
    from doeks.errors import DoeksError
    from doeks.targets import runs

    s = _job_settings(job_name=job_name, replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas,
                      nproc_per_node=nproc_per_node, arch=arch, epochs=epochs, rdzv_backend=rdzv_backend,
                      train_script=train_script, train_source=train_source, train_requirements=train_requirements,
                      train_image=train_image)
    target = targets.get(s)
    r = runner(dry_run)
    try:
        args = shlex.split(train_args or "")
    except ValueError as error:
        raise DoeksError(f"--train-args {train_args!r}: {error}") from None
    job = target.job(args, fresh, dry_run)  # the job as one value: its code, image and world resolved once, here
    runs.refuse_other_code(s, job.code, fresh)  # another script under this name would read its state
    plan = target.plan(job)  # refuses arguments the training script would refuse
    if dry_run:
        plan.show(r)
        return
    target.refuse(plan)  # a refusal (running already, no image, no data) is the first thing said, before any plan
    if plan.shown_manifests:
        r.emit(plan.shown_manifests)  # a run shows what it applies, as the dry run does (local, docker: their steps)
    if target.on_this_machine:
        runs.settle_quietly(target)  # how the previous run ended, before this one replaces it
    target.submit(plan, r)  # records the run (elasticjob.history)
    lastjob.remember(s)  # the job tasks act on this one until another is deployed here
    ui.say(f"job {s.job_name} submitted to TARGET={s.target} (run {target.run_name(plan)}, {plan.world.line()})"
           + ("" if follow else ": `invoke elasticjob.status` follows it"))
    if follow:
        import time

        started = time.monotonic()
        with _still_running_on_interrupt(s, target):
            status = target.wait()
        _finish(s, status, started, job)


class _still_running_on_interrupt:
    """Ctrl-C while following stops the following, not the job: say what still runs and how to follow or stop it."""

    def __init__(self, s, target):
        self.s, self.target = s, target

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        if kind is not KeyboardInterrupt:
            return False
        from invoke import Exit

        s = self.s
        try:
            state = self.target.describe().state
        except Exception:  # noqa: BLE001 - out of reach: say what we know
            state = "unknown"
        if state in ("Succeeded", "Failed", "Stopped"):
            raise Exit(f"interrupted: job {s.job_name} on TARGET={s.target} has ended ({state}): "
                       "`invoke elasticjob.status` shows how", code=130) from None
        raise Exit(f"interrupted: job {s.job_name} is still running on TARGET={s.target} ({state}); follow it with "
                   "`invoke elasticjob.logs --follow`, stop it with `invoke elasticjob.delete`", code=130) from None


def _finish(s, status, started=None, job=None):
    """The end of a followed job in one line: the error (the reason and its fix), or the result, the steps, the time
    it took and where the model is."""
    import time

    from doeks import ui
    from doeks.code import resolve
    from doeks.errors import DoeksError
    from doeks.targets import runs, show

    runs.settle(s, status)
    took = f" in {_duration(time.monotonic() - started)}" if started is not None else ""
    if status.state != "Succeeded":
        if status.reason:
            fix = f" (fix: {show.fix_of(_target(s), status)})" if status.fix else ""
            raise DoeksError(f"job {s.job_name} ended {status.state} after {status.restarts} restarts: {status.reason}{fix}")
        raise DoeksError(f"job {s.job_name} ended {status.state}: see `invoke elasticjob.logs --tail 50`")
    model = _model(s)
    lagging = [r.name for r in status.replicas if r.state == "Running"]
    if lagging:  # follow.wait_with_progress gave them LEAVING seconds: what is left runs (and bills) until stopped
        from doeks.targets.follow import LEAVING

        ui.warn(f"job {s.job_name} succeeded, but {', '.join(lagging)} still ran {LEAVING} s after: "
                "`invoke elasticjob.delete` stops what is left of it")
    if not (job.code if job is not None else resolve(s)).builtin:  # a user's script: what it reported, nothing made up
        steps = [r.step for r in status.replicas if r.step is not None]
        ui.say(f"job {s.job_name} succeeded: " + (f"{max(steps)} steps" if steps else "no step count (the script "
               "reports none: docs/your-own-script.md)") + f"{took}; {model}", style="green")
        return {"step": max(steps)} if steps else {}
    result = _final_result(s)
    ui.say(f"job {s.job_name} succeeded: final validation accuracy {result.get('val_accuracy', float('nan')):.3f} "
           f"after {result.get('step', '?')} steps{took}; {model}", style="green")
    return result


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def _model(s) -> str:
    """Where the job's model is: the file in its model folder (DOEKS_MODEL_DIR / SM_MODEL_DIR) when it wrote one."""
    from pathlib import Path

    try:
        where = _target(s).artifacts().get("model", "")
    except Exception:  # noqa: BLE001 - out of reach: the summary goes without it
        return "model: see `invoke elasticjob.artifacts`"
    if not where or "://" in where:
        return f"model: {where}" if where else "model: see `invoke elasticjob.artifacts`"
    folder = Path(where)
    files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else ([folder] if folder.is_file() else [])
    if not files:
        return f"no model written in {folder}"
    return f"model: {files[0] if len(files) == 1 else folder}"


def _final_result(s) -> dict:
    import json
    from pathlib import Path

    path = _target(s).artifacts().get("final", "")
    try:
        return json.loads(Path(path).read_text()) if path and "://" not in path else {}
    except (OSError, ValueError):
        return {}


@task(help=_NAME)
def status(c, job_name=None):
    """Show the job's replicas (state, restarts, step, samples/s) and why it is not training, with the fix."""
    from doeks.targets import show

    show.status(_target(job_name=job_name))


@task(help=_NAME)
def describe(c, job_name=None):
    """The job's status, its events (starts, restarts, exits; Kubernetes events on eks), the reason and the fix."""
    from doeks import ui
    from doeks.targets import show

    target = _target(job_name=job_name)
    st = show.status(target)
    events = target.events()
    ui.say(f"events ({len(events)}):" if events else "events: none recorded")
    for line in events[-40:]:
        ui.say(f"  {line}")
    if not st.reason:
        ui.say("reason: none (nothing wrong seen)" if st.state != "Failed" else "reason: unknown (see `invoke elasticjob.logs --tail 50`)")


@task(help={"follow": "keep streaming until the job ends", "replica": "only this node (its index)",
            "run": "an earlier run's logs (ids: `invoke elasticjob.history`); default: the current run",
            "tail": "only the last N lines of each node (then new ones with --follow)",
            "since": "only lines from this long ago on: 30s, 5m, 2h, 1d",
            "errors": "only the tracebacks: each distinct exception once (the script's first), with where it was seen",
            **_NAME})
def logs(c, follow=False, replica=None, run=None, tail=None, since=None, errors=False, job_name=None):
    """Print the current run's logs with node prefixes (--follow to stream, --errors for the tracebacks alone)."""
    import sys

    from doeks.errors import DoeksError
    from doeks.targets.follow import parse_since
    from doeks.taskkit import int_flag

    replica = int_flag("replica", replica, 0, 999)
    tail = int_flag("tail", tail, 0, 10_000_000)
    since = parse_since(since) if since is not None else None
    s = _chosen(job_name)
    target = _target(s)
    if errors:
        if follow or tail is not None:
            raise DoeksError("--errors reads the whole run's logs once: leave out --follow and --tail")
        _errors(s, target, list(target.logs(replica=replica, run=run or None, since=since)), run)
        return
    with _still_running_on_interrupt(s, target):
        for line in target.logs(follow=follow, replica=replica, run=run or None, tail=tail, since=since):
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
    if follow:
        _result_line(s, target)


def _result_line(s, target):
    """The end of a followed run in one line on stderr: its state, steps, how long it ran, where the model is (or
    why it failed, and the fix)."""
    from doeks import ui
    from doeks.targets import runs, show

    status = target.describe()
    if not status.finished:
        return
    record = runs.settle(s, status) or {}
    took = f" in {_duration(record['end'] - record['start'])}" if record.get("end") and record.get("start") else ""
    steps = [r.step for r in status.replicas if r.step is not None]
    counted = f"{max(steps)} steps" if steps else "no step count"
    if status.state == "Succeeded":
        ui.say(f"job {s.job_name} Succeeded: {counted}{took}; {_model(s)}", style="green")
        return
    why = f": {status.reason}" + (f" (fix: {show.fix_of(target, status)})" if status.fix else "") if status.reason else ""
    ui.say(f"job {s.job_name} {status.state} after {status.restarts} restarts: {counted}{took}{why}", style="red")


def _errors(s, target, lines, run):
    """The tracebacks of a run's logs, each distinct exception once: those through the job's own code first."""
    import sys

    from doeks import ui
    from doeks.pod import reasons

    blocks = reasons.error_blocks(lines)
    if not blocks:
        ui.say(f"job {s.job_name}: no traceback in the logs of run {run or target.describe().run or '-'} "
               f"({len(lines)} lines; `invoke elasticjob.logs --tail 50` shows their end)")
        return
    blocks.sort(key=lambda block: block[0].frame is None)  # the script's own first, then torch's and the rest
    for raised, count, streams in blocks:
        sys.stdout.write("\n".join(raised.lines) + "\n")
        ui.say(f"  {raised.kind}: seen {count} time{'s' if count > 1 else ''}, from {', '.join(streams) or 'the log'}"
               + (f"; in the job's code at {raised.where()}" if raised.frame else ""))
    sys.stdout.flush()


@task(help=_NAME)
def history(c, job_name=None):
    """Every run of the job deployed from here: id, target, start, end, result and why."""
    from doeks import ui
    from doeks.targets import runs

    s = _chosen(job_name)
    runs.settle_quietly(_target(s))  # the current run's end, if it has ended (a target out of reach: as recorded)
    rows = runs.rows(s)
    if not rows:
        ui.say(f"job {s.job_name}: no runs recorded in {runs.index_path(s)} (`invoke elasticjob.deploy` starts one)")
        return
    ui.table(f"job {s.job_name}: {len(rows)} runs ({runs.index_path(s)})", runs.COLUMNS, rows)
    for line in runs.note_lines(s):  # what each run went through: the hang watchdog's steps, a lost node
        ui.say(line)


@task(help={"replicas": "new number of nodes, within MIN_REPLICAS:MAX_REPLICAS", "dry_run": "print, change nothing",
            **_NAME})
def scale(c, replicas, dry_run=False, job_name=None):
    """Grow or shrink the running job; training goes on through a re-rendezvous."""
    from doeks.taskkit import int_flag

    _target(job_name=job_name).scale(int_flag("replicas", replicas), runner(dry_run))


@task(help={"dry_run": "print what would be stopped", **_NAME})
def delete(c, dry_run=False, job_name=None):
    """Stop the job and everything it started (checkpoints are kept); safe to run twice."""
    _delete(_target(job_name=job_name), dry_run)


def _delete(target, dry_run):
    from doeks.targets import runs

    target.cancel(runner(dry_run))
    if not dry_run and target.on_this_machine:
        runs.settle_quietly(target)


@task(help=_NAME)
def artifacts(c, job_name=None):
    """Where the job's metrics, checkpoints and model are, on its target."""
    from doeks import ui

    s = _chosen(job_name)
    ui.table(f"job {s.job_name} artifacts on {s.target}", ["what", "where"], [[k, v] for k, v in _target(s).artifacts().items()])


def _local_metrics(s):
    """The job's metrics folder when it is on this machine; one line naming where it is otherwise."""
    return _target(s).local_artifact("metrics", "reading metrics here", "they are in {where}; copy them here first")


@task(help={"out": "PNG path or folder (default: STATE_DIR/plots/JOB_NAME-training.png, which `deploy --fresh` keeps)",
            **_NAME})
def plot(c, out=None, job_name=None):
    """Draw loss, accuracy and throughput of the job as a PNG."""
    from doeks import plots, ui

    s = _chosen(job_name)
    folder = _local_metrics(s)
    target = plots.plot_path(s, f"{s.job_name}-training.png", out)
    plots.training(folder / "metrics.csv", target, title=f"{s.job_name} ({s.arch})")
    ui.say(f"plot: {target}")


@task(help={"replicas": "comma-separated node counts to try, e.g. 1,2",
            "out": "PNG path or folder (default: STATE_DIR/plots/JOB_NAME-scaling.png)", "dry_run": "print the runs",
            **_NAME})
def scaling(c, replicas="1,2", out=None, dry_run=False, job_name=None):
    """Run one epoch at each size on TARGET and plot epoch time against ideal linear scaling."""
    from doeks import elastic, plots, targets, ui
    from doeks.errors import DoeksError

    try:
        sizes = [int(x) for x in str(replicas).split(",") if x.strip()]
    except ValueError:
        raise DoeksError(f"--replicas {replicas!r}: expected comma-separated integers such as 1,2") from None
    base = settings(job_name=job_name)
    _local_metrics(base)
    target_png = plots.plot_path(base, f"{base.job_name}-scaling.png", out)  # a bad --out before any run
    points = []
    for size in sizes:
        s = base.with_overrides(replicas=size, min_replicas=size, max_replicas=size, epochs=1,
                                job_name=f"{base.job_name}-scale{size}")
        target = targets.get(s)
        job = target.job(fresh=True, dry_run=dry_run)
        plan = target.plan(job)
        if dry_run:
            plan.show(runner(True))
            continue
        target.submit(plan, runner())
        _finish(s, target.wait(quiet=True), job=job)
        seconds = elastic.epoch_seconds(_local_metrics(s) / "metrics.csv")
        points.append((size * s.nproc_per_node, seconds))
        ui.say(f"{size} nodes x {s.nproc_per_node} processes: epoch {seconds:.1f}s")
    if points:
        plots.scaling(points, target_png)
        ui.table("scaling", ["processes", "epoch s", "ideal s"],
                 [[n, f"{t:.1f}", f"{points[0][1] * points[0][0] / n:.1f}"] for n, t in points])
        ui.say(f"plot: {target_png}")


@task(help={"port": "port to serve on", **_NAME}, flags={"port": Int(1, 65535)})
def tensorboard(c, port=6006, job_name=None):
    """Serve the job's TensorBoard event files (Ctrl-C to stop)."""
    import shutil
    import subprocess

    from doeks.errors import MissingTool

    s = _chosen(job_name)
    folder = _local_metrics(s)
    if shutil.which("tensorboard") is None:
        raise MissingTool("tensorboard is not installed: pip install -e '.[train]'")
    from doeks import ui

    ui.say(f"tensorboard: {folder / 'tensorboard'} on http://127.0.0.1:{port}")
    subprocess.run(["tensorboard", "--logdir", str(folder / "tensorboard"), "--port", str(port),
                    "--host", "127.0.0.1"], check=False)


def _up(c, dry_run=False):
    """`invoke up`'s step: what the job needs, then deploy. On this machine: the synthetic data when the volume has
    none. On a cluster: the training image built and pushed (unless TRAIN_IMAGE names one) and the data staged from
    s3://S3_BUCKET/DATA_S3_PREFIX into SHARED_PVC (the staging Job, waited for); a missing piece is one line."""
    from doeks import elastic
    from doeks.errors import DoeksError

    s = settings()
    target = _target(s)

    def have_data():
        try:
            elastic.check_data(s)
        except DoeksError:
            data(c, dry_run=dry_run)

    target.job_needs(lambda: build(c, dry_run=dry_run), have_data, lambda: _cluster_needs(target, s, dry_run))
    if not dry_run and _still_running(target):
        return
    deploy(c, dry_run=dry_run)


def _still_running(target) -> bool:
    """`up` again while the job trains leaves it training (up is safe to repeat); a finished job is deployed again
    (it resumes from its checkpoint, or says at once that it has finished)."""
    from doeks import ui
    from doeks.targets.base import PENDING, RESTARTING, RUNNING

    st = target.describe()
    if st.state not in (PENDING, RUNNING, RESTARTING):
        return False
    ui.say(f"job {st.name} is already on TARGET={target.settings.target} ({st.state}): left as it is "
           "(`invoke elasticjob.status` to watch it, `invoke elasticjob.deploy --fresh` to start it over)")
    return True


def _cluster_needs(target, s, dry_run):
    """On a cluster: the training image built and pushed (unless TRAIN_IMAGE names one), then the data staged from
    S3 into the claim by the target's staging Job, waited for (the job must not start on an empty volume)."""
    from doeks import elastic, kube
    from doeks.errors import DoeksError

    if not s.train_image:
        from doeks import trainimage, ui

        try:
            ui.say(f"training image: {target.image_push(runner(dry_run))}")
        except DoeksError as error:
            raise DoeksError(f"the training image: {error} (`invoke elasticjob.build elasticjob.push`, or set TRAIN_IMAGE "
                             "to an image the nodes can pull)") from None
    from doeks import datastage

    source = elastic.cluster_data_source(s, runner(dry_run))
    if source is None:  # a user's own script, and nothing under the prefix: no data to stage
        from doeks import ui

        ui.say(f"no data under s3://{s.s3_bucket}/{s.data_s3_prefix.strip('/')}/: nothing staged (your script's "
               f"DOEKS_DATA_DIR is {s.shared_mount}/data, as it is on the claim)")
        return
    datastage.split_s3(source)
    target.stage_data(runner(dry_run), source, False)
    name = f"{s.job_name}-stage"
    if dry_run:  # the plan shows the wait; a real run waits (the job must not start on an empty volume)
        runner(dry_run).step(f"wait for Job {s.namespace}/{name} to complete (at most {STAGE_TIMEOUT // 3600} h; the "
                             f"stager's first failure, or its pod unplaced for {kube.UNSCHEDULABLE_S // 60} min, ends the wait with "
                             "its reason), then delete it and its pod (a finished pod keeps the claim)", lambda: None)
        return
    kube.wait_job(s.namespace, name, f"staging {source} into {s.shared_pvc}", timeout=STAGE_TIMEOUT)
    kube.delete(runner(), [{"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": s.namespace}}])


STAGE_TIMEOUT = 6 * 3600  # ImageNet (150 GB) from S3 into FSx takes hours; a failing stager ends the wait at once


@task(name="delete", help={"dry_run": "print what would be stopped and removed"})
def _down(c, dry_run=False):
    """Stop the job (as elasticjob.delete; its checkpoints and model are kept) and remove the AWS identity deploys gave
    the training pods (TARGET=eks: role, Pod Identity association, service account)."""
    target = _target()  # the job last deployed from here, as elasticjob.delete
    _delete(target, dry_run)
    target.job_identity_delete(runner(dry_run))


ns = Collection("elasticjob", data, build, push, deploy, status, describe, logs, history, scale, delete, artifacts, plot,
                scaling, tensorboard)
UNIT = Unit("elasticjob", order=60, up=_up, down=_down)

"""The elastic job's operations on each target; `elasticjob/tasks.py` and `invoke demo` are thin layers over these.

local: the PyTorchJob is interpreted by `doeks.local.jobs` (torchrun agents, local etcd, a folder as the volume).
eks:   the same manifests are applied with kubectl (server-side apply); the training operator runs them.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from . import jobspec, ui
from .errors import DoeksError
from .local import jobs as local_jobs
from .local import runtime
from .local.services import etcd, free_port


def home(settings) -> Path:
    return local_jobs.job_home(settings.state_dir, settings.job_name)


def data_root(settings) -> Path:
    return runtime.shared_volume(settings) / "data"


def metrics_dir(settings) -> Path:
    return runtime.shared_volume(settings) / "metrics" / settings.job_name


def checkpoint_dir(settings) -> Path:
    return runtime.shared_volume(settings) / "checkpoints" / settings.job_name


def make_data(settings, runner) -> dict | None:
    """Generate the ImageNet-shaped set in the download's layout, then re-lay out val/ as `csi.data.stage
    --relayout-val` does for the real download (flat val/ + LOC_val_solution.csv -> val/<wnid>/)."""
    from .datastage import relayout_val
    from .workload import data

    root = data_root(settings)
    kwargs = dict(classes=settings.data_classes, train_per_class=settings.data_train_per_class,
                  val_per_class=settings.data_val_per_class, size=settings.data_image_size)
    if runner.dry_run:
        runner.step(f"generate synthetic data {kwargs} into {root} (ImageNet download layout), re-lay out val/", lambda: None)
        return None
    total = settings.data_classes * (settings.data_train_per_class + settings.data_val_per_class)
    with ui.progress(transient=True) as bar:
        task_id = bar.add_task("generating JPEGs", total=total)
        result = data.generate(root, progress=lambda done, _: bar.update(task_id, completed=done), **kwargs)
    moved = relayout_val(root)
    runner.note(f"data set at {root}: {result['created']} images written ({total} in all), {moved} val images re-laid out")
    return result


def check_data(settings) -> None:
    root = data_root(settings)
    for split in ("train", "val"):
        folder = root / split
        classes = [d for d in folder.iterdir() if d.is_dir()] if folder.is_dir() else []
        if not classes or not any(any(c.iterdir()) for c in classes):
            raise DoeksError(f"data folder {folder} is missing or empty: run `invoke elasticjob.data` first")


def deploy_local(settings, runner, extra_args: list[str] | None = None, fresh: bool = False,
                 job: dict[str, Any] | None = None) -> dict[str, Any]:
    """Start the job on this machine and return at once; raises before starting anything when input is bad."""
    job = job or jobspec.pytorchjob(settings, extra_args)
    job_home = home(settings)
    if not runner.dry_run:
        if local_jobs.is_active(job_home):
            raise DoeksError(f"job {settings.job_name} is already running: `invoke elasticjob.status`, or `invoke elasticjob.delete` first")
        check_data(settings)
    started_etcd = False
    endpoint = None
    try:
        if settings.rdzv_backend.startswith("etcd"):
            started_etcd = not settings.etcd_endpoint and etcd(settings.state_dir).info() is None
            endpoint = runtime.etcd_endpoint(settings, runner)
        else:
            endpoint = f"127.0.0.1:{free_port()}"
        argv, env = local_jobs.replica_command(job, runtime.volumes_dir(settings), endpoint, settings.local_preload)
        for replica in range(settings.replicas):
            shown = " ".join(f"{k}={v}" for k, v in sorted(env.items())) + f" DOEKS_REPLICA={replica}"
            runner.step(f"start node {replica}: {shown} {' '.join(argv)}", lambda: None)
        if fresh:
            runner.step(f"remove checkpoints and metrics of {settings.job_name}", _clear_outputs, settings)
        runner.step(f"launch job supervisor for {settings.job_name} ({settings.replicas} nodes x {settings.nproc_per_node} processes)",
                    local_jobs.launch, job_home, job, runtime.volumes_dir(settings), endpoint, settings.local_preload)
    except BaseException:
        if started_etcd and not runner.dry_run:
            etcd(settings.state_dir).stop()
        raise
    return job


def _clear_outputs(settings) -> None:
    import shutil

    for folder in (checkpoint_dir(settings), metrics_dir(settings)):
        shutil.rmtree(folder, ignore_errors=True)


def follow(settings, timeout: float | None = None, quiet: bool = False) -> dict[str, Any]:
    """Stream every replica's log with a `node-i` prefix and show progress until the job ends; returns the status."""
    job_home = home(settings)
    offsets: dict[Path, int] = {}
    total = _expected_steps(settings)
    deadline = time.monotonic() + timeout if timeout else None
    status: dict[str, Any] | None = None
    with ui.progress() as bar:
        task_id = bar.add_task(f"{settings.job_name}: steps", total=total)
        while True:
            for log in sorted(job_home.glob("replicas/*/agent.log")):
                node = log.parent.name
                with open(log, "rb") as f:
                    f.seek(offsets.get(log, 0))
                    chunk = f.read()
                    complete = chunk.rfind(b"\n") + 1
                    offsets[log] = offsets.get(log, 0) + complete
                if not quiet:
                    for line in chunk[:complete].decode(errors="replace").splitlines():
                        bar.console.print(f"[node-{node}] {line}", markup=False, highlight=False)
            status = local_jobs.read_status(job_home)
            if status:
                steps = [r["progress"]["step"] for r in status["replicas"] if r.get("progress")]
                if steps:
                    bar.update(task_id, completed=min(max(steps), total))
                if status["state"] != "Running":
                    if status["state"] == "Succeeded":
                        bar.update(task_id, completed=total)
                    break
            if not local_jobs.is_active(job_home):
                status = local_jobs.read_status(job_home) or {"state": "Unknown"}
                break
            if deadline and time.monotonic() > deadline:
                raise DoeksError(f"job {settings.job_name} still running after {timeout:.0f}s")
            time.sleep(0.25)
    exit_deadline = time.monotonic() + 15  # the supervisor writes its last status, then exits
    while local_jobs.is_active(job_home) and time.monotonic() < exit_deadline:
        time.sleep(0.1)
    return status or {"state": "Unknown"}


def _expected_steps(settings) -> int:
    images = settings.data_classes * settings.data_train_per_class
    per_epoch = max(1, images // (settings.batch_size * settings.replicas * settings.nproc_per_node))
    return per_epoch * settings.epochs


def final_result(settings) -> dict[str, Any] | None:
    path = metrics_dir(settings) / "final.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def status_rows(settings) -> list[list[Any]]:
    status = local_jobs.read_status(home(settings))
    if not status:
        return []
    rows = []
    for r in status["replicas"]:
        progress = r.get("progress") or {}
        rows.append([f"node-{r['replica']}", r["state"], r["restarts"], r.get("pid") or "",
                     progress.get("step", ""), progress.get("samples_per_s", ""), progress.get("world", "")])
    return rows


def scale_local(settings, runner, replicas: int) -> None:
    if not (settings.min_replicas <= replicas <= settings.max_replicas):
        raise DoeksError(f"--replicas {replicas} is outside MIN_REPLICAS:MAX_REPLICAS = {settings.min_replicas}:{settings.max_replicas}")
    job_home = home(settings)
    if not runner.dry_run and not local_jobs.is_active(job_home):
        raise DoeksError(f"job {settings.job_name} is not running: start it with `invoke elasticjob.deploy`")
    runner.step(f"scale job {settings.job_name} to {replicas} nodes", local_jobs.request_scale, job_home, replicas)


def delete_local(settings, runner) -> bool:
    job_home = home(settings)
    if not local_jobs.is_active(job_home):
        runner.note(f"job {settings.job_name} is not running (checkpoints kept in {checkpoint_dir(settings)})")
        return False
    runner.step(f"stop job {settings.job_name} and all its processes (checkpoints kept)", local_jobs.stop, job_home)
    return True


def epoch_seconds(metrics_csv: Path) -> float:
    """Time from the first logged step to the end of the first epoch's evaluation (excludes process start-up)."""
    from .plots import read_metrics

    rows = read_metrics(metrics_csv)
    first = next(float(r["time"]) for r in rows if r["kind"] == "train")
    end = next(float(r["time"]) for r in rows if r["kind"] == "val")
    return end - first

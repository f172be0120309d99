"""The elastic job's data and outputs on this machine (the shared volume folder): the synthetic data set, the metrics,
checkpoint and job folders. Where the job runs, and every verb on it, is `doeks.targets`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import ui
from .errors import DoeksError
from .local import jobs as local_jobs
from .local import runtime


def home(settings) -> Path:
    return local_jobs.job_home(settings.state_dir, settings.job_name)


def data_root(settings) -> Path:
    return runtime.shared_volume(settings) / "data"


def metrics_dir(settings) -> Path:
    return job_dir(settings, "metrics")


def checkpoint_uri(settings) -> str:
    """The job's checkpoints as seen from this machine: CHECKPOINT_URI/<job> (s3:// or a folder), or the shared
    volume folder's checkpoints/<job>."""
    from .jobpaths import checkpoint_uri as uri

    return uri(settings, str(runtime.shared_volume(settings)))


def model_uri(settings) -> str:
    from .jobpaths import model_uri as uri

    return uri(settings, str(runtime.shared_volume(settings)))


def checkpoint_dir(settings) -> Path:
    """The folder of the job's checkpoints on this machine (the shared volume's, or CHECKPOINT_URI's folder); for
    checkpoints in S3 the shared volume's folder (empty)."""
    uri = checkpoint_uri(settings)
    return runtime.shared_volume(settings) / "checkpoints" / settings.job_name if uri.startswith("s3://") else Path(uri)


def job_dir(settings, kind: str) -> Path:
    """The job's folder of `kind` (checkpoints, metrics, models, output) in the volume's folder on this machine."""
    from .jobpaths import job_folder

    return Path(job_folder(settings, kind, str(runtime.shared_volume(settings))))


def clear_outputs(settings) -> None:
    """Remove the job's checkpoints, metrics and model.pt (`deploy --fresh`): the next run starts from scratch, and a
    model.pt found afterwards is that run's, never the previous one's."""
    import shutil

    for folder in (checkpoint_dir(settings), metrics_dir(settings)):
        shutil.rmtree(folder, ignore_errors=True)
    uri = checkpoint_uri(settings)
    if uri.startswith("s3://"):
        delete_s3_prefix(settings, uri)
    remove_model(settings, model_uri(settings))


def remove_model(settings, uri: str) -> None:
    """Remove model.pt under the job's model folder or S3 prefix `uri` (gone already is fine)."""
    if not uri.startswith("s3://"):
        Path(uri, "model.pt").unlink(missing_ok=True)
        return
    from .aws import client

    bucket, _, prefix = uri[len("s3://"):].partition("/")
    s3 = client(settings, "s3")
    try:
        s3.delete_object(Bucket=bucket, Key=f"{prefix.rstrip('/')}/model.pt")
    except s3.exceptions.NoSuchBucket:
        pass


def delete_s3_prefix(settings, uri: str) -> int:
    """Delete every object under s3://bucket/prefix/ (the endpoint of doeks.aws); returns how many."""
    from .aws import client

    bucket, _, prefix = uri[len("s3://"):].partition("/")
    s3 = client(settings, "s3")
    deleted = 0
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix.rstrip("/") + "/"):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
                deleted += len(keys)
    except s3.exceptions.NoSuchBucket:
        return 0
    return deleted


def prepare_s3(settings) -> dict[str, str]:
    """Before a job on this machine whose checkpoints or model are in S3: the endpoint (doeks' moto server, started
    if need be, or AWS_ENDPOINT_URL), the bucket made in doeks' moto (it stands in for the account's bucket), and the
    environment the training processes need to reach it (doeks.jobpaths.s3_env). Empty when nothing is in S3."""
    from .aws import client, endpoint_url
    from .jobpaths import in_s3, s3_buckets, s3_env

    if not in_s3(settings):
        return {}
    endpoint = endpoint_url(settings)
    if endpoint and not settings.aws_endpoint_url:
        s3 = client(settings, "s3")
        for bucket in s3_buckets(settings):
            try:
                s3.head_bucket(Bucket=bucket)
            except Exception:  # noqa: BLE001 - botocore's 404
                options = {} if settings.aws_region == "us-east-1" else {
                    "CreateBucketConfiguration": {"LocationConstraint": settings.aws_region}}
                s3.create_bucket(Bucket=bucket, **options)
    return s3_env(settings, endpoint)


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


def check_job_data(settings, code=None) -> None:
    """Before a job starts: the built-in workload's ImageNet layout is checked (check_data); a user's script gets its
    data folder as it is, even empty (made if missing), and its output folders. `code`: the job's, resolved once."""
    from .code import resolve

    if (code or resolve(settings)).builtin:
        check_data(settings)
        return
    root = runtime.shared_volume(settings)
    for folder in (root / "data", checkpoint_dir(settings), job_dir(settings, "models"), job_dir(settings, "output")):
        folder.mkdir(parents=True, exist_ok=True)


def check_data(settings) -> None:
    root = data_root(settings)
    for split in ("train", "val"):
        folder = root / split
        if split == "val" and folder.is_dir() and any(p.is_file() for p in folder.iterdir()):
            # ImageNet's val/ as it comes: the same words as the training script's own check
            raise DoeksError(f"{folder} holds files, not class folders: re-lay it out with `invoke csi.data.stage "
                             "--relayout-val` (LOC_val_solution.csv)")
        classes = [d for d in folder.iterdir() if d.is_dir()] if folder.is_dir() else []
        if not classes or not any(any(c.iterdir()) for c in classes):
            raise DoeksError(f"data folder {folder} is missing or empty: run `invoke elasticjob.data` first")


def final_result(settings) -> dict[str, Any] | None:
    path = metrics_dir(settings) / "final.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def epoch_seconds(metrics_csv: Path) -> float:
    """Time from the first logged step to the end of the first epoch's evaluation (excludes process start-up)."""
    from .plots import read_metrics

    rows = read_metrics(metrics_csv)
    first = next(float(r["time"]) for r in rows if r["kind"] == "train")
    end = next(float(r["time"]) for r in rows if r["kind"] == "val")
    return end - first


def cluster_data_source(settings, runner=None) -> str | None:
    """s3://S3_BUCKET/DATA_S3_PREFIX, which `invoke up` stages into SHARED_PVC on a cluster before the job starts.
    The built-in ImageNet job needs its train/ there: one line naming the missing step when there is none (a dry
    run without credentials plans on). A user's own script (TRAIN_SCRIPT) needs no data: whatever is under the
    prefix is staged, and None when there is nothing (docs/your-own-script.md: its data folder is as it is)."""
    from .aws import client, lookup
    from .code import resolve

    source = f"s3://{settings.s3_bucket}/{settings.data_s3_prefix.strip('/')}"
    builtin = resolve(settings).builtin
    under = f"{settings.data_s3_prefix.strip('/')}/" + ("train/" if builtin else "")

    def count():
        s3 = client(settings, "s3")
        try:
            return s3.list_objects_v2(Bucket=settings.s3_bucket, Prefix=under, MaxKeys=1).get("KeyCount", 0)
        except s3.exceptions.NoSuchBucket:
            return 0

    found = lookup(runner, f"{'training data' if builtin else 'data'} under s3://{settings.s3_bucket}/{under}", count,
                   unknown=1)
    if not found and not builtin:
        return None
    if not found:
        raise DoeksError(f"no training data under {source}/train/: upload the ImageNet layout (train/ and val/) there, "
                         f"e.g. `aws s3 sync ./imagenet {source}`, or set S3_BUCKET/DATA_S3_PREFIX; `invoke up` then stages "
                         f"it into {settings.shared_pvc}")
    return source

"""Staging data from S3 into the shared volume: parallel, resumable, verified; and the ImageNet val re-layout.

Parallelism: one boto3 client shared by N threads with a connection pool of N (botocore clients are thread-safe),
one GetObject per file streamed to a temp file and renamed (a file is either complete or absent, so a restart skips
exactly the files already there with the right size). Also a CLI, used by the Kubernetes Job on the cluster:
`python -m doeks.datastage s3://bucket/prefix /mount/path [--threads N]`.
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .errors import DoeksError


@dataclass
class StageResult:
    files: int = 0
    bytes: int = 0
    downloaded: int = 0
    skipped: int = 0


def s3_client(endpoint_url: str | None, region: str, threads: int, credentials: dict | None = None):
    import boto3
    from botocore.config import Config

    config = Config(max_pool_connections=max(10, threads), retries={"max_attempts": 5, "mode": "adaptive"},
                    tcp_keepalive=True)
    return boto3.client("s3", endpoint_url=endpoint_url or None, region_name=region, config=config, **(credentials or {}))


def split_s3(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://") or len(uri) < 6:
        raise DoeksError(f"{uri!r} is not an s3://bucket/prefix path")
    bucket, _, prefix = uri[5:].partition("/")
    return bucket, prefix


def list_objects(client, bucket: str, prefix: str) -> list[tuple[str, int]]:
    objects = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        objects += [(o["Key"], o["Size"]) for o in page.get("Contents", []) if not o["Key"].endswith("/")]
    return objects


def stage(client, source: str, destination: Path, threads: int = 64, progress=None) -> StageResult:
    """Copy every object under `source` (s3://bucket/prefix) to `destination`, keeping relative paths."""
    bucket, prefix = split_s3(source)
    objects = list_objects(client, bucket, prefix)
    if not objects:
        raise DoeksError(f"nothing under {source}: check the bucket and prefix")
    base = prefix if prefix.endswith("/") or not prefix else prefix + "/"
    result = StageResult(files=len(objects), bytes=sum(size for _, size in objects))
    lock = threading.Lock()
    todo = []
    for key, size in objects:
        target = destination / key[len(base):] if key.startswith(base) else destination / Path(key).name
        if target.is_file() and target.stat().st_size == size:
            result.skipped += 1
        else:
            todo.append((key, size, target))
    for folder in {t.parent for _, _, t in todo}:
        folder.mkdir(parents=True, exist_ok=True)
    if progress:
        progress(result.skipped, result.files)

    def fetch(item):
        key, size, target = item
        tmp = target.with_name(f".{target.name}.part-{threading.get_ident()}")
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        with open(tmp, "wb") as out:
            for chunk in iter(lambda: body.read(1 << 20), b""):
                out.write(chunk)
        os.replace(tmp, target)
        with lock:
            result.downloaded += 1
            if progress:
                progress(result.skipped + result.downloaded, result.files)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        for future in [pool.submit(fetch, item) for item in todo]:
            future.result()
    verify(objects, base, destination)
    return result


def verify(objects: list[tuple[str, int]], base: str, destination: Path) -> None:
    missing = [key for key, size in objects
               if not ((destination / key[len(base):]).is_file() and (destination / key[len(base):]).stat().st_size == size)]
    if missing:
        raise DoeksError(f"{len(missing)} of {len(objects)} files are missing or of the wrong size after staging (first: {missing[0]})")


def relayout_val(root: Path, annotations: Path | None = None) -> int:
    """ImageNet val: flat val/*.JPEG plus a CSV of (ImageId, label) -> val/<label>/<file>. Works for any mount path.

    `annotations` defaults to LOC_val_solution.csv next to val/ (as in the ImageNet download); the label is the
    first word of PredictionString. Idempotent: files already in class folders are left alone."""
    val = root / "val"
    annotations = annotations or root / "LOC_val_solution.csv"
    if not val.is_dir():
        raise DoeksError(f"{val} does not exist")
    flat = {p.stem: p for p in val.iterdir() if p.is_file()}
    if not flat:
        return 0
    if not annotations.is_file():
        raise DoeksError(f"{len(flat)} flat files in {val} but no annotations at {annotations}")
    moved = 0
    with open(annotations, newline="") as f:
        for row in csv.DictReader(f):
            image = flat.get(row["ImageId"])
            if image is None:
                continue
            label = row["PredictionString"].split()[0]
            (val / label).mkdir(exist_ok=True)
            shutil.move(str(image), val / label / image.name)
            moved += 1
    return moved


def upload_tree(client, folder: Path, destination: str, threads: int = 16) -> int:
    bucket, prefix = split_s3(destination)
    files = [p for p in folder.rglob("*") if p.is_file()]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(lambda p: client.upload_file(str(p), bucket, f"{prefix.rstrip('/')}/{p.relative_to(folder).as_posix()}"), files))
    return len(files)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="stage s3://bucket/prefix into a folder")
    parser.add_argument("source")
    parser.add_argument("destination")
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--relayout-val", action="store_true")
    args = parser.parse_args(argv)
    client = s3_client(os.environ.get("AWS_ENDPOINT_URL"), os.environ.get("AWS_REGION", "us-west-2"), args.threads)
    result = stage(client, args.source, Path(args.destination), args.threads,
                   progress=lambda done, total: print(f"{done}/{total}", flush=True) if done % 1000 == 0 or done == total else None)
    print(f"staged {result.files} files ({result.bytes} bytes): {result.downloaded} downloaded, {result.skipped} already there")
    if args.relayout_val:
        print(f"val re-layout: {relayout_val(Path(args.destination))} files moved")
    return 0


if __name__ == "__main__":
    sys.exit(main())

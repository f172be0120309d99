"""Staging a few thousand ImageNet-sized files from S3 into the shared volume, three ways, in one run (issue 7):

  1. `aws s3 sync` (what the seed's data-prep.sh runs), against the same endpoint;
  2. doeks `csi.data.stage` (doeks.datastage.stage, STAGE_THREADS threads);
  3. the endpoint's ceiling: a raw 64-thread boto3 GET loop that writes nothing.

All three read the same objects from the same local moto server process. Targets: stage >= 0.9x the ceiling and
>= 1.4x aws s3 sync (files/s). `aws` is taken from PATH, or --aws PATH (e.g. a venv with `pip install awscli`).

Run: python bench/stage.py [--files 3000] [--size 110000] [--threads 64] [--aws /path/to/aws]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from doeks import datastage  # noqa: E402
from doeks.local import services  # noqa: E402

CREDS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--size", type=int, default=110_000, help="bytes per file (ImageNet JPEGs average ~110 kB)")
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--aws", default=shutil.which("aws"), help="aws CLI for the `aws s3 sync` baseline")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="doeks-stage-bench-"))
    server = services.moto(work)
    server.start()
    endpoint = server.endpoint()
    try:
        client = datastage.s3_client(endpoint, "us-east-1", args.threads, CREDS)
        client.create_bucket(Bucket="bench")
        payload = os.urandom(args.size)
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda i: client.put_object(Bucket="bench", Key=f"imagenet/train/n{i % 100:08d}/img_{i:07d}.JPEG",
                                                      Body=payload), range(args.files)))
        results = {}

        # 3. the ceiling: raw GETs, nothing written
        keys = [k for k, _ in datastage.list_objects(client, "bench", "imagenet/")]
        start = time.perf_counter()
        with ThreadPoolExecutor(64) as pool:
            list(pool.map(lambda k: client.get_object(Bucket="bench", Key=k)["Body"].read(), keys))
        results["raw 64-thread GET loop (ceiling)"] = time.perf_counter() - start

        # 2. doeks stage
        start = time.perf_counter()
        staged = datastage.stage(client, "s3://bench/imagenet", work / "doeks", args.threads)
        results[f"doeks stage ({args.threads} threads)"] = time.perf_counter() - start
        assert staged.downloaded == args.files

        # 1. aws s3 sync
        if args.aws:
            env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
            start = time.perf_counter()
            subprocess.run([args.aws, "s3", "sync", "--only-show-errors", "--endpoint-url", endpoint, "s3://bench/imagenet",
                            str(work / "aws")], env=env, check=True)
            results["aws s3 sync"] = time.perf_counter() - start
            assert sum(1 for _ in (work / "aws").rglob("*.JPEG")) == args.files
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"{args.files} files of {args.size} bytes from a local moto S3 endpoint:")
    rate = {name: args.files / seconds for name, seconds in results.items()}
    for name, seconds in results.items():
        print(f"  {name:34s} {seconds:6.1f} s  {rate[name]:7.0f} files/s")
    ceiling = rate["raw 64-thread GET loop (ceiling)"]
    ours = rate[f"doeks stage ({args.threads} threads)"]
    print(f"doeks stage / ceiling:     {ours / ceiling:.2f}x (target >= 0.9x)")
    if "aws s3 sync" in rate:
        print(f"doeks stage / aws s3 sync: {ours / rate['aws s3 sync']:.2f}x (target >= 1.4x)")
    else:
        print("aws s3 sync: not measured (no aws CLI: pass --aws, e.g. from a venv with `pip install awscli`)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

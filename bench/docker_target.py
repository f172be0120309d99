"""The docker target vs the local target, measured in one run (issue 16): time to first step and recovery after a
killed container, on the same script, data and job (2 nodes x 1 process, etcd rendezvous).

1. Time to first step: from `invoke elasticjob.deploy` to the first logged optimizer step.
2. Recovery: SIGKILL a whole node (docker: the container's main process, which docker restarts under the pod's
   restartPolicy OnFailure; local: the node's agent and workers, which the supervisor restarts), past the first
   checkpoint; time until the next optimizer step of any rank.
Also printed: what the docker start is made of (container create+start, the process's first line, the first step).
No target: the figures and what dominates are for the README.

Run: python bench/docker_target.py [--rounds N]   (needs a docker daemon and `invoke elasticjob.build` done for
     TARGET=docker; the storage driver of the daemon is printed, since it decides the container start)
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from doeks import settings as S  # noqa: E402
from doeks import targets  # noqa: E402
from doeks.local import jobs  # noqa: E402

STEP = re.compile(r"\] (\d\d:\d\d:\d\d\.\d{3}) \[rank \d+\] step=(\d+) ")
TRAIN_ARGS = "--log-every 1 --step-delay 0.2"


def invoke(env, *args, check=True):
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=check)


def target_for(env):
    os.environ.update(env)
    S.reset()
    return targets.get(S.current())


def wait_step(cursor, after: float, min_step: int = 1, timeout: float = 600) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in cursor():
            match = STEP.search(line)
            if match and int(match.group(2)) >= min_step and time.monotonic() >= after:
                return time.monotonic()
        time.sleep(0.05)
    raise TimeoutError("no training step seen")


def kill_node(target) -> None:
    if target.name == "docker":
        victim = next(c for c in target.containers() if c.labels["doeks/replica"] == "1")
        victim.reload()
        os.kill(victim.attrs["State"]["Pid"], signal.SIGKILL)
        return
    status = jobs.read_status(target.home)
    agent = next(r["pid"] for r in status["replicas"] if r["replica"] == 1)
    for pid in [agent] + jobs.descendants(agent):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def one_round(env, name: str) -> tuple[float, float]:
    env = {**env, "TARGET": name}
    target = target_for(env)
    cursor = target._cursor()
    started = time.monotonic()
    invoke(env, "elasticjob.deploy", "--fresh", "--train-args", TRAIN_ARGS)
    first = wait_step(cursor, started) - started
    wait_step(cursor, 0, min_step=int(env["CHECKPOINT_EVERY"]) + 2)  # past the first checkpoint
    killed = time.monotonic()
    kill_node(target)
    recovery = wait_step(cursor, killed + 0.3) - killed
    invoke(env, "elasticjob.delete")
    return first, recovery


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="doeks-bench-docker-"))
    env = {**os.environ, "STATE_DIR": str(work / "state"), "JOB_NAME": "benchdocker", "DATA_TRAIN_PER_CLASS": "200",
           "DATA_VAL_PER_CLASS": "20", "EPOCHS": "20", "CHECKPOINT_EVERY": "5", "REPLICAS": "2", "NPROC_PER_NODE": "1",
           "MIN_REPLICAS": "1", "MAX_REPLICAS": "2", "BATCH_SIZE": "16"}
    import docker

    driver = docker.from_env().info()["Driver"]
    invoke({**env, "TARGET": "docker"}, "elasticjob.build")
    invoke(env, "elasticjob.data")
    results: dict[str, list[tuple[float, float]]] = {"local": [], "docker": []}
    try:
        for _ in range(args.rounds):
            for name in ("local", "docker"):
                results[name].append(one_round(env, name))
    finally:
        invoke({**env, "TARGET": "docker"}, "elasticjob.delete", check=False)
        invoke(env, "eks.delete", check=False)
    median = {name: (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
              for name, rows in results.items()}
    print(f"docker storage driver: {driver}; rounds: {args.rounds}; "
          f"local {[tuple(round(x, 1) for x in r) for r in results['local']]}, "
          f"docker {[tuple(round(x, 1) for x in r) for r in results['docker']]}")
    print(f"time to first step: local {median['local'][0]:.1f} s, docker {median['docker'][0]:.1f} s   "
          f"ratio {median['docker'][0] / median['local'][0]:.2f}x")
    print(f"recovery after a killed node/container: local {median['local'][1]:.1f} s, docker {median['docker'][1]:.1f} s   "
          f"ratio {median['docker'][1] / median['local'][1]:.2f}x")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

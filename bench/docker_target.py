"""The docker target vs the local target, measured in one run (issue 16): time to first step and recovery after a
killed container, on the same script, data and job (2 nodes x 1 process, etcd rendezvous).

1. Time to first step: from `invoke elasticjob.deploy` to the first logged optimizer step.
2. Recovery: SIGKILL a whole node (docker: the container's main process, which docker restarts under the pod's
   restartPolicy OnFailure; local: the node's agent and workers, which the supervisor restarts), past the first
   checkpoint; time until the next optimizer step of any rank.
Also printed: what the docker start is made of (container create+start, the process's first line, the first step).
No target: the figures and what dominates are for the README.

Run: python bench/docker_target.py [--rounds N]   (needs a docker daemon and `invoke elasticjob.build` done for
     TARGET=docker; the storage driver of the daemon is printed, since it decides the container start). A bench that
     cannot finish says why in one line and exits 1 as soon as it knows (a job that failed or ended, a step the job
     reports that its logs as read here do not show, an invoke that failed), not after the 600 s wait.
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
from doeks.targets.base import FAILED, STOPPED, SUCCEEDED  # noqa: E402

STEP = re.compile(r"\] (\d\d:\d\d:\d\d\.\d{3}) \[rank \d+\] step=(\d+) ")
TRAIN_ARGS = "--log-every 1 --step-delay 0.2"


class BenchError(Exception):
    """The bench cannot go on: one line saying why."""


def invoke(env, *args, check=True):
    result = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if check and result.returncode:
        said = " / ".join(result.stderr.strip().splitlines()[-3:])
        raise BenchError(f"`invoke {' '.join(args)}` (TARGET={env.get('TARGET', 'local')}) exited {result.returncode}: {said}")
    return result


def target_for(env):
    os.environ.update(env)
    S.reset()
    return targets.get(S.current())


class Watch:
    """The job's log lines as they come (its target's cursor, made once the run exists: a cursor made before the
    deploy reads the previous run's folder on the local target), checked against what the job itself reports."""

    CHECK_EVERY = 2.0

    def __init__(self, target):
        self.target, self.cursor, self.seen = target, target._cursor(), 0  # seen: the highest step the cursor showed
        self.ahead = 0  # consecutive checks where the job reported steps its logs did not show

    def step(self, after: float, min_step: int = 1, timeout: float = 600, restarted: bool = False) -> float:
        """When a step >= min_step is logged at or after `after` (monotonic); `restarted`: only a step after a worker's
        `start host=` line read after `after` (training started again, not a step a survivor logs before it notices a
        loss). Raises at once, saying why, when the job ends or fails first, or when it reports steps that the cursor
        does not show (a cursor reading the wrong place)."""
        deadline, check, started = time.monotonic() + timeout, 0.0, not restarted
        while time.monotonic() < deadline:
            for line in self.cursor():
                if not started and " start host=" in line and time.monotonic() >= after:
                    started = True
                match = STEP.search(line)
                if match:
                    self.seen = max(self.seen, int(match.group(2)))
                    if started and int(match.group(2)) >= min_step and time.monotonic() >= after:
                        return time.monotonic()
            if time.monotonic() >= check:
                check = time.monotonic() + self.CHECK_EVERY
                self._check(min_step)
            time.sleep(0.05)
        raise BenchError(f"{self.target.name}: no training step >= {min_step} logged in {timeout:.0f} s")

    def _check(self, min_step: int) -> None:
        status = self.target.describe()
        if status.state in (FAILED, SUCCEEDED, STOPPED):
            why = f": {status.reason}" if status.reason else ""
            raise BenchError(f"{self.target.name}: job {status.name} ended {status.state} before a step >= {min_step} "
                             f"was logged{why}")
        reported = max((r.step or 0 for r in status.replicas), default=0)
        self.ahead = self.ahead + 1 if reported > self.seen + 2 else 0
        if self.ahead >= 2:
            raise BenchError(f"{self.target.name}: job {status.name} reports step {reported} but its logs as the bench "
                             f"reads them show {self.seen or 'none'}: the log cursor reads the wrong place")


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
    started = time.monotonic()
    invoke(env, "elasticjob.deploy", "--fresh", "--train-args", TRAIN_ARGS)
    watch = Watch(target)  # its lines are kept from the start of the run, so nothing is missed
    first = watch.step(started) - started
    watch.step(0, min_step=int(env["CHECKPOINT_EVERY"]) + 2)  # past the first checkpoint
    killed = time.monotonic()
    kill_node(target)
    recovery = watch.step(killed + 0.3) - killed
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

    results: dict[str, list[tuple[float, float]]] = {"local": [], "docker": []}
    try:
        try:
            driver = docker.from_env().info()["Driver"]
        except docker.errors.DockerException as e:
            raise BenchError(f"no docker daemon reachable ({e}): `invoke setup --docker`") from None
        invoke({**env, "TARGET": "docker"}, "elasticjob.build")
        invoke(env, "elasticjob.data")
        for _ in range(args.rounds):
            for name in ("local", "docker"):
                results[name].append(one_round(env, name))
    except BenchError as e:
        print(f"bench failed: {e}", file=sys.stderr)
        return 1
    finally:
        invoke({**env, "TARGET": "docker"}, "elasticjob.delete", check=False)
        invoke(env, "eks.delete", check=False)
        shutil.rmtree(work, ignore_errors=True)
    median = {name: (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
              for name, rows in results.items()}
    print(f"docker storage driver: {driver}; rounds: {args.rounds}; "
          f"local {[tuple(round(x, 1) for x in r) for r in results['local']]}, "
          f"docker {[tuple(round(x, 1) for x in r) for r in results['docker']]}")
    print(f"time to first step: local {median['local'][0]:.1f} s, docker {median['docker'][0]:.1f} s   "
          f"ratio {median['docker'][0] / median['local'][0]:.2f}x")
    print(f"recovery after a killed node/container: local {median['local'][1]:.1f} s, docker {median['docker'][1]:.1f} s   "
          f"ratio {median['docker'][1] / median['local'][1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Recovery and start-up of the local elastic job vs plain torchrun, measured in one run (issue 3).

1. Recovery: SIGKILL one worker mid-training; time until the next completed optimizer step (any rank).
   doeks (`elasticjob.deploy`: etcd rendezvous, its rdzv settings) vs plain `torchrun` with default settings
   (c10d rendezvous, default timeouts) running the same script on the same data, 2 nodes x 1 process.
   Targets: doeks <= 0.5x plain, and <= 10 s.
2. Time to first step: `invoke elasticjob.deploy` (from the command to the first logged step) vs launching the same
   two torchrun agents by hand. Target: <= 1.15x.

Run: python bench/elastic_recovery.py [--rounds N]   (RDZV_BACKEND=c10d to measure doeks with c10d,
     LOCAL_PRELOAD=false to measure it with a fresh interpreter per worker)
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

from doeks import services  # noqa: E402
from doeks.local import jobs  # noqa: E402

STEP = re.compile(rb"\[rank \d+\] step=(\d+) ")
TRAIN_ARGS = ["--arch", "resnet18", "--epochs", "50", "--batch-size", "16", "--checkpoint-every", "5", "--log-every", "1"]


class Tail:
    """Arrival times of `step=` lines in a set of log files."""

    def __init__(self, paths):
        self.paths = paths
        self.offsets = {path: path.stat().st_size for path in paths() if path.exists()}  # only what comes next

    def poll(self) -> list[tuple[float, int]]:
        found = []
        for path in self.paths():
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets.get(path, 0))
                    chunk = f.read()
            except OSError:
                continue
            cut = chunk.rfind(b"\n") + 1
            self.offsets[path] = self.offsets.get(path, 0) + cut
            now = time.monotonic()
            found += [(now, int(m.group(1))) for m in STEP.finditer(chunk[:cut])]
        return found

    def wait_step(self, after: float, timeout: float = 300, min_step: int = 1) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for arrived, step in self.poll():
                if arrived >= after and step >= min_step:
                    return arrived
            time.sleep(0.02)
        raise TimeoutError("no training step seen")


def worker_pids(agent: int) -> list[int]:
    return [p for p in jobs.descendants(agent) if b"train.py" in Path(f"/proc/{p}/cmdline").read_bytes()]


def plain_torchrun(work: Path, data: Path) -> tuple[list[subprocess.Popen], Tail]:
    port = services.free_port()
    procs = []
    logs = []
    for node in range(2):
        log = work / f"plain-{node}.log"
        logs.append(log)
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"plain-{port}",
                "--max-restarts", "3", str(ROOT / "doeks" / "workload" / "train.py"), "--data", str(data),
                "--checkpoint-dir", str(work / "plain-ckpt"), "--metrics-dir", str(work / "plain-metrics")] + TRAIN_ARGS
        # the same environment doeks gives its workers (without it, restarts can hang in gloo's connectFullMesh)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        procs.append(subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True))
    return procs, Tail(lambda: logs)


def doeks_job(work: Path, env: dict) -> tuple[float, Tail]:
    home = work / "state" / "jobs" / env["JOB_NAME"]
    tail = Tail(lambda: sorted(home.glob("runs/*/replicas/*/agent.log")))  # logs are appended across runs: skip old lines
    argv = [sys.executable, "-m", "invoke", "elasticjob.deploy", "--replicas", "2", "--nproc-per-node", "1", "--fresh",
            "--train-args", "--log-every 1"]
    start = time.monotonic()
    subprocess.run(argv, cwd=ROOT, env=env, check=True, capture_output=True)
    return start, tail


def stop_all(procs) -> None:
    for p in procs:
        jobs.kill_tree(p.pid, grace=2)


def measure_recovery(tail: Tail, agent_of_node1, label: str) -> float:
    tail.wait_step(0, min_step=8)  # past the first checkpoint, training at full speed
    victim = worker_pids(agent_of_node1())[0]
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    try:
        return tail.wait_step(killed + 0.3, timeout=180) - killed
    except TimeoutError:
        print(f"  {label}: no step within 180 s of the kill (counted as 180 s)", flush=True)
        return 180.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="doeks-bench-"))
    env = {**os.environ, "STATE_DIR": str(work / "state"), "JOB_NAME": "bench", "DATA_TRAIN_PER_CLASS": "200",
           "DATA_VAL_PER_CLASS": "20", "EPOCHS": "50", "CHECKPOINT_EVERY": "5", "MIN_REPLICAS": "1", "MAX_REPLICAS": "3"}
    subprocess.run([sys.executable, "-m", "invoke", "elasticjob.data"], cwd=ROOT, env=env, check=True, capture_output=True)
    data = work / "state" / "volumes" / "fsx-pvc" / "data"
    plain_rec, doeks_rec, plain_start, doeks_start = [], [], [], []
    try:
        for _ in range(args.rounds):
            # plain torchrun
            t0 = time.monotonic()
            procs, tail = plain_torchrun(work, data)
            plain_start.append(tail.wait_step(0) - t0)
            plain_rec.append(measure_recovery(tail, lambda: procs[1].pid, "plain torchrun"))
            stop_all(procs)
            shutil.rmtree(work / "plain-ckpt", ignore_errors=True)
            t0, tail = doeks_job(work, env)
            doeks_start.append(tail.wait_step(0) - t0)
            home = work / "state" / "jobs" / "bench"

            def node1_agent():
                status = jobs.read_status(home)
                return next(r["pid"] for r in status["replicas"] if r["replica"] == 1)

            doeks_rec.append(measure_recovery(tail, node1_agent, "doeks"))
            jobs.stop(home)
    finally:
        subprocess.run([sys.executable, "-m", "invoke", "eks.delete"], cwd=ROOT, env=env, capture_output=True)
    p_rec, d_rec = statistics.median(plain_rec), statistics.median(doeks_rec)
    p_start, d_start = statistics.median(plain_start), statistics.median(doeks_start)
    print(f"rounds: plain {[round(x, 1) for x in plain_rec]}, doeks {[round(x, 1) for x in doeks_rec]}")
    print(f"recovery after SIGKILL of a worker (to the next optimizer step), median of {args.rounds}:")
    print(f"  plain torchrun (c10d, defaults): {p_rec:6.1f} s")
    print(f"  doeks elasticjob ({env.get('RDZV_BACKEND', 'etcd'):>6}):     {d_rec:6.1f} s   ratio {d_rec / p_rec:.2f}x (target <= 0.5x and <= 10 s)")
    print("time to first optimizer step:")
    print(f"  two torchrun agents by hand:     {p_start:6.1f} s")
    print(f"  invoke elasticjob.deploy:        {d_start:6.1f} s   ratio {d_start / p_start:.2f}x (target <= 1.15x)")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

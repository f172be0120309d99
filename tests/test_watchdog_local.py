"""The hang watchdog (doeks.watchdog) on the local target, for real: torchrun agents with a real etcd, a rank stopped
with SIGSTOP (as a stuck collective or a deadlocked loader holds a job: alive, making no progress). The replica's
watchdog names the rank in `status` within HANG_TIMEOUT + 15 s and restarts its processes (rung 1); the same rank
stopped again soon after is past HANG_RESTARTS=1, so its node is replaced (rung 2: the agent exits 75, the supervisor
starts the replica anew); the job ends Succeeded, and `history` keeps every step and the run's goodput."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from doeks.local import jobs

from .conftest import invoke, job_settings, wait_for

pytestmark = pytest.mark.slow  # real torchrun agents and etcd for a few minutes

JOB = {"JOB_NAME": "hang", "DATA_TRAIN_PER_CLASS": "64", "DATA_VAL_PER_CLASS": "8", "REPLICAS": "2",
       "NPROC_PER_NODE": "1", "MIN_REPLICAS": "1", "MAX_REPLICAS": "2", "EPOCHS": "3", "CHECKPOINT_EVERY": "4",
       "BATCH_SIZE": "8", "HANG_TIMEOUT": "10", "HANG_RESTARTS": "1", "HANG_REPLACEMENTS": "1"}
TRAIN_ARGS = "--log-every 1 --step-delay 0.3"


def rank_process(home, replica: int) -> int:
    """The training process of a replica's one rank (a fork of its zygote; not one of its DataLoader workers)."""
    def found():
        status = jobs.read_status(home) or {"replicas": []}
        agent = next((r.get("pid") for r in status["replicas"] if r["replica"] == replica), None)
        if not agent:
            return None
        for pid in jobs.descendants(agent):
            try:
                parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
                if "train.py" in open(f"/proc/{pid}/cmdline").read() and \
                        "train.py" not in open(f"/proc/{parent}/cmdline").read():
                    return pid
            except OSError:
                continue
        return None

    return wait_for(found, 120, f"replica {replica}'s training process")


def step_of(home) -> int:
    status = jobs.read_status(home) or {"replicas": []}
    return max(((r.get("progress") or {}).get("step") or 0 for r in status["replicas"]), default=0)


def said(env) -> str:
    result = invoke("elasticjob.status", env=env, timeout=120)
    return result.stdout + result.stderr


def test_a_stopped_rank_is_named_restarted_then_its_node_replaced_and_the_job_succeeds(state_dir, monkeypatch):
    s = job_settings(JOB, monkeypatch)
    home = state_dir / "jobs" / s.job_name
    env = {k: os.environ[k] for k in JOB} | {"STATE_DIR": str(state_dir)}
    deploy = invoke("elasticjob.deploy", "--fresh", "--train-args", TRAIN_ARGS, env=env, timeout=300)
    assert deploy.returncode == 0, deploy.stderr
    try:
        wait_for(lambda: step_of(home) >= 6, 240, "training past step 6", poll=1)
        victim = rank_process(home, 1)
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        text = wait_for(lambda: "watchdog: hang: rank" in (t := said(env)) and t, 10 + 15, "status naming the rank")
        assert f"pid {victim}) made no progress" in text and "stopped (SIGSTOP or a debugger)" in text, text
        assert time.monotonic() - stopped <= 10 + 15
        wait_for(lambda: "restart the process (rung 1 of 4, 1 of 1)" in said(env), 30, "rung 1 in status")
        step = step_of(home)
        wait_for(lambda: step_of(home) > step + 2, 180, "training again after the restart", poll=1)
        # the same rank stuck again: rung 1 is spent (HANG_RESTARTS=1), its node is replaced
        victim = rank_process(home, 1)
        os.kill(victim, signal.SIGSTOP)
        wait_for(lambda: "replace the pod (rung 2 of 4, 1 of 1)" in said(env), 10 + 30, "rung 2 in status")
        wait_for(lambda: (jobs.read_status(home) or {}).get("state") == "Succeeded", 600, "the job to succeed", poll=2)
    finally:
        invoke("elasticjob.delete", env=env, timeout=120)
    history = invoke("elasticjob.history", env=env, timeout=120)
    out = history.stdout + history.stderr
    assert history.returncode == 0 and "Succeeded" in out, out
    assert re.search(r"│ 0\.\d\d\s+│", out), out  # the run's goodput
    assert "watchdog: hang: rank" in out and "rung 1 of 4" in out and "rung 2 of 4" in out, out


@pytest.mark.skipif(not __import__("shutil").which("py-spy"), reason="py-spy is not installed here")
def test_a_rank_waiting_in_a_collective_is_told_from_one_outside_by_its_real_py_spy_dump(tmp_path):
    """py-spy's dump starts with the process and Python lines and a blank line before the threads: the main thread's
    frames are what tell a rank waiting on its peers (left alone: the hang is held elsewhere) from one that holds the
    job. Reading only up to the first blank line saw no frame at all, so every rank was "outside any collective" and
    each replica's watchdog restarted its own healthy rank beside the hung one (seen on doeks' cluster)."""
    import subprocess
    import sys

    from doeks import watchdog

    script = """import threading, time
def all_gather():
    time.sleep(120)
def compute():
    time.sleep(120)
waiting = __import__('sys').argv[1] == 'waiting'
threading.Thread(target=compute if waiting else all_gather, daemon=True).start()
all_gather() if waiting else compute()
"""
    (tmp_path / "rank.py").write_text(script)
    ranks = {how: subprocess.Popen([sys.executable, str(tmp_path / "rank.py"), how]) for how in ("waiting", "holding")}
    try:
        time.sleep(1.5)
        dumps = {how: watchdog.py_spy_dump(p.pid) for how, p in ranks.items()}
        assert all(d.startswith("Process ") and "\n\nThread " in d for d in dumps.values()), dumps
        assert watchdog.waits_on_peers(dumps["waiting"]), dumps["waiting"]
        assert not watchdog.waits_on_peers(dumps["holding"]), dumps["holding"]  # a thread's collective is not the rank's
    finally:
        for p in ranks.values():
            p.kill()
            p.wait()

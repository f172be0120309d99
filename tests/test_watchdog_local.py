"""The hang watchdog (doeks.pod.watchdog) on the local target, for real: torchrun agents with a real etcd, a rank stopped
with SIGSTOP (as a stuck collective or a deadlocked loader holds a job: alive, making no progress). The replica's
watchdog names the rank in `status` within HANG_TIMEOUT + 15 s and restarts its processes (rung 1); the same rank
stopped again soon after is past HANG_RESTARTS=1, so its node is replaced (rung 2: the agent exits 75, the supervisor
starts the replica anew); the job ends Succeeded, and `history` keeps every step and the run's goodput (slow).
Fast: what a py-spy dump tells, and a replica with no suspect of its own leaving its ranks alone until twice the
timeout (real rank processes, the agent's check called as its monitor loop calls it)."""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from doeks.local import jobs

from .conftest import invoke, job_settings, wait_for


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


@pytest.mark.slow  # real torchrun agents and etcd for a few minutes
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

    from doeks.pod import watchdog

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


WAITING_RANK = """import faulthandler, signal, time
faulthandler.register(signal.SIGUSR1)  # as the workload registers it: a stack dump asked, not the end of the rank
def all_reduce():  # py-spy's dump, where it is installed: inside a collective, waiting on a peer
    time.sleep(120)
all_reduce()
"""


def test_a_replica_with_no_local_suspect_takes_its_own_ranks_only_at_twice_the_timeout(tmp_path, capsys):
    """A replica whose ranks all wait on a peer (none stopped, none outside a collective) leaves them alone at the
    first HANG_TIMEOUT: the hang is held elsewhere and that replica's watchdog acts. Only when the job is still stuck
    at twice the timeout (the peer's watchdog may be gone with it) are its own ranks the suspects and restarted
    (rung 1). Taking them at the first timeout restarted every healthy replica beside the one that hangs. Real
    rank processes (asleep in a function named as a collective), the agent's watchdog driven as its monitor loop
    drives it."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from doeks.pod import watchdog

    timeout = 3.0
    (tmp_path / "rank.py").write_text(WAITING_RANK)
    ranks = [subprocess.Popen([sys.executable, str(tmp_path / "rank.py")]) for _ in range(2)]
    try:
        time.sleep(0.5)  # (their SIGUSR1 handler registered)
        env = {"DOEKS_HANG_TIMEOUT": str(timeout), "DOEKS_REPLICA": "1", "PET_LOG_DIR": str(tmp_path / "logs")}
        dog = watchdog.Watchdog(env)
        group = SimpleNamespace(workers=[SimpleNamespace(id=p.pid, global_rank=2 + i, local_rank=i)
                                         for i, p in enumerate(ranks)])
        dog.check(None, group)  # a new worker group: its progress starts now
        started = dog.group_started
        for worker in group.workers:  # each rank's last progress, at the group's start
            (Path(env["DOEKS_PROGRESS_DIR"]) / str(worker.global_rank)).write_text(f"7 {started}")

        def check_at(stale: float) -> None:
            time.sleep(max(0.0, started + stale - time.time()))
            dog.checked = 0.0  # (the monitor loop calls it every second; here at the moments that matter)
            dog.check(None, group)

        check_at(1.2 * timeout)  # stuck past the timeout, not past twice it: held elsewhere
        out = capsys.readouterr().out
        assert "its ranks 2, 3 wait on a peer (held elsewhere)" in out, out
        assert "hang: rank" not in out and "rung 1" not in out, out
        assert [p.poll() for p in ranks] == [None, None], "a healthy rank was restarted at the first timeout"

        check_at(2 * timeout + 0.5)  # still stuck at twice the timeout: its own ranks are the suspects
        out = capsys.readouterr().out
        assert "hang: rank 2 (replica node-1" in out and "hang: rank 3 (replica node-1" in out, out
        assert "no other replica's watchdog ended the hang" in out and "restart the process (rung 1 of 4" in out, out
        assert [p.wait(10) for p in ranks] == [-9, -9]  # SIGKILL: torchrun restarts the worker group
    finally:
        for p in ranks:
            p.kill()
            p.wait()


def test_the_job_pace_finds_a_stopped_rank_in_seconds_and_leaves_a_slow_replica_alone(tmp_path, capsys, monkeypatch):
    """Issue 56: the limit follows the job's pace. With HANG_TIMEOUT=300 and HANG_PACE=10, a job of 0.05 s steps has a
    rank that stopped named and restarted once its progress is PACE_FLOOR old (1 s here, 10 s by default), not 300 s
    later; a replica whose ranks are all simply slow (none stopped, none told from a peer by its stack) is left alone
    until HANG_TIMEOUT. Real rank processes; the agent's watchdog driven as its monitor loop drives it."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from doeks.pod import watchdog

    monkeypatch.setattr(watchdog, "PACE_FLOOR", 1.0)
    # every rank busy outside any collective (validating): slow, not certainly hung; a stopped one is certain
    monkeypatch.setattr(watchdog, "py_spy_dump", lambda pid: f"Process {pid}\n    evaluate (train.py:300)\n")
    (tmp_path / "rank.py").write_text(WAITING_RANK)
    ranks = [subprocess.Popen([sys.executable, str(tmp_path / "rank.py")]) for _ in range(2)]
    try:
        env = {"DOEKS_HANG_TIMEOUT": "300", "DOEKS_HANG_PACE": "10", "DOEKS_REPLICA": "0",
               "PET_LOG_DIR": str(tmp_path / "logs")}
        dog = watchdog.Watchdog(env)
        group = SimpleNamespace(workers=[SimpleNamespace(id=p.pid, global_rank=i, local_rank=i)
                                         for i, p in enumerate(ranks)])
        dog.check(None, group)  # a new worker group
        progress = Path(env["DOEKS_PROGRESS_DIR"])

        def check() -> str:
            dog.checked = 0.0  # (the monitor loop calls it every second)
            dog.check(None, group)
            return capsys.readouterr().out

        assert dog.limit() == 300  # no pace known yet: HANG_TIMEOUT
        start = time.time()
        for step in range(1, 9):  # eight steps of 0.05 s, as the ranks report them
            for worker in group.workers:
                (progress / str(worker.global_rank)).write_text(f"{step} {start + 0.05 * step}")
            check()
        assert abs(dog.steps.median() - 0.05) < 1e-6 and dog.limit() == 1.0

        time.sleep(max(0.0, start + 0.4 + 1.5 - time.time()))  # 1.5 s without progress: past the pace, slow only
        assert "hang" not in check() and [p.poll() for p in ranks] == [None, None], "a slow replica was restarted"

        os.kill(ranks[1].pid, signal.SIGSTOP)  # now a rank stops: certain, at the pace's limit
        wait_for(lambda: watchdog.process_state(ranks[1].pid) in ("T", "t"), 5, "the rank stopped", poll=0.05)
        out = check()
        assert "hang: rank 1 (replica node-0" in out and "stopped (SIGSTOP or a debugger)" in out, out
        assert "restart the process (rung 1 of 4" in out and time.time() - start < 10, out
        assert ranks[1].wait(10) == -9 and ranks[0].poll() is None
    finally:
        for p in ranks:
            p.kill()
            p.wait()

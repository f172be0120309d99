"""The elastic job on the local target, for real: torchrun agents, a real etcd, real SIGKILLs."""
from __future__ import annotations

import os
import re
import signal

import pytest

from doeks import elastic, targets
from doeks import services
from doeks.local import jobs
from doeks.runner import Runner

from .conftest import invoke, job_settings, training_processes, wait_for

SMALL = {"DATA_TRAIN_PER_CLASS": "200", "DATA_VAL_PER_CLASS": "25", "REPLICAS": "2", "NPROC_PER_NODE": "1",
         "EPOCHS": "4", "CHECKPOINT_EVERY": "5", "BATCH_SIZE": "16", "MIN_REPLICAS": "1", "MAX_REPLICAS": "3"}


@pytest.fixture
def small(state_dir, monkeypatch):
    return job_settings(SMALL, monkeypatch)


def deploy(s, extra_args=None):
    target = targets.get(s)
    target.submit(target.plan(targets.Job(s, list(extra_args or []), fresh=True)), Runner(echo=False))
    return target


def follow(s, timeout=400):
    return targets.get(s).wait(timeout=timeout, quiet=True)


def max_step(s) -> int:
    status = jobs.read_status(elastic.home(s)) or {"replicas": []}
    return max([r["progress"]["step"] for r in status["replicas"] if r.get("progress")] or [0])


def workers_of(s, replica: int) -> list[int]:
    status = jobs.read_status(elastic.home(s))
    return training_processes(next(r["pid"] for r in status["replicas"] if r["replica"] == replica))


def leftover_processes(state_dir) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = open(f"/proc/{entry}/cmdline").read().replace("\0", " ")
            except OSError:
                continue
            if str(state_dir) in cmdline:
                found.append(cmdline)
    return found


def log_text(s) -> str:
    return "".join(p.read_text(errors="replace") for p in elastic.home(s).glob("runs/*/replicas/*/agent.log"))


@pytest.mark.slow
def test_uninterrupted_then_killed_worker_and_node_finish_with_the_same_accuracy(small, state_dir):
    s = small
    # 1. the reference: an uninterrupted run of the same job
    deploy(s)
    status = follow(s)
    assert status.state == "Succeeded"
    assert [r.state for r in status.replicas] == ["Succeeded", "Succeeded"]  # every agent exited 0 by itself
    reference = elastic.final_result(s)["val_accuracy"]
    assert reference > 0.45, reference  # 4 classes: chance is 0.25

    # 2. the same job, with a worker SIGKILLed and then a whole node killed
    deploy(s, ["--step-delay", "0.25"])
    wait_for(lambda: (elastic.checkpoint_dir(s) / "latest").exists() and max_step(s) >= 6, 240, "a checkpoint")
    victim = wait_for(lambda: workers_of(s, 1), 30, "a worker of node 1")[0]
    parent = open(f"/proc/{victim}/stat").read().rsplit(")", 1)[1].split()[1]
    assert open(f"/proc/{parent}/cmdline").read().startswith("doeks-zygote")  # workers are forks of a preloaded zygote
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: log_text(s).count("resumed from checkpoint") >= 2, 120, "workers resuming from the checkpoint")
    resumed_at = max_step(s)
    wait_for(lambda: max_step(s) > resumed_at + 2, 120, "training to go on after the worker kill")

    node1 = next(r["pid"] for r in jobs.read_status(elastic.home(s))["replicas"] if r["replica"] == 1)
    for pid in [node1] + jobs.descendants(node1):  # the node dies at once: agent and workers
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(lambda: next(r for r in jobs.read_status(elastic.home(s))["replicas"] if r["replica"] == 1)["restarts"] >= 1,
             60, "the supervisor to restart the lost node")
    status = follow(s)
    assert status.state == "Succeeded", status
    assert status.restarts >= 1
    assert targets.get(s).describe().replicas[1].restarts >= 1  # counted per replica too
    result = elastic.final_result(s)
    assert abs(result["val_accuracy"] - reference) <= 0.2, (result["val_accuracy"], reference)
    assert not psutil_like_alive(victim)
    assert "Not a file" not in log_text(s)  # no broken lease renewal of the run's etcd directory (doeks.local.agent)
    wait_for(lambda: not jobs.is_active(elastic.home(s)), 30, "the supervisor to exit")
    services.etcd(state_dir).stop()
    assert leftover_processes(state_dir) == []


def psutil_like_alive(pid: int) -> bool:
    return services.pid_alive(pid)


@pytest.mark.slow
def test_a_healthy_run_logs_no_traceback(state_dir, monkeypatch):
    """doeks' agent fixes torch's etcd run directory as the image's torchrun does (doeks.pod.torchrun): without it, every
    node's log of a healthy run held the traceback of torch's lease thread (issue 21)."""
    s = job_settings({**SMALL, "DATA_TRAIN_PER_CLASS": "40", "DATA_VAL_PER_CLASS": "8", "EPOCHS": "1"}, monkeypatch)
    deploy(s, ["--max-steps", "2"])
    assert follow(s).state == "Succeeded"
    logs = {p.parent.name: p.read_text(errors="replace") for p in elastic.home(s).glob("runs/*/replicas/*/agent.log")}
    assert len(logs) == 2 and all(re.search(r"Rendezvous version \d+ is complete", text) for text in logs.values())
    for node, text in logs.items():
        assert "Traceback" not in text and "Exception in thread" not in text, f"node {node}:\n{text[:3000]}"


@pytest.mark.slow
def test_scale_up_then_down_within_min_max(small, state_dir):
    s = small
    assert invoke("elasticjob.deploy", "--replicas", "1", "--fresh", "--epochs", "6").returncode == 0
    wait_for(lambda: max_step(s) >= 3, 240, "training on one node")
    result = invoke("elasticjob.scale", "--replicas", "2")
    assert result.returncode == 0, result.stderr
    wait_for(lambda: "world=2" in log_text(s), 180, "a second node to join (world size 2)")
    step_at_two = max_step(s)
    wait_for(lambda: max_step(s) > step_at_two + 2, 120, "training to go on with two nodes")
    bad = invoke("elasticjob.scale", "--replicas", "4")
    assert bad.returncode == 1 and "outside MIN_REPLICAS:MAX_REPLICAS" in bad.stderr and "Traceback" not in bad.stderr
    assert invoke("elasticjob.scale", "--replicas", "1").returncode == 0
    wait_for(lambda: any(r["state"] == "Removed" for r in jobs.read_status(elastic.home(s))["replicas"]), 60, "node 1 removed")
    table = invoke("elasticjob.status", env={"COLUMNS": "200"})
    assert "node-1" in table.stderr and "Stopped" in table.stderr and "on local: Running" in table.stderr
    assert invoke("elasticjob.delete").returncode == 0
    assert invoke("elasticjob.delete").returncode == 0  # idempotent
    assert not jobs.is_active(elastic.home(s))
    assert (elastic.checkpoint_dir(s) / "latest").exists()  # checkpoints are kept
    assert invoke("eks.delete").returncode == 0  # stops etcd
    assert leftover_processes(state_dir) == []


@pytest.mark.slow
def test_without_preload_workers_are_fresh_interpreters(small, state_dir):
    assert invoke("elasticjob.deploy", "--replicas", "1", "--fresh", env={"LOCAL_PRELOAD": "false"}).returncode == 0
    wait_for(lambda: max_step(small) >= 1, 240, "a first step")
    status = jobs.read_status(elastic.home(small))
    agent = status["replicas"][0]["pid"]
    worker = workers_of(small, 0)[0]
    assert jobs.children_of(agent) == [worker]  # torchrun's own Popen: no zygote in between
    assert invoke("elasticjob.delete").returncode == 0
    assert invoke("eks.delete").returncode == 0
    assert leftover_processes(state_dir) == []


def test_missing_data_is_one_line_and_starts_nothing(state_dir):
    result = invoke("elasticjob.deploy")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: data folder")
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1  # the refusal before any manifest
    assert "Traceback" not in result.stderr
    assert leftover_processes(state_dir) == []
    assert not (state_dir / "services" / "etcd" / "service.json").exists()


@pytest.mark.parametrize("args,key", [(["--arch", "vgg99"], "--arch 'vgg99'"), (["--replicas", "9"], "--replicas '9'"),
                                      (["--rdzv-backend", "zk"], "--rdzv-backend 'zk'")])
def test_bad_flags_are_one_line_errors(state_dir, args, key):
    result = invoke("elasticjob.deploy", *args)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().startswith(f"error: {key}")  # named as the flag the user typed, not the .env key
    assert len(result.stderr.strip().splitlines()) == 1
    assert leftover_processes(state_dir) == []


def test_etcd_port_taken_is_a_clear_error(small, state_dir, monkeypatch):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = invoke("elasticjob.deploy", env={"ETCD_PORT": str(port)})
    assert result.returncode == 1 and f"port {port}" in result.stderr and "Traceback" not in result.stderr
    assert leftover_processes(state_dir) == []


def test_etcd_unreachable_is_a_clear_error(small, state_dir):
    result = invoke("elasticjob.deploy", env={"ETCD_ENDPOINT": "http://127.0.0.1:9"})
    assert result.returncode == 1 and "unreachable" in result.stderr and "Traceback" not in result.stderr
    assert leftover_processes(state_dir) == []


@pytest.mark.slow
def test_a_lost_peer_costs_no_steps_one_survivor_saves_where_the_job_was(small, state_dir, monkeypatch):
    """A node lost mid-epoch with no periodic checkpoint yet: the survivor's collective fails, it saves the
    state every replica holds (DistributedDataParallel) by itself, and the restart resumes at that step instead of
    training every step since the last checkpoint again (here: from scratch)."""
    s = job_settings({**SMALL, "CHECKPOINT_EVERY": "1000"}, monkeypatch)  # no periodic checkpoint in the first epoch
    deploy(s, ["--step-delay", "0.25"])
    wait_for(lambda: max_step(s) >= 8, 240, "step 8")
    node1 = next(r["pid"] for r in jobs.read_status(elastic.home(s))["replicas"] if r["replica"] == 1)
    for pid in [node1] + jobs.descendants(node1):  # node 1 dies at once, agent and worker (a pod, a node lost)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(lambda: "resumed from checkpoint" in log_text(s), 120, "the workers resuming")
    text = log_text(s)
    saved = re.findall(r"checkpoint step=(\d+) saved by this rank alone in [\d.]+s after (\w+)", text)
    resumed = re.findall(r"resumed from checkpoint step=(\d+)", text)
    assert len(saved) == 1 and int(saved[0][0]) >= 8, (saved, text[-3000:])  # one survivor saved, where it was
    assert resumed and int(resumed[0]) == int(saved[0][0]), (resumed, saved)
    status = follow(s)
    assert status.state == "Succeeded", status
    assert not list(elastic.checkpoint_dir(s).glob(".alone-*"))  # the claim goes with the save

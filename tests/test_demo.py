"""The main job as a user runs it (`invoke demo`), and the scaling experiment, on the local target, for real."""
from __future__ import annotations

import re

import pytest

from .conftest import invoke
from .test_elasticjob_local import leftover_processes

TINY = {"DATA_TRAIN_PER_CLASS": "100", "DATA_VAL_PER_CLASS": "20", "EPOCHS": "2", "COLUMNS": "200"}


@pytest.mark.slow
def test_demo_trains_to_the_end_plots_and_leaves_nothing_running(state_dir):
    result = invoke("demo", env=TINY, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"final validation accuracy: ([\d.]+) \(chance 0.250\)", result.stderr)
    assert match, result.stderr[-2000:]
    plot = re.search(r"plot: (\S+\.png)", result.stderr).group(1)
    from pathlib import Path

    assert Path(plot).stat().st_size > 10_000
    assert Path(plot).resolve().parent == (state_dir / "plots").resolve()  # not in the metrics folder `--fresh` deletes
    assert "world=4" in result.stderr  # 2 nodes x 2 processes
    assert "Traceback" not in result.stderr  # no worker, agent or lease thread failed on the way (or hung at exit)
    # quiet by default: rank 0's progress, no torchelastic INFO, no other rank's copy of each line
    said = result.stderr.strip().splitlines()
    assert len(said) < 40, "\n".join(said)
    assert "[rank 0] step=1 " in result.stderr and "[rank 0] done " in result.stderr
    assert not [line for line in said if " INFO " in line or re.search(r"\[rank [1-9]\]", line)], "\n".join(said)
    assert leftover_processes(state_dir) == []
    status = invoke("elasticjob.status", env=TINY)
    assert "Succeeded" in status.stderr
    verbose = invoke("demo", "-v", env=TINY, timeout=900)  # -v: every node's lines, torchelastic's INFO too
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert "[node-1]" in verbose.stderr and "[rank 3]" in verbose.stderr and " INFO " in verbose.stderr
    assert leftover_processes(state_dir) == []


@pytest.mark.slow
def test_scaling_runs_each_size_and_plots_against_ideal(state_dir, tmp_path):
    assert invoke("elasticjob.data", env=TINY).returncode == 0
    out = tmp_path / "scaling.png"
    result = invoke("elasticjob.scaling", "--replicas", "1,2", "--out", str(out), env={**TINY, "NPROC_PER_NODE": "1"}, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1 nodes x 1 processes: epoch" in result.stderr and "2 nodes x 1 processes: epoch" in result.stderr
    assert out.stat().st_size > 10_000
    assert invoke("eks.delete").returncode == 0
    assert leftover_processes(state_dir) == []


def test_demo_dry_run_prints_the_plan_and_changes_nothing(state_dir):
    import yaml

    result = invoke("demo", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert list(yaml.safe_load_all(result.stdout)) == []  # the local plan: processes and folders, no cluster manifest
    assert "would generate synthetic data" in result.stderr and "would start node 1:" in result.stderr
    assert not state_dir.exists()


@pytest.mark.slow
def test_tensorboard_serves_the_event_files(state_dir):
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    from doeks.services import free_port

    from .conftest import ROOT

    events = state_dir / "volumes" / "fsx-pvc" / "metrics" / "imagenet" / "tensorboard"
    events.mkdir(parents=True)
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(events))
    writer.add_scalar("train/loss", 1.5, 1)
    writer.close()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "invoke", "elasticjob.tensorboard", "--port", str(port)], cwd=ROOT,
                              env=os.environ.copy(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=2) as response:
                    runs = response.read().decode()
                    if "." in runs or "[]" not in runs:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "tensorboard did not serve within 90 s"
            time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5) as response:
            assert "train/loss" in response.read().decode()
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)

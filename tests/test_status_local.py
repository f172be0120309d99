"""Status that explains itself and runs, on the local target for real (torchrun agents, a real etcd): the error
taxonomy (doeks.targets.reasons), permanent errors that end the job without restarts, restarts counted right, a run
per deploy with its own logs, `elasticjob.history`, `elasticjob.describe`, the root `invoke status`."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from doeks import elastic, targets
from doeks import settings as S
from doeks.local import jobs, services
from doeks.runner import Runner
from doeks.targets import reasons, runs

from .conftest import invoke, wait_for
from .test_elasticjob_local import leftover_processes

SMALL = {"DATA_TRAIN_PER_CLASS": "40", "DATA_VAL_PER_CLASS": "8", "REPLICAS": "1", "NPROC_PER_NODE": "1",
         "EPOCHS": "1", "CHECKPOINT_EVERY": "2", "BATCH_SIZE": "8", "MIN_REPLICAS": "1", "MAX_REPLICAS": "2"}

# Lines as torch 2.13 + python-etcd 0.4.5 wrote them when the local etcd was stopped under a running job (agent.log of
# a real run, 2026-11-22), and as argparse and the training script write their errors.
ETCD_GONE = [
    "urllib3.exceptions.MaxRetryError: HTTPConnectionPool(host='127.0.0.1', port=48435): Max retries exceeded with url: "
    "/v2/keys/torchelastic/p2p/run_imagenet-20261122-211853-0297/rdzv/active_version (Caused by NewConnectionError("
    "\"HTTPConnection(host='127.0.0.1', port=48435): Failed to establish a new connection: [Errno 111] Connection refused\"))",
    "etcd.EtcdConnectionFailed: No more machines in the cluster",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
]


def test_taxonomy_decides_permanent_or_transient():
    bad = reasons.classify(["21:00:01.000 [rank 0] process started",
                            "train.py: error: unrecognized arguments: --bogus 1"], [1])
    assert bad.code == "bad-arguments" and bad.permanent and "--bogus 1" in bad.text and "--train-args" in bad.fix
    gone = reasons.classify(ETCD_GONE, [1], failed=True)
    assert (gone.code, gone.text, gone.permanent) == ("rendezvous", "rendezvous server unreachable", False)
    assert "etcd" in gone.fix
    data = reasons.classify(["[rank 0] error: data folder /fsx-shared/data/train is missing or empty (make it ...)"])
    assert data.code == "data-missing" and data.permanent
    assert reasons.classify(["ModuleNotFoundError: No module named 'timm'"]).code == "import-error"
    oom = reasons.classify(["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"])
    assert oom.code == "oom" and not oom.permanent
    assert reasons.classify([], events=["OOMKilled"]).code == "oom"
    assert reasons.classify([], [137]).code == "oom"
    loop = reasons.classify(["RuntimeError: boom"], [1], restarts=4)
    assert loop.code == "crash-loop" and "RuntimeError: boom" in loop.text
    # a permanent line wins over a transient one, whichever comes first
    assert reasons.classify(ETCD_GONE + ["train.py: error: argument --epochs: invalid int value: 'x'"]).permanent
    assert reasons.classify(["step=3 epoch=0 loss=1.2"], [0]) is None


def test_bogus_train_args_fail_at_once_with_argparse_message(state_dir):
    started = time.monotonic()
    result = invoke("elasticjob.deploy", "--train-args", "--bogus 1")
    took = time.monotonic() - started
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --train-args '--bogus 1': train.py: error: "
                                                   "unrecognized arguments: --bogus 1"), result.stderr
    assert took < 15, took
    assert not (state_dir / "jobs").exists() and leftover_processes(state_dir) == []  # nothing started, nothing restarted
    for target in ("docker", "eks", "sagemaker"):  # every target refuses them in its plan
        out = invoke("elasticjob.deploy", "--dry-run", "--train-args", "--epochs abc", env={"TARGET": target})
        assert out.returncode == 1 and "argument --epochs: invalid int value: 'abc'" in out.stderr.strip().splitlines()[-1]


@pytest.fixture
def small(state_dir, monkeypatch):
    for key, value in SMALL.items():
        monkeypatch.setenv(key, value)
    S.reset()
    s = S.current()
    elastic.make_data(s, Runner(echo=False))
    yield s
    jobs.stop(elastic.home(s))
    services.etcd(state_dir).stop()


def test_permanent_error_at_run_time_ends_the_job_without_restarts(small, state_dir):
    """What the plan cannot see (a data path the script finds empty) fails on the first try: the worker exits 2, the
    agent does not restart it, the supervisor does not restart the node; the one-line error names reason and fix."""
    started = time.monotonic()
    result = invoke("elasticjob.deploy", "--follow", "--train-args", f"--data {state_dir / 'nothing'}", timeout=120)
    took = time.monotonic() - started
    own = [line for line in result.stderr.splitlines() if not line.startswith("[node-")]  # not the streamed logs
    assert result.returncode == 1 and not any("Traceback" in line for line in own), result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: job imagenet ended Failed after 0 restarts: data missing: data folder "), last
    assert "(fix: make or stage the data" in last
    assert took < 15, took
    status = targets.get(small).describe()
    assert status.state == "Failed" and status.permanent and status.restarts == 0
    assert [r.restarts for r in status.replicas] == [0]
    assert "attempts left" not in "".join(p.read_text() for p in (elastic.home(small) / "runs").rglob("agent.log"))
    history = invoke("elasticjob.history", env={"COLUMNS": "250"})
    assert history.returncode == 0 and "Failed" in history.stderr and "data missing" in history.stderr

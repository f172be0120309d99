"""Every state a job can start in, with its defined outcome: no checkpoint (train), mid-epoch and end of an epoch
(resume where it stopped), end of training (finish at once with the recorded result), written by another world size
(resume: the rest of the epoch, each sample once), partial or corrupt (fall back to the previous checkpoint, or one
error line). The real script, single process where distribution is not the point; torchrun with 2 gloo processes for
the world-size change. Checkpoints are DCP's step-N/ folders with `latest` (doeks/workload/checkpoints.py); the same
with S3 (moto) and with 4 -> 2 and 4 -> 6 ranks is in test_checkpoints_s3.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from doeks.datastage import relayout_val
from doeks.workload import checkpoints, data
from doeks.workload import train

SCRIPT = Path(train.__file__)
# 2 classes x 8 train images; batch 4 -> 4 steps per epoch on one process, 2 on two


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny") / "data"
    data.generate(root, classes=2, train_per_class=8, val_per_class=2, size=36)
    relayout_val(root)
    return root


@pytest.fixture
def job(dataset, tmp_path, capsys):
    """run(*extra) -> (exit code, log text) of the script in this process, same checkpoint and metrics folders."""
    def run(*extra: str):
        argv = ["--data", str(dataset), "--checkpoint-dir", str(tmp_path / "ck"), "--metrics-dir", str(tmp_path / "m"),
                "--arch", "mobilenet_v3_small", "--epochs", "2", "--batch-size", "4", "--crop-size", "32", "--workers", "0",
                "--checkpoint-every", "1", "--log-every", "1", *extra]
        capsys.readouterr()
        code = train.main(argv)
        return code, capsys.readouterr().out

    run.ck = tmp_path / "ck"
    run.final = tmp_path / "m" / "final.json"
    return run


def _state(job) -> dict:
    """The meta of the checkpoint `latest` names (step, epoch, consumed, result...)."""
    store = checkpoints.Store(job.ck)
    return store.read_meta(store.latest())


def test_no_checkpoint_trains_from_scratch_and_records_the_result(job):
    code, out = job("--max-steps", "3")
    assert code == 0 and "resumed" not in out
    state = _state(job)
    assert (state["step"], state["epoch"], state["consumed"]) == (3, 0, 12)
    assert state["result"]["step"] == 3 and json.loads(job.final.read_text())["step"] == 3
    # one DCP checkpoint per save (every step here), the older ones pruned to --keep-checkpoints (3)
    assert sorted(p.name for p in job.ck.iterdir()) == ["latest", "step-1", "step-2", "step-3"]
    assert (job.ck / "latest").read_text() == "step-3\n" and (job.ck / "step-3" / ".metadata").exists()


def test_mid_epoch_resumes_at_the_next_sample(job):
    job("--max-steps", "3")
    code, out = job("--max-steps", "5")
    assert code == 0 and "resumed from checkpoint step=3 epoch=0 consumed=12" in out
    assert "step=4 epoch=0" in out and "step=1 " not in out
    assert json.loads(job.final.read_text())["step"] == 5


def test_end_of_an_epoch_goes_on_with_the_next_epoch(job):
    code, _ = job("--epochs", "1")
    assert code == 0 and _state(job)["epoch"] == 1 and _state(job)["consumed"] == 0
    code, out = job("--epochs", "2")
    assert code == 0 and "resumed from checkpoint step=4 epoch=1 consumed=0" in out
    assert "step=5 epoch=1" in out and json.loads(job.final.read_text())["step"] == 8


def test_finished_job_deployed_again_reports_the_recorded_result_at_once(job):
    code, _ = job("--epochs", "1")
    recorded = json.loads(job.final.read_text())
    job.final.unlink()
    written = (job.ck / "latest").stat().st_mtime_ns
    code, out = job("--epochs", "1")
    assert code == 0
    assert f"training already finished at step=4 epoch=1: val_acc={recorded['val_accuracy']:.4f}" in out
    assert "step=5" not in out and "start host=" not in out  # no process group, no data, no training
    assert json.loads(job.final.read_text()) == recorded  # the recorded result, written again for this deploy
    assert (job.ck / "latest").stat().st_mtime_ns == written and "step-5" not in os.listdir(job.ck)


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(job):
    job("--max-steps", "3")  # step-1, step-2, step-3 (the final one, with the result)
    (data_file,) = (job.ck / "step-3").glob("*.distcp")
    data_file.write_bytes(data_file.read_bytes()[: data_file.stat().st_size // 2])  # complete, then cut in the middle
    (job.ck / "step-4").mkdir()
    (job.ck / "step-4" / "__0_0.distcp").write_bytes(b"half a write that died")  # no .metadata: never complete
    code, out = job("--max-steps", "4")
    assert code == 0, out
    assert "step-3 (" in out and "is partial or corrupt: resuming from step-2 instead" in out
    assert "resumed from checkpoint step=2 epoch=0 consumed=8" in out
    assert "removed step-3, step-4" in out  # nothing after the one resumed from is left
    # and no prefix is written twice: step-4 was seen (the write that died), so the save at step 4 is step-4.1
    assert (job.ck / "latest").read_text() == "step-4.1\n"
    assert checkpoints.Store(job.ck).read_meta("step-4.1")["result"]["step"] == 4


@pytest.mark.parametrize("damage", ["truncated", "garbage", "not a checkpoint"])
def test_unusable_checkpoint_and_no_previous_is_one_error_line(job, damage):
    import torch
    import torch.distributed.checkpoint as dcp

    path = job.ck / "step-2"
    if damage == "not a checkpoint":  # a DCP checkpoint, but not one of this job: no meta in it
        dcp.save({"weights": torch.zeros(2)}, checkpoint_id=str(path), no_dist=True)
    else:
        job("--max-steps", "2", "--keep-checkpoints", "1")  # step-2 alone
        assert sorted(p.name for p in job.ck.iterdir()) == ["latest", "step-2"]
        for each in path.glob("*.distcp"):
            each.write_bytes(each.read_bytes()[:40] if damage == "truncated" else os.urandom(300))
    code, out = job("--max-steps", "3")
    errors = [line for line in out.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in out, out
    # the verdict first, then the library's words (a reason line keeps the first 200 characters), then what to do
    assert f"checkpoint {path} is partial or corrupt and there is no earlier one (" in errors[0], errors[0]
    assert f"move {job.ck} away to start from scratch" in errors[0]


def test_checkpoint_of_another_model_is_one_error_line(job):
    job("--max-steps", "1")
    code, out = job("--arch", "resnet18")
    assert code == 2 and "error: checkpoint" in out and "is of a mobilenet_v3_small, this job trains a resnet18" in out


def test_checkpoint_write_runs_beside_training(tmp_path):
    """The stall is the copy to CPU memory; serialising and fsync happen on DCP's writer thread, and `latest` moves
    once the checkpoint is complete."""
    import torch

    store = checkpoints.Store(tmp_path)
    state = {"model": {"w": torch.randn(4_000_000)}}
    store.save(state, 1, {"epoch": 0})
    assert store.in_flight == "step-1" or store.latest() == "step-1"  # returned while the write is in flight (or done)
    state["model"]["w"].zero_()  # training goes on and changes the weights: the checkpoint keeps the copy
    store.wait()
    assert store.latest() == "step-1" and store.complete() == ["step-1"]
    saved = {"model": {"w": torch.zeros(4_000_000)}}
    store.load(saved, "step-1")
    assert saved["model"]["w"].abs().sum() > 0


def test_a_periodic_checkpoint_due_while_the_last_is_being_written_is_passed_over(tmp_path):
    """when_busy="skip": nothing saved, None at once (no wait for the write in flight), counted; "wait" (the default)
    waits and saves. Training does not stall on a checkpoint the storage has not taken yet."""
    import torch

    store = checkpoints.Store(tmp_path, keep=5)
    state = {"model": {"w": torch.randn(8_000_000)}}
    store.save(state, 1)
    if store.in_flight is None:
        pytest.skip("the write ended before the next save was asked (a very fast disk)")
    started = time.perf_counter()
    assert store.save(state, 2, when_busy="skip") is None and time.perf_counter() - started < 0.05
    assert store.skipped == 1 and store.in_flight == "step-1"
    assert store.save(state, 3) is not None  # waits for step-1, then saves
    store.wait()
    assert store.complete() == ["step-1", "step-3"] and store.latest() == "step-3"


def test_the_job_with_when_busy_skip_trains_to_the_end_and_counts_what_it_skipped(job):
    code, out = job("--max-steps", "3", "--checkpoint-when-busy", "skip")
    assert code == 0 and "checkpoints_skipped=" in out
    assert _state(job)["step"] == 3  # the final checkpoint is never skipped


_AGREE = """
import os, sys, threading
import torch.distributed as dist
from doeks.workload import checkpoints
dist.init_process_group("gloo")
store = checkpoints.Store(sys.argv[1])
rank = dist.get_rank()
if rank == 0:  # a write in flight on rank 0 only (as when rank 1's part ended first)
    store._done, store._pending_step = threading.Event(), "step-5"
first = store.pass_if_busy()
if rank == 0:
    store._done.set()
second = store.pass_if_busy()
print(f"rank {rank}: {first} {second} skipped={store.skipped}")
dist.destroy_process_group()
"""


def test_every_rank_passes_over_a_busy_checkpoint_together(tmp_path):
    """A save is collective: when one rank's write is still in flight, every rank passes the checkpoint over (one
    all-reduce), or a rank would enter DCP's collectives alone and hang."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    ranks = [subprocess.Popen([sys.executable, "-c", _AGREE, str(tmp_path)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [r.communicate(timeout=120) for r in ranks]
    assert all(r.returncode == 0 for r in ranks), outs
    assert [o[0].strip() for o in outs] == ["rank 0: True False skipped=1", "rank 1: True False skipped=1"], outs


@pytest.mark.slow  # torchrun with 2 processes: ~15 s on a quiet 2-core machine, more when it is shared
def test_checkpoint_of_another_world_size_resumes_the_rest_of_the_epoch(job, dataset, tmp_path):
    """Written by 1 process after 1 step (4 samples); resumed by torchrun with 2 gloo processes: the remaining
    12 samples of epoch 0 at a global batch of 8 -> 1 more step (the ragged 4 are dropped), then epoch 1 in 2."""
    code, _ = job("--max-steps", "1")
    assert code == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
            "--data", str(dataset), "--checkpoint-dir", str(job.ck), "--metrics-dir", str(tmp_path / "m"),
            "--arch", "mobilenet_v3_small", "--epochs", "2", "--batch-size", "4", "--crop-size", "32", "--workers", "0",
            "--checkpoint-every", "1", "--log-every", "1"]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "resumed from checkpoint step=1 epoch=0 consumed=4 (written by world size 1, now 2)" in out
    assert "step=2 epoch=0" in out and "step=3 epoch=1" in out and "world=2" in out
    assert json.loads((tmp_path / "m" / "final.json").read_text())["step"] == 4


@pytest.mark.slow
def test_local_job_deployed_again_after_it_finished_succeeds_at_once(state_dir):
    """The same through the local target: `elasticjob.deploy` of a finished job (no --fresh) succeeds with the
    recorded result, every worker leaving before any training."""
    from .conftest import invoke
    from .test_elasticjob_local import leftover_processes

    env = {"DATA_TRAIN_PER_CLASS": "24", "DATA_VAL_PER_CLASS": "6", "EPOCHS": "1", "REPLICAS": "1", "NPROC_PER_NODE": "1",
           "MIN_REPLICAS": "1", "BATCH_SIZE": "8", "ARCH": "mobilenet_v3_small", "COLUMNS": "200"}
    assert invoke("elasticjob.data", env=env).returncode == 0
    first = invoke("elasticjob.deploy", "--follow", env=env, timeout=400)
    assert first.returncode == 0 and "succeeded" in first.stderr, first.stderr[-2000:]
    start = time.monotonic()
    again = invoke("elasticjob.deploy", "--follow", env=env, timeout=400)
    assert again.returncode == 0 and "succeeded" in again.stderr, again.stderr[-2000:]
    assert "training already finished at step=12 epoch=1" in again.stderr  # (its log also shows the first run)
    assert time.monotonic() - start < 60
    assert invoke("elasticjob.delete", env=env).returncode == 0 and invoke("eks.delete", "--yes", env=env).returncode == 0
    assert leftover_processes(state_dir) == []


def test_the_two_line_helper_resumes_a_model_and_its_optimizer(tmp_path, monkeypatch):
    """doeks.checkpoints() as a user's script calls it (docs/your-own-script.md): DOEKS_CHECKPOINT_URI from the
    environment, {"model", "optimizer"} saved through DCP's state_dict API and loaded back in place, momentum too."""
    import torch

    import doeks

    monkeypatch.setenv("DOEKS_CHECKPOINT_URI", str(tmp_path / "mine"))
    monkeypatch.setenv("DOEKS_KEEP_CHECKPOINTS", "2")

    def fresh():
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, optimizer = fresh()
    ck = doeks.checkpoints()
    assert ck.resume({"model": model, "optimizer": optimizer}) is None  # nothing yet: start from scratch
    for step in range(1, 4):
        model(torch.randn(5, 8)).sum().backward()
        optimizer.step()
        ck.save({"model": model, "optimizer": optimizer}, step, {"epoch": 0})
    ck.wait()
    assert ck.complete() == ["step-2", "step-3"] and ck.latest() == "step-3"

    again, again_optimizer = fresh()
    meta = doeks.checkpoints().resume({"model": again, "optimizer": again_optimizer})
    assert meta == {"epoch": 0, "step": 3}
    for mine, theirs in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(mine, theirs)
    momentum = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    assert all(torch.equal(a, again_optimizer.state[p]["momentum_buffer"]) for a, p in zip(momentum, again.parameters()))

"""Status that explains itself and runs, on the local target for real (torchrun agents, a real etcd): the error
taxonomy (doeks.pod.reasons), permanent errors that end the job without restarts, restarts counted right, a run
per deploy with its own logs, `elasticjob.history`, `elasticjob.describe`, the root `invoke status`."""
from __future__ import annotations

import json
import os
import signal

import pytest

from doeks import elastic, targets
from doeks import services
from doeks.local import jobs
from doeks.pod import reasons
from doeks.targets import runs

from .conftest import invoke, job_settings, training_processes, wait_for
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
    result = invoke("elasticjob.deploy", "--train-args", "--bogus 1")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --train-args '--bogus 1': train.py: error: "
                                                   "unrecognized arguments: --bogus 1"), result.stderr
    assert not (state_dir / "jobs").exists() and leftover_processes(state_dir) == []  # nothing started, nothing restarted
    for target in ("docker", "eks", "sagemaker"):  # every target refuses them in its plan
        out = invoke("elasticjob.deploy", "--dry-run", "--train-args", "--epochs abc", env={"TARGET": target})
        assert out.returncode == 1 and "argument --epochs: invalid int value: 'abc'" in out.stderr.strip().splitlines()[-1]


@pytest.fixture
def small(state_dir, monkeypatch):
    s = job_settings(SMALL, monkeypatch)
    yield s
    jobs.stop(elastic.home(s))
    services.etcd(state_dir).stop()


def test_permanent_error_at_run_time_ends_the_job_without_restarts(small, state_dir):
    """What the plan cannot see (a data path the script finds empty) fails on the first try: the worker exits 2, the
    agent does not restart it, the supervisor does not restart the node; the one-line error names reason and fix."""
    result = invoke("elasticjob.deploy", "--follow", "--train-args", f"--data {state_dir / 'nothing'}", timeout=600)
    own = [line for line in result.stderr.splitlines() if not line.startswith("[node-")]  # not the streamed logs
    assert result.returncode == 1 and not any("Traceback" in line for line in own), result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: job imagenet ended Failed after 0 restarts: data missing: data folder "), last
    assert "(fix: make or stage the data" in last
    status = targets.get(small).describe()
    assert status.state == "Failed" and status.permanent and status.restarts == 0
    assert [r.restarts for r in status.replicas] == [0]
    logged = "".join(p.read_text() for p in (elastic.home(small) / "runs").rglob("agent.log"))
    assert logged.count("error: data folder") == 1, logged  # the worker ran once: torchrun did not restart it
    assert "==== doeks: replica 0 start #1" not in logged  # nor the supervisor the node
    history = invoke("elasticjob.history", env={"COLUMNS": "250"})
    assert history.returncode == 0 and "Failed" in history.stderr and "data missing" in history.stderr


def test_two_runs_logs_show_the_second_history_lists_both(small, state_dir):
    first = deploy_and_wait(small, ["--max-steps", "1", "--log-every", "1"])
    second = deploy_and_wait(small, ["--max-steps", "2", "--log-every", "1"])
    assert first != second
    out = invoke("elasticjob.logs")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("==== doeks: replica 0 start #0") == 1  # one run, not a replay of every earlier one
    assert "step=2 " in out.stdout and "--max-steps 1" not in out.stdout
    earlier = invoke("elasticjob.logs", "--run", first)
    assert earlier.returncode == 0 and "step=1 " in earlier.stdout and "step=2 " not in earlier.stdout
    tail = invoke("elasticjob.logs", "--tail", "3")
    assert tail.returncode == 0 and tail.stdout.splitlines() == out.stdout.splitlines()[-3:]
    assert invoke("elasticjob.logs", "--since", "1h").stdout == out.stdout
    assert invoke("elasticjob.logs", "--since", "0s").stdout == ""
    for flags, message in ((["--replica", "7"], "error: --replica 7: job imagenet has replicas 0"),
                           (["--run", "nope"], f"error: --run nope: job imagenet has logs of runs {first}, {second}"),
                           (["--tail", "-1"], "error: --tail -1: expected an integer from 0")):
        bad = invoke("elasticjob.logs", *flags)
        assert bad.returncode == 1 and bad.stderr.strip().splitlines()[0].startswith(message), (flags, bad.stderr)
        assert len(bad.stderr.strip().splitlines()) == 1
    history = invoke("elasticjob.history", env={"COLUMNS": "250"})
    rows = [line for line in history.stderr.splitlines() if first in line or second in line]
    assert len(rows) == 2 and all("Succeeded" in row and "local" in row for row in rows), history.stderr
    recorded = json.loads(runs.index_path(small).read_text())
    assert [r["run"] for r in recorded] == [first, second] and all(r["end"] >= r["start"] for r in recorded)


def deploy_and_wait(s, args, timeout=120) -> str:
    result = invoke("elasticjob.deploy", "--follow", "--train-args", " ".join(args), timeout=timeout)
    assert result.returncode == 0, result.stderr[-2000:]
    return targets.get(s).describe().run


def workers(s) -> list[int]:
    status = jobs.read_status(elastic.home(s)) or {"replicas": []}
    return training_processes(*(r["pid"] for r in status["replicas"] if r.get("pid")))


def test_killed_workers_in_a_crash_loop_are_counted_and_named(small, state_dir):
    """torchrun restarts a node's workers itself (the node's agent lives on): those restarts count too, per replica
    and for the job; three of them with no step in between is a crash loop, with the fix. The workers log no step
    while the test reads the job (--step-delay 600: a step logged after the last kill ends the crash loop, as it
    should, and on a busy machine `describe` and `status` took longer than the 5 s delay this test once had)."""
    assert invoke("elasticjob.deploy", "--train-args", "--step-delay 600 --log-every 1").returncode == 0
    killed = set()
    for _ in range(3):
        victim = wait_for(lambda: [p for p in workers(small) if p not in killed], 300, "a (new) worker")[0]
        os.kill(victim, signal.SIGKILL)
        killed.add(victim)
        wait_for(lambda: not services.pid_alive(victim), 300, "the worker to die")
    wait_for(lambda: targets.get(small).describe().restarts >= 3, 300, "three restarts counted")
    # Restarting while torchrun brings the workers back (issue 32), Running once it has
    status = wait_for(lambda: (now := targets.get(small).describe()).state == "Running" and now, 120,
                      "the last restart to finish (Running again)")
    assert status.replicas[0].restarts >= 3
    assert status.reason.startswith("crash loop: ") and "elasticjob.logs" in status.fix
    shown = invoke("elasticjob.describe", env={"COLUMNS": "250"})
    assert shown.returncode == 0 and "reason: crash loop" in shown.stderr and "replica 0 started" in shown.stderr
    root = invoke("status", env={"COLUMNS": "250"})
    assert root.returncode == 0 and "job imagenet on local: Running" in root.stderr and "crash loop" in root.stderr
    assert invoke("elasticjob.delete").returncode == 0


@pytest.mark.parametrize("code,runs_expected", [(2, 1), (1, 3)])
def test_local_agent_does_not_restart_a_permanent_exit(tmp_path, code, runs_expected):
    """doeks.local.agent (torchrun) restarts failed workers (here --max-restarts 2: three runs), except those that
    exit 2, the training script's and argparse's code for an error no restart can fix."""
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(f"import sys\nprint('worker ran', flush=True)\nsys.exit({code})\n")
    env = {**os.environ, "DOEKS_PRELOAD": "0", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "doeks.local.agent", "--standalone", "--nproc-per-node", "1",
                             "--max-restarts", "2", "--monitor-interval", "0.1", str(script)],
                            capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert output.count("worker ran") == runs_expected, output[-3000:]
    assert output.count("doeks: worker group failed") == runs_expected - 1  # what the restart counts read


@pytest.mark.slow
def test_etcd_killed_mid_job_is_named_with_the_fix(small, state_dir):
    """The rendezvous server dies under a training job: the node fails and is restarted until its MAX_RESTARTS (2
    here: each restart is ~2.5 s of a refused rendezvous, and 10 added ~20 s that showed nothing more), and the job
    ends Failed with "rendezvous server unreachable" and how to bring etcd back, not the generic restart limit."""
    assert invoke("elasticjob.deploy", "--train-args", "--step-delay 0.3 --log-every 1",
                  env={"MAX_RESTARTS": "2"}).returncode == 0
    wait_for(lambda: (targets.get(small).describe().replicas or [None])[0] and
             (targets.get(small).describe().replicas[0].step or 0) >= 2, 120, "two steps")
    services.etcd(state_dir).stop()
    status = wait_for(lambda: (lambda st: st if st.finished else None)(targets.get(small).describe()), 180,
                      "the job to end")
    assert status.state == "Failed" and status.reason == "rendezvous server unreachable", status
    assert "etcd" in status.fix and "invoke eks.create" in status.fix and not status.permanent
    shown = invoke("elasticjob.status", env={"COLUMNS": "250"})
    assert "reason: rendezvous server unreachable" in shown.stderr and "fix: etcd is down" in shown.stderr


def _ends_with(result, job: str, reason: str) -> str:
    """The deploy --follow ended at once (no restart) with the one-line error naming `reason`; the line."""
    own = [line for line in result.stderr.splitlines() if not line.startswith("[node-")]
    assert result.returncode == 1 and not any("Traceback" in line for line in own), result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: job {job} ended Failed after 0 restarts: {reason}"), last
    return last


@pytest.mark.slow
@pytest.mark.parametrize("code, reason", [
    ("import doeks_no_such_module\n", "import error: ModuleNotFoundError: No module named 'doeks_no_such_module'"),
    ("open('/nonexistent/doeks/labels.csv')\n",
     "missing file: FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/doeks/labels.csv'"),
], ids=["import-error", "missing-file"])
def test_a_script_that_cannot_start_ends_at_once_with_the_reason_its_real_log_shows(small, tmp_path, code, reason):
    """The import-error and missing-file rules, from what Python itself writes in a real torchrun worker's log."""
    script = tmp_path / "project" / "fit.py"
    script.parent.mkdir()
    script.write_text(code)
    result = invoke("elasticjob.deploy", "--follow", env={"TRAIN_SCRIPT": str(script), "TRAIN_ARGS": ""}, timeout=180)
    _ends_with(result, "fit", reason)  # the job's name is its script's


@pytest.mark.slow
def test_a_corrupt_checkpoint_ends_at_once_as_unusable(small):
    """The bad-checkpoint rule, from the training script's own error on a checkpoint that is not one."""
    folder = elastic.checkpoint_dir(small) / "step-5"  # complete (it has a .metadata), but not a checkpoint
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".metadata").write_bytes(b"not a checkpoint\n" * 64)
    result = invoke("elasticjob.deploy", "--follow", timeout=180)
    last = _ends_with(result, "imagenet", "unusable checkpoint: checkpoint ")
    assert "partial or corrupt" in last and "(fix: move the checkpoint folder away or deploy with --fresh)" in last


@pytest.mark.slow
def test_a_validation_folder_of_files_is_named_before_and_in_the_log_as_data_laid_out_wrong(small, tmp_path):
    """ImageNet's val/ as it comes (files, no class folders): the deploy refuses it up front with one line; in a folder
    the plan cannot see (--data), the data-layout rule names it from the training script's real log."""
    import shutil

    from doeks.local import runtime

    data = runtime.shared_volume(small) / "data"
    other = tmp_path / "other"
    shutil.copytree(data, other)

    def flatten(root):
        for image in [p for p in (root / "val").rglob("*") if p.is_file()]:
            image.rename(root / "val" / f"{image.parent.name}-{image.name}")

    flatten(other)
    result = invoke("elasticjob.deploy", "--follow", "--train-args", f"--data {other}", timeout=180)
    last = _ends_with(result, "imagenet", "data laid out wrong: ")
    assert "holds files, not class folders" in last and "--relayout-val" in last
    flatten(data)
    runs = sorted((elastic.home(small) / "runs").iterdir())
    refused = invoke("elasticjob.deploy", timeout=120)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and len(lines) == 1 and "holds files, not class folders" in lines[0], refused.stderr
    assert sorted((elastic.home(small) / "runs").iterdir()) == runs  # nothing started

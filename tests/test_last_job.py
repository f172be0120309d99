"""The job tasks act on the job last deployed from here (doeks.lastjob): a shell without the deploy's TRAIN_SCRIPT
once stopped the demo's `imagenet` job and left the one just deployed running. Real jobs on the local target."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

from doeks import elastic
from doeks.local import jobs

from .conftest import ROOT, invoke, job_settings, wait_for

SMALL = {"REPLICAS": "1", "MIN_REPLICAS": "1", "MAX_REPLICAS": "1", "NPROC_PER_NODE": "1", "MAX_RESTARTS": "0",
         "TARGET": "local"}


def test_status_and_delete_act_on_the_job_last_deployed_without_a_name(tmp_path, state_dir, monkeypatch):
    s = job_settings(SMALL, monkeypatch)
    scripts = []
    for name in ("alpha", "beta"):  # two jobs of the user's own, named after their scripts
        script = tmp_path / "project" / f"{name}.py"
        script.parent.mkdir(exist_ok=True)
        shutil.copyfile(ROOT / "examples" / "ddp-plain" / "train.py", script)
        scripts.append(script)
        deployed = invoke("elasticjob.deploy", env={"TRAIN_SCRIPT": str(script),
                                                    "TRAIN_ARGS": "--steps 100000 --step-delay 0.2"})
        assert deployed.returncode == 0, deployed.stderr[-3000:]
    alpha, beta = (elastic.home(s.with_overrides(job_name=name)) for name in ("alpha", "beta"))
    assert jobs.is_active(alpha) and jobs.is_active(beta)

    status = invoke("elasticjob.status", env={"COLUMNS": "200"})  # this shell names no job: the last deployed
    assert status.returncode == 0, status.stderr
    assert "job beta (last deployed to TARGET=local from here" in status.stderr.splitlines()[0], status.stderr
    assert "job beta on local:" in status.stderr and "imagenet" not in status.stderr

    unknown = invoke("elasticjob.delete", "--job-name", "gamma")
    assert unknown.returncode == 1 and "Traceback" not in unknown.stderr
    assert unknown.stderr.strip().splitlines()[-1] == ("error: --job-name gamma: no such job on TARGET=local; the jobs "
                                                       "deployed from here: alpha, beta"), unknown.stderr

    deleted = invoke("elasticjob.delete")
    assert deleted.returncode == 0, deleted.stderr
    assert "job beta (last deployed" in deleted.stderr
    wait_for(lambda: not jobs.is_active(beta), 30, "job beta to stop")
    assert jobs.is_active(alpha)  # the other job is left as it is
    assert invoke("elasticjob.delete", "--job-name", "alpha").returncode == 0
    wait_for(lambda: not jobs.is_active(alpha), 30, "job alpha to stop")
    history = invoke("elasticjob.history", env={"COLUMNS": "250"})  # still beta's, the last deployed
    assert "job beta: 1 runs" in history.stderr, history.stderr


def test_logs_follow_ends_with_the_runs_result(tmp_path, state_dir, monkeypatch):
    """`elasticjob.logs --follow` streams until the job ends, then says how it ended: state, steps, time, model."""
    job_settings(SMALL, monkeypatch)
    script = tmp_path / "project" / "fit.py"
    script.parent.mkdir()
    shutil.copyfile(ROOT / "examples" / "ddp-plain" / "train.py", script)
    env = {"TRAIN_SCRIPT": str(script), "TRAIN_ARGS": "--steps 6 --step-delay 0.5"}
    assert invoke("elasticjob.deploy", "--fresh", env=env).returncode == 0
    followed = invoke("elasticjob.logs", "--follow", timeout=300)  # the last deployed job: fit
    assert followed.returncode == 0, followed.stderr
    assert "[node-0]" in followed.stdout
    last = followed.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"job fit Succeeded: 6 steps in \d+s; model: {re.escape(str(state_dir))}/volumes/fsx-pvc/"
                        r"models/fit/model\.pt", last), followed.stderr


def test_fresh_removes_the_previous_model_too_and_messages_name_s3(state_dir, monkeypatch):
    """`deploy --fresh` starts over: the previous run's model.pt goes with its checkpoints and metrics (a model.pt
    found afterwards is the new run's), in the volume's folder and in S3 (doeks' moto server on the local target);
    with CHECKPOINT_URI=s3://... the messages name S3, not the volume's empty folder."""
    from doeks import aws
    from doeks import settings as S

    s = job_settings(SMALL, monkeypatch)
    models, checkpoints = Path(elastic.model_uri(s)), elastic.checkpoint_dir(s)
    for folder in (models, checkpoints):
        folder.mkdir(parents=True)
    (models / "model.pt").write_bytes(b"old")
    (models / "notes.txt").write_text("the user's")
    (checkpoints / "latest").write_text("step-4\n")
    plan = invoke("elasticjob.deploy", "--fresh", "--dry-run")
    assert "remove checkpoints, metrics and model.pt of imagenet" in plan.stderr, plan.stderr
    elastic.clear_outputs(s)
    assert not (models / "model.pt").exists() and not checkpoints.exists() and (models / "notes.txt").exists()

    monkeypatch.setenv("CHECKPOINT_URI", "s3://fresh-bucket/ckpt")
    monkeypatch.setenv("MODEL_URI", "s3://fresh-bucket/models")
    S.reset()
    s3s = S.current()
    s3 = aws.client(s3s, "s3")  # the local target's moto server, started here
    s3.create_bucket(Bucket="fresh-bucket", CreateBucketConfiguration={"LocationConstraint": s3s.aws_region})
    for key in ("ckpt/imagenet/step-4/.metadata", "ckpt/imagenet/latest", "models/imagenet/model.pt",
                "models/other/model.pt"):
        s3.put_object(Bucket="fresh-bucket", Key=key, Body=b"x")
    elastic.clear_outputs(s3s)
    left = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="fresh-bucket").get("Contents", []))
    assert left == ["models/other/model.pt"], left  # another job's model stays
    stopped = invoke("elasticjob.delete")  # nothing running: it says where the checkpoints are kept
    assert "checkpoints kept in s3://fresh-bucket/ckpt/imagenet" in stopped.stderr, stopped.stderr

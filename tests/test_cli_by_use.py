"""Defects found by using the CLI as a new user would (review of issues 12 item 4 and 15), each with the test that
fails without its fix."""
from __future__ import annotations

import os
from pathlib import Path
import signal

import pytest

from doeks import settings as S
from doeks import targets
from doeks.targets import runs

from .conftest import invoke, wait_for
from .test_cli_errors import no_credentials, run_cli  # noqa: F401 - botocore's chain finding nothing
from .test_status_local import small, workers  # noqa: F401 - the fixture of a tiny local job, its workers' pids


def test_history_run_ids_are_whole_when_piped(state_dir):
    # `elasticjob.history` is where a user copies the id `logs --run` takes; piped (a script, `| grep`, CI) rich cut
    # its cells at 80 columns to `20261122-2…`, an id no command accepts
    s = S.current()
    run = "20261122-221045-74c2"
    runs.start(s, "local", run)
    result = invoke("elasticjob.history", env={"TARGET": "local", "COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    assert run in result.stderr and "…" not in result.stderr, result.stderr
    line = next(line for line in result.stderr.splitlines() if run in line)
    assert "Running" in line and "local" in line


def test_logs_tail_is_per_replica(state_dir):
    # `logs --tail 2` after a run whose node-0 failed: the cursor lists node-0's lines, then node-1's, and the last 2
    # of all were node-1's alone, so the failing node never showed (eks: kubectl's --tail is per container)
    run = "20261122-221045-74c2"
    home = state_dir / "jobs" / "imagenet"
    for replica, last in ((0, "train.py: error: data folder is empty"), (1, "waiting for peers")):
        folder = home / "runs" / run / "replicas" / str(replica)
        folder.mkdir(parents=True)
        (folder / "agent.log").write_text("".join(f"22:10:0{i}.000 line {i}\n" for i in range(5)) + f"22:10:09.000 {last}\n")
    (home / "run").write_text(run)
    result = invoke("elasticjob.logs", "--tail", "2", env={"TARGET": "local"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[node-0] 22:10:04.000 line 4", "[node-0] 22:10:09.000 train.py: error: data folder is empty",
                                          "[node-1] 22:10:04.000 line 4", "[node-1] 22:10:09.000 waiting for peers"], result.stdout


def test_steps_and_port_flags_are_checked_for_range(state_dir):
    # `kubeflow.pipeline.run --steps -3 --dry-run` printed steps -3 (the script's --max-steps: 0 = all epochs) and
    # `elasticjob.tensorboard --port 70000` ended 0 after TensorBoard's own "cannot bind" lines
    env = {"TARGET": "local", "REGISTRY": "123456789012.dkr.ecr.us-west-2.amazonaws.com"}
    for args, line in ((["kubeflow.pipeline.run", "--steps", "-3", "--dry-run"], "error: --steps -3: expected an integer from 0 to 1000000000"),
                       (["kubeflow.pipeline.compile", "--steps", "-3"], "error: --steps -3: expected an integer from 0 to 1000000000"),
                       (["elasticjob.tensorboard", "--port", "70000"], "error: --port 70000: expected an integer from 1 to 65535")):
        result = invoke(*args, env=env, timeout=60)
        assert result.returncode == 1 and result.stderr.strip().splitlines() == [line], (args, result.stdout, result.stderr)
    assert not (state_dir / "pipelines").exists()  # nothing compiled
    ok = invoke("kubeflow.pipeline.run", "--steps", "0", "--dry-run", env=env)
    assert ok.returncode == 0 and '"steps": 0' in ok.stdout, ok.stderr


# lines as doeks/workload/train.py writes them (copied from a local run: EPOCHS=1, 200 images, 2 nodes x 2)
NODE0_LOG = """\
22:10:04.534 [rank 0] start host=vm world_size=4 local_rank=0 device=cpu workers=0 crop=32 amp=off restart=0
22:10:05.892 [rank 0] step=1 epoch=0 loss=1.3520 acc=0.375 samples/s=96.9 world=4 data_wait=0.0087s (1%) lr=0.02149
22:10:06.860 [rank 0] epoch=0 val_acc=0.3000 val_top5=1.0000 step=3
22:10:07.106 [rank 0] checkpoint step=3 stall=24.4ms
22:10:07.107 [rank 0] done final_val_acc=0.3000 val_top5=1.0000 steps=3 checkpoint_stall_max=24.4ms
"""


def test_status_step_is_the_last_step_the_script_named(tmp_path):
    # `elasticjob.status` after that run showed step 1 on both nodes (the only `step=` line; one is written every
    # --log-every steps) though the job had ended at step 3; a resumed, finished job showed no step at all
    from doeks.local.jobs import last_progress, parse_progress

    log = tmp_path / "agent.log"
    log.write_text(NODE0_LOG)
    assert last_progress(log) == {"step": 3, "epoch": 0, "loss": 1.352, "samples_per_s": 96.9, "world": 4}
    finished = ("22:10:50.672 [rank 3] training already finished at step=3 epoch=1: val_acc=0.3000 "
                "(recorded in /x/checkpoints/imagenet/step-3)\n")
    assert parse_progress(finished) == {"step": 3}
    assert parse_progress(NODE0_LOG.splitlines(keepends=True)[1])["step"] == 1
    assert parse_progress("22:10:04 [rank 0] start host=vm world_size=4\n") is None


def test_describe_shows_torchrun_restarting_workers(small, state_dir):
    # a killed worker: status counted 1 restart on node-0, but describe's events (the supervisor's record) showed only
    # "replica 0 started": the restart that status counts was nowhere among the events
    assert invoke("elasticjob.deploy", "--train-args", "--step-delay 2 --log-every 1").returncode == 0

    def settled():  # every node in the round and stepping: a worker killed while an early round is being replaced
        status = targets.get(small).describe()  # (a node joining late) is stopped by torchrun anyway, not failed
        return status.replicas and all(r.step and r.world == small.replicas * small.nproc_per_node
                                       for r in status.replicas)

    wait_for(settled, 90, "every node training in the full world")
    victim = wait_for(lambda: workers(small), 60, "a worker")[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: targets.get(small).describe().restarts >= 1, 60, "the restart counted")
    shown = wait_for(lambda: (lambda r: r if "workers restarted by torchrun (1 so far)" in r.stderr else None)(
        invoke("elasticjob.describe", env={"COLUMNS": "250"})), 10, "the restart among the events")
    assert shown.returncode == 0 and "replica 0 started" in shown.stderr
    assert invoke("elasticjob.delete").returncode == 0


def test_no_registry_error_offers_a_fix_that_works_without_credentials(no_credentials, state_dir, tmp_path):
    # `kubeflow.pipeline.compile` without credentials said "set them, or REGISTRY=<host> or REGISTRY=default"; with
    # REGISTRY=default it said the very same: the fix it offered cannot work without credentials. With nothing cached
    # of EC2's answers (a fresh machine, as CI's: the empty credential files counted as credentials, EC2 was asked, and
    # a second line said it could not be) the error is still the one line
    for registry in ("", "default"):
        result = run_cli("kubeflow.pipeline.compile", env={**no_credentials, "REGISTRY": registry,
                                                           "DOEKS_CACHE": str(tmp_path / "empty-cache")})
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: cannot tell which ECR"), result.stderr
        fix = lines[0].split("; ", 1)[1]
        assert "REGISTRY=default" not in fix and "TRAIN_IMAGE=<image>" in fix, lines[0]
    # the fix it names works: TRAIN_IMAGE, without credentials
    ok = run_cli("kubeflow.pipeline.compile", env={**no_credentials, "TRAIN_IMAGE": "registry.example.com/train:1"})
    compiled = state_dir / "pipelines" / "hybrid-kubernetes.yaml"
    assert ok.returncode == 0 and "registry.example.com/train:1" in compiled.read_text(), ok.stderr


def test_doctor_checks_only_python_modules_the_project_installs():
    # `invoke doctor` listed "python: sagemaker" with the fix `pip install -e '.[cloud]'` although the sagemaker
    # dependency was dropped (issue 12: SageMaker via boto3 alone): on a fresh install that fix installs nothing
    import re
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from importlib.metadata import packages_distributions
    from pathlib import Path

    from doeks import preflight

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    extras = {"": project["dependencies"], **project["optional-dependencies"]}
    providers = packages_distributions()
    rows = [row for row in preflight.checks() if row[0].startswith("python: ")]
    assert rows
    for what, ok, detail in rows:
        module = what.removeprefix("python: ")
        extra = re.search(r"\.\[(\w+)\]", detail).group(1) if "pip install" in detail else None
        declared = {re.split(r"[<>=!\[ ;]", req, maxsplit=1)[0].lower() for reqs in extras.values() for req in reqs}
        assert {d.lower() for d in providers.get(module, [module])} & declared, (module, "not a dependency of doeks")
        if extra is not None:
            named = {re.split(r"[<>=!\[ ;]", req, maxsplit=1)[0].lower() for req in extras[extra]}
            assert {d.lower() for d in providers.get(module, [module])} & named, (module, extra)


def test_doctor_names_where_botocore_looked_for_credentials(no_credentials):
    # `TARGET=eks invoke doctor` with AWS_SHARED_CREDENTIALS_FILE / AWS_CONFIG_FILE set and IMDS off said botocore
    # reads "~/.aws/credentials or ~/.aws/config ... then a container or instance role": neither where it looked
    # (botocore/configprovider.py: credentials_file <- AWS_SHARED_CREDENTIALS_FILE, config_file <- AWS_CONFIG_FILE)
    # nor what the tasks' own error says
    result = run_cli("doctor", env=no_credentials)
    assert result.returncode == 1, result.stderr
    row = next(line for line in result.stderr.splitlines() if "AWS credentials" in line and "│" in line)
    for where in (no_credentials["AWS_SHARED_CREDENTIALS_FILE"], no_credentials["AWS_CONFIG_FILE"],
                  "disabled by AWS_EC2_METADATA_DISABLED"):
        assert where in row, (where, row)
    assert "~/.aws" not in row


def test_sagemaker_teardown_dry_run_without_credentials_plans_and_exits_0(no_credentials):
    # `TARGET=sagemaker invoke down --dry-run` without credentials ended "error: the teardown plan failed for
    # elasticjob" (exit 1), and `elasticjob.delete --dry-run` with the credentials error: the job to stop is a lookup
    # a dry run shows as unknown, as the eks units' are
    env = {**no_credentials, "TARGET": "sagemaker"}
    down = run_cli("down", "--dry-run", env=env)
    assert down.returncode == 0, down.stderr[-3000:]
    assert "unknown: SageMaker training job of imagenet <unknown: no credentials>" in down.stderr
    assert "would stop the SageMaker training job of imagenet if it is InProgress" in down.stderr
    assert "== down: eks" in down.stderr and "error:" not in down.stderr
    delete = run_cli("elasticjob.delete", "--dry-run", env=env)
    assert delete.returncode == 0 and "unknown: SageMaker training job of imagenet" in delete.stderr, delete.stderr


def test_sagemaker_role_and_stop_dry_runs_without_credentials_plan_the_requests(no_credentials):
    # `sagemaker.role` / `role-delete` / `stop --dry-run` without credentials ended with the credentials
    # error (exit 1) instead of the IAM requests they would send, the role's existence shown as unknown
    env = {**no_credentials, "TARGET": "sagemaker"}
    role = run_cli("sagemaker.role", "--dry-run", env=env)
    assert role.returncode == 0, role.stderr
    assert "unknown: IAM role doeks-sagemaker-execution-us-west-2 <unknown: no credentials>" in role.stderr
    assert "would call: iam.create_role" in role.stderr and "would call: iam.put_role_policy" in role.stderr
    gone = run_cli("sagemaker.role-delete", "--dry-run", env=env)
    assert gone.returncode == 0, gone.stderr
    assert "would call: iam.delete_role_policy" in gone.stderr and "would call: iam.delete_role" in gone.stderr
    stop = run_cli("sagemaker.stop", "--dry-run", env=env)
    assert stop.returncode == 0, stop.stderr
    assert "unknown: latest SageMaker training job of imagenet" in stop.stderr
    named = run_cli("sagemaker.stop", "--name", "imagenet-20261122-220836", "--dry-run", env=env)
    assert named.returncode == 0 and "would call: sagemaker.stop_training_job" in named.stderr, named.stderr


def test_local_nodes_write_nothing_outside_state_dir(small, state_dir, tmp_path):
    # every local node start left a /tmp/torchelastic_* folder (torchrun's log dir, a mkdtemp when --log-dir is
    # unset): 536 of them on this machine after a day; now they are the run's, under STATE_DIR
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    result = invoke("elasticjob.deploy", "--follow", "--train-args", "--max-steps 1 --log-every 1",
                    env={"TMPDIR": str(tmp)}, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not list(tmp.glob("torchelastic_*")), list(tmp.iterdir())
    run = targets.get(small).describe().run
    assert list((state_dir / "jobs" / "imagenet" / "runs" / run / "replicas" / "0" / "torchelastic").iterdir())


def test_plot_out_with_another_suffix_is_one_error_line(state_dir, tmp_path):
    # `elasticjob.plot --out chart.jpg` (or `efa.report F --out x.txt`) made a folder named chart.jpg and wrote
    # imagenet-training.png into it; the help says "PNG path or folder"
    log = tmp_path / "nccl.txt"
    log.write_text((Path(__file__).parent / "fixtures" / "nccl-tests-2.13-efa-na.txt").read_text())
    for args in (["efa.report", str(log), "--out", str(tmp_path / "x.txt")],
                 ["elasticjob.plot", "--out", str(tmp_path / "chart.jpg")],
                 ["elasticjob.scaling", "--dry-run", "--out", str(tmp_path / "s.svg")]):
        result = invoke(*args, env={"TARGET": "local"})
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and lines[-1].startswith("error: --out ") and "expected a .png file or a folder" in lines[-1], (args, result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nccl.txt"]  # nothing made
    folder = tmp_path / "charts.v2"
    folder.mkdir()
    ok = invoke("efa.report", str(log), "--out", str(folder), env={"TARGET": "local"})
    assert ok.returncode == 0 and (folder / "nccl-busbw.png").is_file(), ok.stderr


def test_a_check_across_keys_names_the_flags_typed(state_dir):
    # `elasticjob.deploy --min-replicas 3 --max-replicas 2` ended "error: REPLICAS='2' is not accepted: ...", naming
    # .env's REPLICAS, which the user did not touch, and neither flag typed
    result = invoke("elasticjob.deploy", "--dry-run", "--min-replicas", "3", "--max-replicas", "2", env={"TARGET": "local"})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: --min-replicas 3, --max-replicas 2: ") and "MIN_REPLICAS <= REPLICAS" in lines[0], lines[0]
    assert result.stdout == ""


def test_logs_of_a_job_never_deployed_say_so(state_dir):
    # `elasticjob.logs` on a fresh checkout printed nothing and exited 0 (as `--replica 7` did before issue 15)
    result = invoke("elasticjob.logs", env={"TARGET": "local"})
    assert result.returncode == 1 and result.stdout == "", result.stdout
    assert result.stderr.strip().splitlines() == ["error: job imagenet has no runs on local yet: `invoke elasticjob.deploy` starts one"]


def test_doctor_help_says_it_checks_per_target():
    # `invoke --help doctor` said "check every tool and service doeks uses" (the same whatever the target, as before
    # issue 15); it checks per TARGET and exits 1 when a needed check fails
    result = invoke("--help", "doctor")
    assert result.returncode == 0 and "TARGET" in result.stdout and "exit 1" in result.stdout, result.stdout


def test_s3_endpoint_dry_runs_without_credentials_plan_the_requests(no_credentials):
    # `sagemaker.s3-endpoint --dry-run` / `s3-endpoint-delete --dry-run` without credentials ended with the
    # credentials error (exit 1): the cluster's VPC, its endpoints and route tables are lookups a dry run shows as unknown
    env = {**no_credentials, "TARGET": "sagemaker"}
    create = run_cli("sagemaker.s3-endpoint", "--dry-run", env=env)
    assert create.returncode == 0, create.stderr
    assert "unknown: VPC of cluster doeks <unknown: no credentials>" in create.stderr
    assert "would call: ec2.create_vpc_endpoint" in create.stderr
    delete = run_cli("sagemaker.s3-endpoint-delete", "--dry-run", "--vpc", "vpc-0123", env=env)
    assert delete.returncode == 0, delete.stderr
    assert "unknown: S3 gateway endpoints in vpc-0123" in delete.stderr
    assert "would call: ec2.delete_vpc_endpoints" in delete.stderr and "error:" not in delete.stderr


def test_local_up_dry_run_does_not_say_it_starts_anything(state_dir):
    # `invoke up --dry-run` on TARGET=local said "starting the local runtime" while starting nothing
    result = invoke("up", "--dry-run", "--full", env={"TARGET": "local"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "the plan for the local runtime" in result.stderr and "starting" not in result.stderr
    assert not (state_dir / "services" / "etcd" / "service.json").exists()

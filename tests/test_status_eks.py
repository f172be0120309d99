"""Status that explains itself on TARGET=eks, through the scripted kubectl (tests/kubectl_standin.py): the reason
and fix come from the pods' container states, the namespace's events and the pods' last log lines; `describe` shows
the events; `logs` validates --replica and passes --tail / --since to kubectl.

Why a stand-in still: these are the eks target's own paths (its kubeconfig from `eks.connect`, its runs record),
which need an EKS cluster. The same reading of container states, events and logs runs for real on doeks' own
cluster (TARGET=kubernetes, the class the eks target extends): OOMKilled, ErrImagePull, FailedScheduling, FailedMount,
data missing and the lost rendezvous server in tests/test_kubernetes_jobs.py. What stays scripted here is what that
cluster would only show at the cost of a second training image (a user's script crash-looping in its pods) and the
shapes the eks target adds nothing to."""
from __future__ import annotations

import json
import re


from doeks import targets

from .conftest import invoke
from .test_targets import pod, pytorchjob_json, settings_for, world  # noqa: F401 - the fixture

# Shapes as the API server returns them (kubernetes/api core/v1 types.go, v0.33: ContainerStatus.lastState.terminated
# {exitCode, reason}; Event {type, reason, message, count, involvedObject, lastTimestamp}); the kubelet's words
# (kubernetes/kubernetes v1.33): event reason "BackOff" pkg/kubelet/events/event.go, waiting reason "CrashLoopBackOff"
# pkg/kubelet/container/sync_result.go; terminated reason "OOMKilled" from the container runtime (containerd CRI).


def crashed_pod(name: str, restarts: int, exit_code: int, reason: str) -> dict:
    p = pod(name, "Running", restarts, "CrashLoopBackOff")
    p["status"]["containerStatuses"][0]["lastState"] = {"terminated": {"exitCode": exit_code, "reason": reason}}
    return p


def event(obj: str, reason: str, message: str, count: int = 1, kind: str = "Pod") -> dict:
    return {"type": "Warning", "reason": reason, "message": message, "count": count,
            "involvedObject": {"kind": kind, "name": obj, "namespace": "default"}, "lastTimestamp": "2026-11-22T21:00:00Z"}


def script(world, pods, events, logs="", state="Running"):
    world["script"].write_text(json.dumps([
        {"match": ["get", "pytorchjob"], "stdout": pytorchjob_json(state)},
        {"match": ["get", "pods"], "stdout": json.dumps({"items": pods})},
        {"match": ["get", "events"], "stdout": json.dumps({"items": events})},
        {"match": ["logs"], "stdout": logs}]))


def test_bad_arguments_in_a_crash_loop_are_the_permanent_reason(world):  # noqa: F811
    s = settings_for("eks")
    script(world, [crashed_pod("imagenet-worker-0", 4, 2, "Error")],
           [event("imagenet-worker-0", "BackOff", "Back-off restarting failed container pytorch", 7),
            event("some-other-pod", "OOMKilled", "not ours")],
           logs="[pod/imagenet-worker-0/pytorch] train.py: error: unrecognized arguments: --bogus 1\n")
    status = targets.get(s).describe()
    assert status.restarts == 4 and status.replicas[0].state == "Restarting"
    assert status.permanent and status.reason == "bad arguments to the training script: unrecognized arguments: --bogus 1"
    assert "--train-args" in status.fix
    out = invoke("elasticjob.describe", env={"TARGET": "eks", "COLUMNS": "250"})
    assert out.returncode == 0, out.stderr
    assert "reason: bad arguments to the training script" in out.stderr and "fix: fix --train-args" in out.stderr
    assert "BackOff Pod/imagenet-worker-0: Back-off restarting failed container pytorch (x7)" in out.stderr
    assert "some-other-pod" not in out.stderr  # only the job's own events


def test_a_crash_loop_without_a_known_cause_names_the_last_error(world):  # noqa: F811
    """(OOMKilled from a real container state: tests/test_kubernetes_jobs.py, a pod over KUBE_MEMORY.)"""
    s = settings_for("eks")
    script(world, [crashed_pod("imagenet-worker-0", 5, 1, "Error")], [], logs="RuntimeError: boom\n")
    status = targets.get(s).describe()
    assert status.reason.startswith("crash loop") and "RuntimeError: boom" in status.reason


def test_the_scripts_own_exception_in_a_pod_is_the_reason_with_its_line_and_one_restart_count(world):  # noqa: F811
    """A RuntimeError at step 2 (it was "crash loop: 13 restarts, last error: ... RendezvousClosedError"): the pod's
    log as torch's excepthook writes it, after doeks' torchrun restarted the workers once; torchrun's restart counts
    with the pod's, the same number in the table and the job's count."""
    s = settings_for("eks")
    traceback = ["[rank1]: Traceback (most recent call last):", '[rank1]:   File "/workspace/fit.py", line 57, in main',
                 '[rank1]:     raise RuntimeError("boom at step 2")', "[rank1]: RuntimeError: boom at step 2"]
    logs = [*traceback, "doeks: worker group failed (exit codes [1]): torchrun restarts it (1 of 10)",
            "doeks: worker group restarted", "doeks: step=2 loss=0.1", *traceback,
            "torch.distributed.elastic.rendezvous.api.RendezvousClosedError"]
    script(world, [crashed_pod("imagenet-worker-0", 1, 1, "Error")], [],
           logs="".join(f"[pod/imagenet-worker-0/pytorch] {line}\n" for line in logs))
    status = targets.get(s).describe()
    assert status.permanent and status.reason == "the script raised RuntimeError: boom at step 2 (fit.py, line 57, in main)"
    assert status.replicas[0].restarts == 2 and status.restarts == 2  # the pod's 1 + torchrun's 1
    assert "invoke elasticjob.logs --errors" in status.fix


def test_healthy_job_has_no_reason_and_reads_no_events(world):  # noqa: F811
    s = settings_for("eks")
    script(world, [pod("imagenet-worker-0", "Running")], [event("imagenet-worker-0", "OOMKilled", "old")])
    status = targets.get(s).describe()
    assert status.reason == "" and status.fix == ""
    calls = [json.loads(line)["argv"] for line in world["record"].read_text().splitlines()]
    assert not any("events" in argv for argv in calls)  # a healthy job costs two kubectl calls, no more


def test_logs_flags_are_checked_before_the_cluster_is_asked(world):  # noqa: F811
    """Reading logs, --replica and --follow on a real API server: tests/test_kubernetes_jobs.py."""
    for flags, message in ((["--tail", "x"], "error: --tail 'x': expected an integer"),
                           (["--since", "soon"], "error: --since 'soon': expected a duration"),
                           (["--run", "nope"], "error: --run nope: job imagenet has logs of runs")):
        out = invoke("elasticjob.logs", *flags, env={"TARGET": "eks"})
        assert out.returncode == 1 and out.stderr.strip().startswith(message), (flags, out.stderr)


def test_a_run_on_eks_is_recorded_and_its_end_seen_by_history(world):  # noqa: F811
    import yaml

    world["script"].write_text(json.dumps([{"match": ["apply"], "stdout": "pytorchjob.kubeflow.org/imagenet serverside-applied\n"},
                                           {"match": ["get"], "stdout": ""}]))
    # a prebuilt image (doeks' own content-tagged one must be in ECR first: tests/test_eks_user_script.py)
    image = "123456789012.dkr.ecr.us-west-2.amazonaws.com/doeks-train:prebuilt"
    # checkpoints and model on the claim: the S3 default's Pod Identity role needs EKS' API, which this account
    # (plain moto) lacks (tests/test_eks_outputs.py deploys with it)
    deployed = invoke("elasticjob.deploy", env={"TARGET": "eks", "TRAIN_IMAGE": image, "CHECKPOINT_URI": "/fsx-shared/ck",
                                                "MODEL_URI": "/fsx-shared/models"})
    assert deployed.returncode == 0, deployed.stderr
    applied = [json.loads(line) for line in world["record"].read_text().splitlines() if "apply" in line][-1]
    job = list(yaml.safe_load_all(applied["stdin"]))[-1]
    run = job["spec"]["elasticPolicy"]["rdzvId"]
    job["status"] = {"conditions": [{"type": "Failed", "status": "True", "message": "PyTorchJob imagenet has failed"}]}
    failed = crashed_pod("imagenet-worker-0", 6, 1, "OOMKilled")
    world["script"].write_text(json.dumps([
        {"match": ["get", "pytorchjob"], "stdout": json.dumps(job)},
        {"match": ["get", "pods"], "stdout": json.dumps({"items": [failed]})},
        {"match": ["get", "events"], "stdout": json.dumps({"items": []})}, {"match": ["logs"], "stdout": ""}]))
    history = invoke("elasticjob.history", env={"TARGET": "eks", "COLUMNS": "250"})
    assert history.returncode == 0, history.stderr
    row = next(line for line in history.stderr.splitlines() if run in line)
    assert "eks" in row and "Failed" in row and "out of memory" in row


def test_follow_ends_a_job_with_a_permanent_reason(world):  # noqa: F811
    s = settings_for("eks")
    script(world, [crashed_pod("imagenet-worker-0", 2, 2, "Error")], [],
           logs="[pod/imagenet-worker-0/pytorch] train.py: error: unrecognized arguments: --bogus 1\n")
    entries = json.loads(world["script"].read_text()) + [{"match": ["delete"], "stdout": ""}]
    world["script"].write_text(json.dumps(entries))
    status = targets.get(s).wait(timeout=60, quiet=True, poll=0)
    assert status.state == "Failed" and status.permanent and "--bogus 1" in status.reason
    calls = [json.loads(line)["argv"] for line in world["record"].read_text().splitlines()]
    assert any(argv[0] == "delete" for argv in calls)  # the operator does not restart it to its backoff limit


def test_follow_of_a_succeeded_job_waits_for_its_replicas_still_leaving(world):  # noqa: F811
    """The training operator marks an elastic PyTorchJob Succeeded when its first worker succeeds; the others are
    still leaving. `--follow` says the job's end once they have ended (their last lines and their phase), as CI found
    on doeks' own cluster (tests/test_kubernetes_cluster.py read a worker still Running after `deploy --follow` said
    succeeded, 1 run in ~20). Scripted here: the real race cannot be made to happen on demand."""
    import threading
    import time

    s = settings_for("eks")
    logs = "[pod/imagenet-worker-0/pytorch] step=4 loss=0.1\n"
    script(world, [pod("imagenet-worker-0", "Succeeded"), pod("imagenet-worker-1", "Running")], [], logs=logs,
           state="Succeeded")
    ended = dict(world, script=world["script"].with_name("ended.json"))  # swapped in whole: kubectl reads it meanwhile
    script(ended, [pod("imagenet-worker-0", "Succeeded"), pod("imagenet-worker-1", "Succeeded")], [], logs=logs,
           state="Succeeded")
    left = threading.Timer(1.5, lambda: ended["script"].replace(world["script"]))
    left.start()
    started = time.monotonic()
    try:
        status = targets.get(s).wait(timeout=60, quiet=True, poll=0.2)
    finally:
        left.cancel()
    assert status.state == "Succeeded"
    assert [r.state for r in status.replicas] == ["Succeeded", "Succeeded"], status.replicas
    assert time.monotonic() - started >= 1.5


def test_a_replica_still_running_after_the_wait_is_named_with_how_to_stop_it(world, monkeypatch, capsys):  # noqa: F811
    """A worker that does not leave after the job succeeded (stuck in its last collective, a script that never
    returns) runs, and on EKS bills its GPU node, until stopped: `--follow` waits follow.LEAVING seconds, then says
    which and how to stop it."""
    from doeks.targets import follow

    from .test_job_value import _elasticjob_tasks

    monkeypatch.setattr(follow, "LEAVING", 1)
    s = settings_for("eks")
    script(world, [pod("imagenet-worker-0", "Succeeded"), pod("imagenet-worker-1", "Running")], [],
           logs="[pod/imagenet-worker-0/pytorch] step=4 loss=0.1\n", state="Succeeded")
    status = targets.get(s).wait(timeout=60, quiet=True, poll=0.2)
    assert [r.state for r in status.replicas] == ["Succeeded", "Running"]
    capsys.readouterr()
    _elasticjob_tasks()._finish(s, status)
    said = " ".join(capsys.readouterr().err.split())
    assert ("warning: job imagenet succeeded, but imagenet-worker-1 still ran 1 s after: `invoke elasticjob.delete` "
            "stops what is left of it") in said, said


def test_a_submission_through_the_api_is_a_run_too(world):  # noqa: F811
    """The demo, the scaling runs and the pipeline submit through the target, not the task: still a run each."""
    from doeks.runner import Runner
    from doeks.targets import runs

    world["script"].write_text(json.dumps([
        {"match": ["apply"], "stdout": ""},
        {"match": ["get", "pytorchjob"], "rc": 1,  # a submission first asks whether the job is there already
         "stderr": 'Error from server (NotFound): pytorchjobs.kubeflow.org "imagenet" not found\n'}]))
    s = settings_for("eks")
    target = targets.get(s)
    plan = target.plan(targets.Job(s))
    target.submit(plan, Runner(echo=False, dry_run=True))
    assert runs.read(s) == []  # a dry run is no run
    target.submit(plan, Runner(echo=False))
    (record,) = runs.read(s)
    assert record["run"] == plan.manifests[-1]["spec"]["elasticPolicy"]["rdzvId"] and record["target"] == "eks"


def test_a_recovered_pod_has_no_reason(world):  # noqa: F811
    """Kubernetes keeps a container's lastState (here OOMKilled) after it runs again: that is history, not a reason."""
    s = settings_for("eks")
    recovered = pod("imagenet-worker-0", "Running", 1)
    recovered["status"]["containerStatuses"][0]["lastState"] = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    script(world, [recovered], [], logs="[pod/imagenet-worker-0/pytorch] step=9 epoch=0 loss=1.2 acc=0.5 samples/s=9.0 world=1\n")
    status = targets.get(s).describe()
    assert status.restarts == 1 and status.reason == "" and status.state == "Running"


def test_a_job_deleted_because_it_failed_keeps_its_status_events_and_traceback(world):  # noqa: F811
    """`--follow` ends a job that failed for good by deleting its PyTorchJob (no pod crash-loops on, billing GPUs):
    `status`, `describe` and `logs --errors` then show the failed run as the follow saw it, its events and the user's
    traceback from the pods' logs kept before the delete (it said "Stopped, 0 restarts / no PyTorchJob" and "no
    traceback in the logs of run -"); `delete` forgets the status, the run's logs stay for `logs --run`. The same on
    doeks' own cluster: tests/test_kubernetes_jobs.py (a user's script raising RuntimeError)."""
    s = settings_for("eks")
    traceback = ["[rank0]: Traceback (most recent call last):", '[rank0]:   File "/workspace/fit.py", line 57, in main',
                 '[rank0]:     raise RuntimeError("boom at step 2")', "[rank0]: RuntimeError: boom at step 2"]
    before = ["doeks: step=1 loss=0.3", *traceback]  # the container's previous life, then its current one
    now = ["doeks: step=2 loss=0.1", *traceback, "doeks: worker group failed (exit codes [1]): torchrun restarts it (1 of 10)"]
    prefixed = "".join(f"[pod/imagenet-worker-0/pytorch] {line}\n" for line in now)
    script(world, [crashed_pod("imagenet-worker-0", 1, 1, "Error")],
           [event("imagenet-worker-0", "BackOff", "Back-off restarting failed container pytorch", 3)], logs=prefixed)
    entries = json.loads(world["script"].read_text())
    world["script"].write_text(json.dumps([{"match": ["logs", "--previous"], "stdout": "".join(f"{x}\n" for x in before)},
                                           {"match": ["logs", "-c"], "stdout": "".join(f"{x}\n" for x in now)},
                                           *entries, {"match": ["delete"], "stdout": ""}]))
    followed = targets.get(s).wait(timeout=60, quiet=True, poll=0)
    assert followed.state == "Failed" and followed.permanent and followed.restarts == 2, followed
    calls = [json.loads(line)["argv"] for line in world["record"].read_text().splitlines()]
    assert any(argv[0] == "delete" for argv in calls)  # nothing keeps running
    # the cluster now has no such job, as after the real delete
    gone = {"rc": 1, "stderr": 'Error from server (NotFound): pytorchjobs.kubeflow.org "imagenet" not found\n'}
    world["script"].write_text(json.dumps([{"match": ["get", "pytorchjob"], **gone},
                                           {"match": ["get", "pods"], "stdout": json.dumps({"items": []})},
                                           {"match": ["get", "events"], "stdout": json.dumps({"items": []})},
                                           {"match": ["logs"], "stdout": ""}, {"match": ["delete"], "stdout": ""}]))
    env = {"TARGET": "eks", "COLUMNS": "250"}
    shown = invoke("elasticjob.describe", env=env)
    assert shown.returncode == 0, shown.stderr
    assert f"job imagenet on eks: Failed (run {followed.run}), " in shown.stderr and ", 2 restarts" in shown.stderr, shown.stderr
    assert "reason: the script raised RuntimeError: boom at step 2 (fit.py, line 57, in main)" in shown.stderr
    assert re.search(r"imagenet-worker-0 +│ Stopped +│ 2 ", shown.stderr) and "(pod deleted; logs kept)" in shown.stderr
    assert "BackOff Pod/imagenet-worker-0: Back-off restarting failed container pytorch (x3)" in shown.stderr
    errors = invoke("elasticjob.logs", "--errors", env=env)
    assert errors.returncode == 0 and "no traceback" not in errors.stderr, errors.stderr
    assert '[pod/imagenet-worker-0/pytorch] [rank0]:     raise RuntimeError("boom at step 2")' in errors.stdout, errors.stdout
    assert "in the job's code at fit.py, line 57" in errors.stderr, errors.stderr
    lines = invoke("elasticjob.logs", "--replica", "0", env=env).stdout.splitlines()
    assert lines == [f"[pod/imagenet-worker-0/pytorch] {line}" for line in before + now], lines
    assert invoke("elasticjob.delete", env=env).returncode == 0
    after = invoke("elasticjob.status", env=env)
    assert "Stopped" in after.stderr and "no PyTorchJob imagenet" in after.stderr, after.stderr
    earlier = invoke("elasticjob.logs", "--errors", "--run", followed.run, env=env)
    assert "RuntimeError: boom at step 2" in earlier.stdout, earlier.stderr


def test_an_error_whose_log_is_gone_is_read_from_the_last_lines_the_kubelet_kept(world):  # noqa: F811
    """The container that said why the run ended was removed with its log (the kubelet keeps one ended container, and
    a pod lived three times in 13 s on doeks' cluster); its last lines stay in lastState.terminated.message
    (terminationMessagePolicy FallbackToLogsOnError, on the training container): a permanent error there is the
    reason, not the closed rendezvous the current life says."""
    from doeks import jobspec

    s = settings_for("eks")
    container = jobspec.pytorchjob(s)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    closed = pod("imagenet-worker-0", "Running", 1)
    closed["status"]["containerStatuses"][0]["lastState"] = {"terminated": {
        "exitCode": 1, "reason": "Error",
        "message": "error: data folder /fsx-shared/data is missing or empty\ndoeks: torchrun gives up: rank 0 exited with 2"}}
    script(world, [closed], [], logs="[pod/imagenet-worker-0/pytorch] doeks: RendezvousClosedError: a node of this run "
                                     "gave up and closed its rendezvous: nothing to rejoin; this container ends in 30 s\n")
    status = targets.get(s).describe()
    assert status.permanent and status.reason == "data missing: data folder /fsx-shared/data is missing or empty", status

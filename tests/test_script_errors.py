"""A user's script fails well: its own exception (any type) with its file and line is the reason, an error of its own
code ends the job at once, a library's error that comes back after a restart ends it too, a checkpoint of another
model is named as such, and `elasticjob.logs --errors` shows each traceback once. The lines below are what torch
2.13's torchrun wrote in real local runs (2026-11-25): torch prefixes a worker's traceback with `[rankN]: `, the
local target's logs each line with its replica."""
from __future__ import annotations

from pathlib import Path

from doeks.pod import reasons

# node-0's log of a real run of a script that raises RuntimeError at step 2 (two ranks, the same line), then the line
# doeks' torchrun says when it restarts the workers, then the same again
RAISED = [
    '[rank2]: Traceback (most recent call last):',
    '[rank2]:   File "/tmp/i32/proj/fit.py", line 79, in <module>',
    '[rank2]:     main()',
    '[rank2]:   File "/tmp/i32/proj/fit.py", line 57, in main',
    '[rank2]:     raise RuntimeError(f"--fail-at {args.fail_at}: failing on purpose at step {step}")',
    '[rank3]: Traceback (most recent call last):',
    '[rank2]: RuntimeError: --fail-at 2: failing on purpose at step 2',
    '[rank3]:   File "/tmp/i32/proj/fit.py", line 79, in <module>',
    '[rank3]:     main()',
    '[rank3]:   File "/tmp/i32/proj/fit.py", line 57, in main',
    '[rank3]:     raise RuntimeError(f"--fail-at {args.fail_at}: failing on purpose at step {step}")',
    '[rank3]: RuntimeError: --fail-at 2: failing on purpose at step 2',
    "E1125 21:38:37.336000 10939 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed "
    "(exitcode: 1) local_rank: 1 (pid: 11432) of binary: /root/.pyenv/versions/3.11.7/bin/python",
]
# a library's error in a call from the script (torch.load of a file that is no checkpoint)
LIBRARY = [
    "[rank0]: Traceback (most recent call last):",
    '[rank0]:   File "/workspace/fit.py", line 44, in main',
    "[rank0]:     state = torch.load(path, map_location=device)",
    '[rank0]:   File "/usr/local/lib/python3.11/site-packages/torch/serialization.py", line 1548, in load',
    "[rank0]:     raise pickle.UnpicklingError(_get_wo_message(str(e))) from None",
    "[rank0]: _pickle.UnpicklingError: Weights only load failed.",
]
MISFIT = [
    "[rank0]: Traceback (most recent call last):",
    '[rank0]:   File "/workspace/train.py", line 45, in main',
    '[rank0]:     model.load_state_dict(state["model"])',
    '[rank0]:   File "/usr/local/lib/python3.11/site-packages/torch/nn/modules/module.py", line 2635, in load_state_dict',
    "[rank0]:     raise RuntimeError(",
    "[rank0]: RuntimeError: Error(s) in loading state_dict for Linear:",
    '[rank0]: \tMissing key(s) in state_dict: "weight", "bias". ',
]
RESTART = "doeks: worker group failed (exit codes [1]): torchrun restarts it (1 of 10)"


def test_any_exception_the_script_raises_is_the_reason_with_its_file_and_line_and_ends_the_job():
    reason = reasons.classify([f"[node-0] {line}" for line in RAISED], [1], restarts=0, roots=["/tmp/i32/proj"])
    assert reason.code == "exception" and reason.permanent
    assert reason.text == ("the script raised RuntimeError: --fail-at 2: failing on purpose at step 2 "
                           "(fit.py, line 57, in main)")
    assert "invoke elasticjob.logs --errors" in reason.fix
    # any type, the user's own class too (no list of "bug" types); a path in the image is shown from /workspace
    mine = ["Traceback (most recent call last):", '  File "/workspace/src/fit.py", line 9, in step',
            "    raise DivergedLoss(loss)", "DivergedLoss: nan"]
    assert reasons.from_lines(mine).text == "the script raised DivergedLoss: nan (src/fit.py, line 9, in step)"
    # a crash loop names the script's error and the job's restart count, the one the state line and table show
    loop = reasons.classify(LIBRARY + ["ChildFailedError:"], [1], restarts=3, total=7)
    assert loop.text.startswith("crash loop: 7 restarts, last error: _pickle.UnpicklingError: Weights only load "
                                "failed. (fit.py, line 44, in main)")


def test_a_library_error_is_transient_until_it_comes_back_after_a_restart():
    assert reasons.from_lines(LIBRARY) is None  # a lost peer, a file system: a restart may cure it
    again = reasons.from_lines(LIBRARY + [RESTART] + LIBRARY)
    assert again.permanent and again.text == ("the script failed with _pickle.UnpicklingError: Weights only load "
                                              "failed. (fit.py, line 44, in main), the same after a restart")
    # two ranks of one attempt are not a restart; torch's own tracebacks (no frame of the script) are never its error
    assert reasons.from_lines(LIBRARY + [line.replace("rank0", "rank1") for line in LIBRARY]) is None
    agent = ["Traceback (most recent call last):",
             '  File "/usr/lib/python3.11/site-packages/torch/distributed/run.py", line 9, in main',
             "torch.distributed.elastic.rendezvous.api.RendezvousClosedError"]
    assert reasons.tracebacks(agent + [RESTART] + agent).permanent() is None
    closed = reasons.classify(agent, [1], failed=True, total=3)
    assert closed.code == "rendezvous-closed" and closed.permanent and "(3 in all)" in closed.text


def test_a_checkpoint_that_does_not_fit_the_model_is_named_with_its_folder_and_fresh():
    reason = reasons.from_lines(MISFIT)
    assert reason.code == "bad-checkpoint" and reason.permanent
    assert reason.text.startswith("a checkpoint that does not fit the model: RuntimeError: Error(s) in loading "
                                  "state_dict for Linear: (train.py, line 45, in main)")
    assert reasons.CHECKPOINTS in reason.fix and "--fresh" in reason.fix

    class Target:
        def artifacts(self):
            return {"checkpoints": "/data/checkpoints/fit"}

    from doeks.targets import base, show

    status = base.JobStatus("local", "fit", "Failed", reason=reason.text, fix=reason.fix)
    assert show.fix_of(Target(), status).startswith("/data/checkpoints/fit holds a checkpoint of another model: "
                                                    "`invoke elasticjob.deploy --fresh`")


def test_errors_are_each_shown_once_the_scripts_first():
    blocks = reasons.error_blocks([f"[node-0] {line}" for line in RAISED + [RESTART] + RAISED]
                                  + [f"[node-1] {line.replace('rank2', 'rank0')}" for line in RAISED])
    assert len(blocks) == 1
    raised, count, streams = blocks[0]
    assert count == 6 and streams == ["node-0/rank2", "node-0/rank3", "node-1/rank0", "node-1/rank3"]
    assert raised.lines[0] == "[node-0] [rank2]: Traceback (most recent call last):"
    assert raised.lines[-1] == "[node-0] [rank2]: RuntimeError: --fail-at 2: failing on purpose at step 2"


def test_frames_of_doeks_and_installed_packages_are_not_the_scripts():
    from doeks.settings import PROJECT_ROOT

    assert reasons.user_code("/tmp/me/fit.py") and reasons.user_code("/workspace/train.py")
    assert reasons.user_code(str(PROJECT_ROOT / "doeks" / "workload" / "train.py"))  # the built-in job is a script
    assert reasons.user_code(str(PROJECT_ROOT / "examples" / "ddp-plain" / "train.py"))
    for path in (str(PROJECT_ROOT / "doeks" / "zygote.py"), "/opt/doeks-stage/doeks/pod/torchrun.py",
                 "<frozen runpy>", "/usr/lib/python3.11/json/decoder.py",
                 "/home/me/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py"):
        assert not reasons.user_code(path), path


def test_an_agent_that_finds_its_runs_rendezvous_closed_ends_in_a_pod_only_after_a_while(monkeypatch, capsys):
    """A closed rendezvous (a node spent its restarts) cannot be rejoined, and in a pod the kubelet keeps one ended
    container: the agent of the next container waits before it ends, so the previous container's log, which says why
    the run ended, stays readable (CI lost a missing-data reason this way: three lives of the pods in 13 s). Its line
    still names RendezvousClosedError, which is what reasons reads; on this machine (no pod) it ends at once."""
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    from doeks.pod import torchrun

    def closed():
        raise RendezvousClosedError

    slept = []
    monkeypatch.setattr("time.sleep", slept.append)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert torchrun.run_quietly(closed) == 1 and slept == [0]
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    assert torchrun.run_quietly(closed) == 1 and slept == [0, torchrun.CLOSED_WAIT_S]
    said = capsys.readouterr().err.strip().splitlines()
    assert said[-1].endswith(f"this container ends in {torchrun.CLOSED_WAIT_S} s") and len(said) == 2
    reason = reasons.classify(lines=said, failed=True)
    assert reason.code == "rendezvous-closed"


def _torchrun(folder, script: str, *args: str, restarts: int = 2):
    """doeks' torchrun (the training image's), two workers of `script` on this machine, as a pod runs it."""
    import subprocess
    import sys

    (folder / "fit.py").write_text(script)
    return subprocess.run([sys.executable, "-m", "doeks.pod.torchrun", "--standalone", "--nproc-per-node", "2",
                           "--max-restarts", str(restarts), "fit.py", *args], cwd=folder, capture_output=True,
                          text=True, timeout=180)


def test_the_images_torchrun_does_not_restart_workers_for_the_scripts_own_exception(tmp_path):
    """Real torchrun: the script's own exception is not retried by the node's agent (it spent every restart, and on a
    cluster the restart count grew past MAX_RESTARTS before `--follow` ended the job: CI, 4 restarts for one
    RuntimeError); a library's error is (a lost peer may come back), up to --max-restarts."""
    own = _torchrun(tmp_path, "import sys\nif __name__ == '__main__':\n    raise RuntimeError('bad value at step 2')\n")
    said = own.stderr.splitlines()
    assert own.returncode == 1 and not [line for line in said if reasons.WORKER_RESTART.search(line)], own.stderr
    assert "doeks: the script raised RuntimeError: bad value at step 2 (" in own.stderr, own.stderr
    assert said[-1].startswith("doeks: torchrun gives up: rank ") and said[-1].endswith("no restart is left"), said[-3:]
    library = _torchrun(tmp_path, "import json\nif __name__ == '__main__':\n    json.loads('{not json')\n")
    restarts = [line for line in library.stderr.splitlines() if reasons.WORKER_RESTART.search(line)]
    assert library.returncode == 1 and len(restarts) == 2, library.stderr[-3000:]
    assert "not restarting" not in library.stderr


def test_an_agent_that_ended_for_good_keeps_its_container_a_while_in_a_pod(monkeypatch, capsys):
    """After an error no restart cures, a pod's container ends only after CLOSED_WAIT_S, so `--follow` (which polls
    every 3 s) reads its log and ends the job before the kubelet restarts the container into a closed rendezvous; an
    agent out of restarts for a transient error ends at once (the kubelet's restart may help)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from doeks.pod import torchrun

    def failed():
        raise ChildFailedError("fit.py", {0: ProcessFailure(0, 1, 1, "")})

    slept = []
    monkeypatch.setattr("time.sleep", slept.append)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.delenv(torchrun.END_WAIT_ENV, raising=False)
    torchrun._ENDED_FOR_GOOD.clear()
    assert torchrun.run_quietly(failed) == 1 and slept == [0]
    torchrun._ENDED_FOR_GOOD.set()
    try:
        assert torchrun.run_quietly(failed) == 1 and slept == [0, torchrun.CLOSED_WAIT_S]
        said = capsys.readouterr().err.strip().splitlines()
        assert said[-1].endswith(f"no restart is left; this container ends in {torchrun.CLOSED_WAIT_S} s"), said
        # docker's containers (on-failure restarts) have it from the job's manifest; the local agent never waits
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
        monkeypatch.setenv(torchrun.END_WAIT_ENV, "7")
        assert torchrun.run_quietly(failed) == 1 and slept[-1] == 7
        assert torchrun.run_quietly(failed, end_wait_s=0) == 1 and slept[-1] == 0
    finally:
        torchrun._ENDED_FOR_GOOD.clear()


def test_the_jobs_manifest_tells_its_containers_to_wait_before_they_end_for_good(monkeypatch):
    """Every container of the job's PyTorchJob (a pod, or docker's container made from it) has DOEKS_END_WAIT_S: on
    docker, where nothing set it, the script's own error ended the agent at once and docker's on-failure policy
    restarted the container before `--follow` ended the job ("Failed after 1 restarts", CI)."""
    from doeks import jobspec, settings
    from doeks.pod import torchrun
    from doeks.settings import PROJECT_ROOT

    s = settings.load(environ={}, path=PROJECT_ROOT / ".env")
    env = {e["name"]: e.get("value") for e in jobspec.pytorchjob(s)["spec"]["pytorchReplicaSpecs"]["Worker"]
           ["template"]["spec"]["containers"][0]["env"]}
    assert env[torchrun.END_WAIT_ENV] == str(torchrun.CLOSED_WAIT_S)


def test_the_images_stage_reads_tracebacks_with_nothing_else_of_doeks(tmp_path):
    """The image stages doeks.pod, the pod-side package (trainimage.STAGE_FILES): each of its modules imports from
    those files alone (no settings, no invoke, no targets)."""
    import shutil
    import subprocess
    import sys

    from doeks.settings import PROJECT_ROOT
    from doeks.trainimage import STAGE_FILES

    for path in STAGE_FILES:
        target = tmp_path / "doeks" / path.relative_to(PROJECT_ROOT / "doeks")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    probe = subprocess.run([sys.executable, "-S", "-c", "import doeks.pod.torchrun, doeks.pod.worker, doeks.pod.zygote, "
                            "doeks.pod.watchdog, doeks.pod.launch, doeks.pod.torchcompat, doeks.pod.reasons as r; "
                            "print(r.__file__)"], env={"PYTHONPATH": str(tmp_path)}, cwd=tmp_path, capture_output=True,
                           text=True)
    assert probe.returncode == 0 and probe.stdout.strip() == str(tmp_path / "doeks" / "pod" / "reasons.py"), probe


def test_a_worker_killed_outright_takes_its_own_children_and_is_restarted_at_once(tmp_path):
    """A worker SIGKILLed (the hang watchdog's first rung, the OOM killer) leaves its DataLoader's processes in its
    process group, holding its output pipes and its sockets to its peers until they notice, up to 5 s later; torch
    signals the groups of running workers only. The agent ends them at once: the restart follows in about a second
    (4.1-4.5 s at every hang restart on doeks' cluster before), and nothing of the dead worker stays."""
    script = """import os, signal, sys, time
if __name__ == '__main__':
    if os.environ['TORCHELASTIC_RESTART_COUNT'] != '0':
        open(f"restarted.{os.environ['RANK']}", 'w').write(repr(time.time()))
        sys.exit(0)
    if os.environ['RANK'] == '0':
        child = os.fork()
        if child == 0:  # as a DataLoader worker: forked, the worker's output and process group, its own sleep
            time.sleep(60)
            os._exit(0)
        open('child.pid', 'w').write(str(child))
        time.sleep(1)
        open('killed.at', 'w').write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
"""
    result = _torchrun(tmp_path, script, restarts=1)
    assert result.returncode == 0, result.stderr[-3000:]
    took = float((tmp_path / "restarted.0").read_text()) - float((tmp_path / "killed.at").read_text())
    assert took < 3.0, (took, result.stderr[-3000:])
    child = int((tmp_path / "child.pid").read_text())
    try:
        state = (Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split() or ["?"])[0]
    except OSError:
        state = "gone"
    assert state in ("gone", "Z"), state

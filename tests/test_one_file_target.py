"""A place to run is one file (issue 37): a target class in a module of its own, named by DOEKS_TARGETS, drives
`up`, `elasticjob.deploy` and `down` (each a dry run) through every unit, and no file of doeks is touched. The units
ask the target; none of them knows its name."""
from __future__ import annotations

import subprocess
import textwrap

from .conftest import ROOT, invoke

RECORDING = textwrap.dedent('''
    """A target that records each verb a unit asks of it, in order, and plans a one-step job."""
    import os

    from doeks.targets.base import Plan, Step, Target


    def record(verb):
        with open(os.environ["RECORDING_LOG"], "a") as log:
            log.write(verb + "\\n")


    class RecordingTarget(Target):
        name = "recording"

        def __getattribute__(self, attr):
            value = object.__getattribute__(self, attr)
            verbs = ("cluster_", "volume_", "efa_", "metrics_", "on_cluster", "job_needs", "plan", "cancel")
            if callable(value) and attr.startswith(verbs):
                def recorded(*args, **kwargs):
                    record(attr)
                    return value(*args, **kwargs)
                return recorded
            return value

        def cluster_create(self, runner):
            runner.step("recording: make the cluster", lambda: None)

        def cluster_delete(self, runner, yes=False):
            runner.step("recording: remove the cluster", lambda: None)

        def volume_deploy(self, runner):
            runner.step("recording: make the volume", lambda: None)

        def on_cluster(self, step, here, runner):
            runner.step(f"recording: on the cluster instead of: {here}", lambda: None)

        def job_needs(self, build, data, cluster):
            pass

        def plan(self, job):
            return Plan(self.name, job, steps=[Step(f"recording: start {job.name} (run {job.run})")])

        def cancel(self, runner):
            runner.step("recording: stop the job", lambda: None)
            return False
''')


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                          text=True).stdout


def test_a_target_of_one_file_runs_up_deploy_and_down(tmp_path, state_dir):
    (tmp_path / "plugin").mkdir()
    (tmp_path / "plugin" / "recording_target.py").write_text(RECORDING)
    log = tmp_path / "verbs.log"
    env = {"PYTHONPATH": str(tmp_path / "plugin"), "DOEKS_TARGETS": "recording_target", "TARGET": "recording",
           "RECORDING_LOG": str(log)}
    before = _git_status()

    said = {}
    for args in (("up", "--dry-run", "--full"), ("elasticjob.deploy", "--dry-run"), ("down", "--dry-run")):
        result = invoke(*args, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        said[args[0]] = result.stderr

    assert log.read_text().split() == [
        # up, in the units' order (eks, csi, efa, gpu-metrics, kubeflow, elasticjob)
        "cluster_create", "volume_deploy", "efa_deploy", "metrics_deploy", "on_cluster", "job_needs", "plan",
        # elasticjob.deploy
        "plan",
        # down, in reverse
        "cancel", "on_cluster", "metrics_delete", "efa_delete", "volume_delete", "cluster_delete"]
    assert "would recording: make the cluster" in said["up"]
    assert "would recording: start imagenet (run dry-run)" in said["elasticjob.deploy"]
    # what the target does not override is one line saying there is nothing of it here
    assert "TARGET=recording: no GPU-metrics agent to deploy" in said["up"]
    assert "TARGET=recording: no EFA device plugin was deployed; nothing to delete" in said["down"]
    assert _git_status() == before  # nothing of doeks was touched


def test_an_unknown_target_is_refused_naming_the_ones_found(state_dir):
    result = invoke("up", "--dry-run", "--full", env={"TARGET": "recording", "DOEKS_TARGETS": ""})
    assert result.returncode == 1
    assert "one of local, docker, kubernetes, eks, sagemaker" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_the_built_in_targets_table_names_every_target_class():
    """The table of built-in targets and the classes in doeks/targets/ agree: each entry imports to a Target subclass
    of that name, and no class with a `name` of its own is left out (the rehearsal is eks' variant)."""
    import importlib
    import inspect
    import pkgutil

    from doeks import keys, targets
    from doeks.targets.base import Target

    assert targets.names() == ("local", "docker", "kubernetes", "eks", "sagemaker")
    for name, (module, cls) in {**keys.BUILTIN_TARGETS, "eks (rehearsal)": keys.REHEARSAL_TARGET}.items():
        found = getattr(importlib.import_module(module), cls)
        assert issubclass(found, Target) and found.name == name.split()[0], (name, module, cls)
    listed = set(keys.BUILTIN_TARGETS.values()) | {keys.REHEARSAL_TARGET}
    for info in pkgutil.iter_modules(targets.__path__):
        module = importlib.import_module(f"doeks.targets.{info.name}")
        for cls in vars(module).values():
            if (inspect.isclass(cls) and issubclass(cls, Target) and cls is not Target and cls.__module__ == module.__name__
                    and "name" in vars(cls)):
                assert (module.__name__, cls.__name__) in listed, f"{cls.__name__} is not in BUILTIN_TARGETS"

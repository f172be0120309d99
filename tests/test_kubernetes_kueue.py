"""Queues on doeks' own cluster, asserted through the API server: `up` with QUEUE and KUBE_SIM_NODES deploys Kueue
(built here, its webhooks serving with the certificates its own manifests arrange) and simulated nodes (kwok); the
elastic PyTorchJob (training operator v1.9.4) and the TrainJob (Trainer v2.3.0) are admitted by Kueue and train to the
end; a job over the queue's quota waits and `status` says it waits for quota (Kueue's words), then starts when the
quota is raised; the objects the kueue unit makes on EKS (a p5 flavor with EKS' topology) are accepted by the real API
server and Kueue's webhooks; `kueue.delete` twice leaves nothing of Kueue; `down` leaves no kwok and no node.
Needs `invoke setup --kueue` (opt-in: without it these skip).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from .conftest import invoke, wait_for
from .test_kubernetes_cluster import SMALL_JOB, _said, kubectl, own_cluster

pytestmark = [pytest.mark.kubernetes, pytest.mark.slow]

QUEUE = "team-a"
SIM = {"KUBE_SIM_NODES": "4", "KUBE_SIM_NODE_TYPE": "p5.48xlarge"}


def _kueue_built() -> bool:
    from doeks.cluster import operators

    return all(operators.binary(op).exists() for op in operators.QUEUE_BUILDS.values())


@pytest.fixture(scope="module")
def env(request):
    if not _kueue_built():
        pytest.skip("Kueue and kwok are not built: `invoke setup --kueue` builds them")
    yield from own_cluster(request, {"JOB_NAME": "queued1", **SMALL_JOB, "QUEUE": QUEUE, **SIM})
    # the next module finds the cluster as it was: no Kueue webhooks on its pods, no simulated nodes
    base = {k: v for k, v in env_of(request).items() if k not in ("QUEUE",)}
    invoke("kueue.delete", env=base, timeout=600)
    invoke("eks.create", env={**base, "KUBE_SIM_NODES": "0"}, timeout=600)


def env_of(request) -> dict:
    state = request.getfixturevalue("cluster_state")
    return {"TARGET": "kubernetes", "STATE_DIR": str(state), "KUBECONFIG": ""}


def workload(env, kind: str, name: str) -> dict | None:
    job = json.loads(kubectl(env, "get", kind, name, "-n", "default", "-o", "json").stdout or "null")
    if not job:
        return None
    found = json.loads(kubectl(env, "get", "workloads", "-n", "default", "-l",
                               f"kueue.x-k8s.io/job-uid={job['metadata']['uid']}", "-o", "json").stdout)["items"]
    return found[0] if found else None


def admitted(env, kind: str, name: str) -> bool:
    wl = workload(env, kind, name)
    return bool(wl) and any(c["type"] == "Admitted" and c["status"] == "True" for c in wl["status"].get("conditions", []))


def test_up_with_a_queue_deploys_kueue_simulated_nodes_and_the_job_kueue_admits(env):
    result = invoke("up", env=env, timeout=2400)
    assert result.returncode == 0, _said(result)[-3000:]
    nodes = json.loads(kubectl(env, "get", "nodes", "-l", "doeks/simulated=true", "-o", "json").stdout)["items"]
    assert len(nodes) == 4
    for node in nodes:
        assert node["metadata"]["labels"]["node.kubernetes.io/instance-type"] == "p5.48xlarge"
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])
    deployment = json.loads(kubectl(env, "get", "deployment", "kueue-controller-manager", "-n", "kueue-system",
                                    "-o", "json").stdout)
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.k8s.io/kueue/kueue:v0.19.2"
    # Kueue's internal cert management put its CA into its own webhook configurations
    hooks = json.loads(kubectl(env, "get", "validatingwebhookconfiguration", "kueue-validating-webhook-configuration",
                               "-o", "json").stdout)["webhooks"]
    assert all(h["clientConfig"].get("caBundle") for h in hooks)
    wait_for(lambda: admitted(env, "pytorchjob", "queued1"), 300, "Kueue admitting the elastic PyTorchJob", poll=3)
    status = invoke("elasticjob.status", env=env, timeout=120)
    assert f"queue {QUEUE}: admitted" in _said(status), _said(status)[-2000:]
    done = invoke("elasticjob.logs", "--follow", env=env, timeout=1200)
    assert done.returncode == 0 and "done final_val_acc=" in done.stdout, _said(done)[-3000:]
    wait_for(lambda: (workload(env, "pytorchjob", "queued1") or {}).get("status", {}).get("conditions") and any(
        c["type"] == "Finished" and c["status"] == "True" for c in workload(env, "pytorchjob", "queued1")["status"]["conditions"]),
        120, "the job's Workload Finished")
    doctor = invoke("doctor", env=env, timeout=300)
    line = next(line for line in _said(doctor).splitlines() if "Kueue and Trainer" in line or "Kueue deployed" in line)
    assert "NO" not in line, line


def test_a_trainjob_in_the_queue_is_admitted_and_completes(env):
    from doeks import trainjob

    result = invoke("kubeflow.trainer.deploy", env=env, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    values = {**env, "JOB_NAME": "queuedtj", "EPOCHS": "1"}
    kubectl(env, "delete", "trainjob", "queuedtj", "-n", "default", "--ignore-not-found", "--wait=true")
    try:
        result = invoke("kubeflow.trainjob.submit", "--replicas", "2", env=values, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        wait_for(lambda: admitted(env, "trainjob", "queuedtj"), 300, "Kueue admitting the TrainJob", poll=3)

        def complete():
            job = json.loads(kubectl(env, "get", "trainjob", "queuedtj", "-n", "default", "-o", "json").stdout)
            return any(c["type"] == "Complete" and c["status"] == "True" for c in job.get("status", {}).get("conditions", []))

        wait_for(complete, 900, "the queued TrainJob Complete", poll=5)
        status = invoke("kubeflow.trainjob.status", env=values, timeout=120)
        assert f"queue {QUEUE}: finished" in _said(status), _said(status)[-2000:]
        pods = json.loads(kubectl(env, "get", "pods", "-n", "default", "-l", trainjob.selector("queuedtj"), "-o",
                                  "json").stdout)["items"]
        assert len(pods) == 2 and all(p["spec"]["nodeSelector"].get("kubernetes.io/hostname") == "doeks" for p in pods)
    finally:
        invoke("kubeflow.trainjob.delete", env=values, timeout=300)


def test_a_job_over_quota_waits_and_status_says_it_waits_for_quota(env):
    values = {**env, "JOB_NAME": "overquota", "EPOCHS": "1", "QUEUE_MEMORY": "300Mi"}  # 2 pods x 256Mi asked
    try:
        assert invoke("kueue.deploy", env=values, timeout=600).returncode == 0
        result = invoke("elasticjob.deploy", "--fresh", env=values, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]

        def waiting():
            said = _said(invoke("elasticjob.status", env=values, timeout=120))
            return said if "waits in queue team-a for quota" in said else None

        said = wait_for(waiting, 180, "status saying the job waits for quota", poll=3)
        assert "job overquota on kubernetes: Pending" in said and "memory" in said and "fix:" in said, said
        workers = "training.kubeflow.org/job-name=overquota"
        assert kubectl(env, "get", "pods", "-n", "default", "-l", workers, "-o", "name").stdout == ""
        queue = _said(invoke("kueue.status", env=values, timeout=120))
        assert "overquota" in queue and "quota:" in queue, queue
        # the quota raised, Kueue admits it and its pods start, all of them
        assert invoke("kueue.deploy", env=env, timeout=600).returncode == 0
        wait_for(lambda: admitted(env, "pytorchjob", "overquota"), 180, "the job admitted once the quota allows", poll=3)
        wait_for(lambda: len(kubectl(env, "get", "pods", "-n", "default", "-l", workers, "-o", "name").stdout.split()) == 2,
                 180, "both workers made", poll=3)
    finally:
        invoke("elasticjob.delete", env=values, timeout=600)


def test_the_eks_queue_objects_are_accepted_by_the_api_server_and_kueue(env):
    """What kueue.deploy applies on EKS (a p5 flavor with EKS' topology, the quotas), server-side dry run through the
    real API server, its CRD schemas and Kueue's admission webhooks."""
    from doeks import kueue
    from doeks.runner import to_yaml_stream
    from doeks.settings import load

    s = load({**os.environ, **env, "TARGET": "eks", "GPU_INSTANCE_TYPE": "p5.48xlarge"})
    flavor = kueue.node_type_flavor("p5.48xlarge")
    # its own name: the simulated p5 flavor of this cluster (with the kwok taint's toleration) already has the type's
    # name, and a ResourceFlavor's tolerations are immutable once it has a topology
    flavor.name = "eks-p5.48xlarge"
    manifests = kueue.queue_manifests(s, [flavor])
    checked = kubectl(env, "apply", "--server-side", "--dry-run=server", "--field-manager=doeks", "-f", "-",
                      input=to_yaml_stream(manifests))
    assert checked.returncode == 0, checked.stderr
    bad = [dict(m) for m in manifests]
    flavor = next(m for m in bad if m["kind"] == "ResourceFlavor")
    flavor["spec"] = {**flavor["spec"], "topologyName": "no such topology!"}
    refused = kubectl(env, "apply", "--server-side", "--dry-run=server", "-f", "-", input=to_yaml_stream([flavor]))
    assert refused.returncode != 0


def test_kueue_delete_twice_leaves_nothing_of_kueue(env):
    for _ in range(2):
        result = invoke("kueue.delete", env=env, timeout=600)
        assert result.returncode == 0, _said(result)[-3000:]
    crds = kubectl(env, "get", "crd", "-o", "name").stdout
    assert "kueue.x-k8s.io" not in crds
    assert kubectl(env, "get", "namespace", "kueue-system").returncode != 0
    hooks = kubectl(env, "get", "mutatingwebhookconfigurations,validatingwebhookconfigurations", "-o", "name").stdout
    assert "kueue" not in hooks


@pytest.mark.cluster_down
def test_down_removes_kueue_kwok_and_every_simulated_node(request):
    from doeks.cluster import node, simnodes

    if not _kueue_built():
        pytest.skip("Kueue and kwok are not built: `invoke setup --kueue` builds them")
    values = {**env_of(request), **SIM, "QUEUE": QUEUE}
    for step in ("eks.create", "kueue.deploy"):
        result = invoke(step, env=values, timeout=1200)
        assert result.returncode == 0, _said(result)[-3000:]
    kwok = simnodes.running()
    assert kwok and len(simnodes.existing()) == 4
    result = invoke("down", "--yes", env=values, timeout=900)
    assert result.returncode == 0, _said(result)[-3000:]
    # by its pid, not its pid file: down removes the cluster's folder, pid files with it
    alive = Path(f"/proc/{kwok}/cmdline")
    assert not (alive.exists() and alive.read_bytes()), f"kwok (pid {kwok}) still runs after down"
    assert node.leftovers() == {key: [] for key in node.leftovers()}

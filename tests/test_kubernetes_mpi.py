"""The MPI operator v0.8.0 and `invoke efa.test` on doeks' own single-node cluster, asserted through the API server.

On the run's one cluster (`eks.create` starts it, or finds it running): `efa.deploy` (the efa unit's `up` step)
deploys the MPI operator built from its Go module, next to the training operator (which leaves `mpijobs.kubeflow.org`
to it); `efa.test` runs the nccl-tests MPIJob for real with doeks' CPU stand-in image (launcher -> ssh -> 2 workers,
an MPI all-reduce over TCP), twice (the second replaces the first); `efa.delete` twice; the guard counted nothing.
`down` leaving nothing after all of it is test_kubernetes_cluster's `cluster_down` tests, at the end of the run.
Needs `invoke setup --kubernetes` (the cluster and the MPI operator built); in CI a missing build fails, elsewhere the
module is skipped.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from .conftest import invoke
from .test_kubernetes_cluster import own_cluster

pytestmark = [pytest.mark.kubernetes, pytest.mark.slow]

JOB = "test-efa-nccl"  # doeks.efa.nccl_mpijob's default name


def _built() -> bool:
    from doeks.cluster import build, operators

    return not build.missing() and operators.binary(operators.MPI_OPERATOR).exists()


@pytest.fixture(scope="module")
def env(request):
    yield from own_cluster(request, {"GPU_NODES": "2", "KUBE_GPUS": "0", "COLUMNS": "200"},
                           built=_built(),
                           fail="CI must have doeks' cluster and the MPI operator built (invoke setup --kubernetes)",
                           skip="doeks' cluster or the MPI operator is not built (invoke setup --kubernetes)")


def kubectl(*args: str) -> subprocess.CompletedProcess:
    from doeks import kube
    from doeks.cluster import versions

    return subprocess.run([kube.wheel_kubectl() or kube.kubectl(), f"--kubeconfig={versions.kubeconfig()}", *args],
                          capture_output=True, text=True, timeout=120)


def get(*args: str) -> dict:
    result = kubectl("get", *args, "-o", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_efa_unit_deploys_the_mpi_operator_built_here_and_no_device_plugin(env):
    from doeks import efa
    from doeks.cluster import images, operators

    started = invoke("eks.create", env=env, timeout=900)
    assert started.returncode == 0, started.stderr[-3000:]
    plan = invoke("efa.deploy", "--dry-run", env=env)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "EFA is an AWS network adapter" in plan.stderr and "the EFA device plugin is skipped" in plan.stderr
    assert "kind: DaemonSet" not in plan.stdout and "deploy/v2beta1/mpi-operator.yaml" in plan.stderr
    deployed = invoke("efa.deploy", env=env, timeout=900)
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    # the manifest's own image name, built here (LOCAL_IMAGES says what it is), and Available
    image = operators.image(operators.MPI_OPERATOR)
    assert image == "mpioperator/mpi-operator:0.8.0" and image in images.LOCAL_IMAGES
    operator = get("deployment", efa.MPI_OPERATOR_DEPLOYMENT, "-n", efa.MPI_OPERATOR_NAMESPACE)
    assert operator["spec"]["template"]["spec"]["containers"][0]["image"] == image
    available = {c["type"]: c["status"] for c in operator["status"]["conditions"]}
    assert available["Available"] == "True" and operator["status"].get("availableReplicas") == 1
    assert kubectl("get", "daemonset", efa.DAEMONSET, "-n", "kube-system").returncode != 0  # no EFA device plugin


def test_the_training_operator_leaves_the_mpijob_crd_to_the_mpi_operator(env):
    from doeks import efa

    deployed = invoke("kubeflow.training-operator.deploy", env=env, timeout=900)
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    crd = get("crd", efa.MPIJOB_CRD)
    assert [(v["name"], v["served"], v["storage"]) for v in crd["spec"]["versions"]] == [("v2beta1", True, True)]
    assert crd["status"]["storedVersions"] == ["v2beta1"]
    args = get("deployment", "training-operator", "-n", "kubeflow")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args and not any("mpijob" in a.lower() for a in args)  # it neither installs nor reconciles MPIJobs


def _run_the_test(env) -> tuple[dict, str]:
    from doeks import nccl

    result = invoke("efa.test", "--end", "64K", env=env, timeout=900)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    job = get("mpijob", JOB, "-n", "default")
    states = {c["type"] for c in job["status"]["conditions"] if c.get("status") == "True"}
    assert "Succeeded" in states, job["status"]
    assert job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 2
    log = (env_state(env) / "efa" / f"{JOB}.txt").read_text()
    report = nccl.parse(log)
    assert report.rows and [r.size for r in report.rows][:2] == [8, 16] and report.rows[-1].size == 65536
    assert all(r.oop_time_us and r.oop_time_us > 0 for r in report.rows)
    assert report.transport == "mpi-tcp" and not report.efa
    # two ranks, one on each worker pod, reached over ssh from the launcher
    hosts = sorted(line.split(" on ")[1].split()[0] for line in map(nccl.strip_prefix, log.splitlines())
                   if line.startswith("#  Rank"))
    assert hosts == [f"{JOB}-worker-0", f"{JOB}-worker-1"], log[:3000]
    assert "ran on CPU over TCP with no EFA" in result.stderr and "transport: mpi-tcp" in result.stderr
    return job, log


def env_state(env):
    from pathlib import Path

    return Path(env["STATE_DIR"])


def test_efa_test_runs_the_mpijob_with_two_workers_twice_the_second_replacing_the_first(env):
    first, _ = _run_the_test(env)
    pod = get("pods", "-n", "default", "-l", f"training.kubeflow.org/job-name={JOB},training.kubeflow.org/job-role=launcher")
    launcher = pod["items"][0]["spec"]
    assert launcher["containers"][0]["image"].startswith("public.ecr.aws/hpc-cloud/nccl-tests:")
    assert not launcher.get("initContainers")  # v0.8.0 injects no kubectl-delivery
    mounts = {m["mountPath"] for m in launcher["containers"][0]["volumeMounts"]}
    assert {"/root/.ssh", "/etc/mpi"} <= mounts  # the operator's ssh Secret and hostfile
    second, _ = _run_the_test(env)
    assert second["metadata"]["uid"] != first["metadata"]["uid"]
    assert len(get("mpijobs", "-n", "default")["items"]) == 1


def test_the_log_is_never_taken_for_efa(env):
    result = invoke("efa.report", str(env_state(env) / "efa" / f"{JOB}.txt"), "--require-efa", env=env)
    assert result.returncode == 1 and "no EFA: this log is doeks' CPU stand-in" in result.stderr


def test_efa_delete_twice_removes_the_mpi_operator(env):
    from doeks import efa

    for _ in range(2):
        result = invoke("efa.delete", env=env, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        assert kubectl("get", "crd", efa.MPIJOB_CRD).returncode != 0
        assert kubectl("get", "namespace", efa.MPI_OPERATOR_NAMESPACE).returncode != 0
    assert get("deployment", "training-operator", "-n", "kubeflow")["status"].get("availableReplicas") == 1


def test_the_network_guard_counted_nothing(env):
    from doeks.cluster import guard

    assert guard.installed()
    assert guard.dropped() == 0, guard.listing()

"""EFA unit: the nccl-tests parser on outputs of several versions, the EFA-or-fail check, manifests against the
MPIJob CRD and Kubernetes schemas, and the local all-reduce sweep with 2 real processes."""
from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest

from doeks import efa, nccl
from doeks import settings as S

from .conftest import ROOT, invoke, shared_fixture
from .test_jobspec import crd_schema, k8s_validate

FIXTURES = Path(__file__).parent / "fixtures"
def seed_log():
    return shared_fixture("nccl-tests-p4d-efa4.txt")


def test_parses_the_seed_log_with_efa():
    report = nccl.parse(seed_log().read_text())
    assert report.transport == "efa" and report.efa
    assert len(report.rows) == 28
    assert report.rows[0].size == 8 and report.rows[-1].size == 1073741824
    assert report.max_busbw == pytest.approx(42.04)
    assert report.avg_busbw == pytest.approx(8.23785)
    assert report.rows[-1].ip_busbw == pytest.approx(42.04) and report.rows[-1].oop_busbw == pytest.approx(42.03)


def test_parses_root_column_and_detects_socket_fallback():
    report = nccl.parse((FIXTURES / "nccl-tests-2.13-socket-fallback.txt").read_text())
    assert report.transport == "socket" and not report.efa
    assert [r.size for r in report.rows] == [8, 16, 1048576, 16777216, 1073741824]
    assert report.rows[-1].oop_busbw == pytest.approx(2.21)
    assert report.avg_busbw == pytest.approx(1.07584)


def test_parses_new_efa_provider_line_and_na_cells():
    report = nccl.parse((FIXTURES / "nccl-tests-2.13-efa-na.txt").read_text())
    assert report.efa and report.max_busbw == pytest.approx(456.34)
    assert len(report.rows) == 2


def test_report_require_efa_exit_codes(tmp_path, state_dir):
    ok = invoke("efa.report", str(seed_log()), "--require-efa", "--out", str(tmp_path))
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "nccl-tests-p4d-efa4-busbw.png").stat().st_size > 5000  # --out: a folder, named after the input
    assert "max 42.04 GB/s" in ok.stderr
    tcp = invoke("efa.report", str(FIXTURES / "nccl-tests-2.13-socket-fallback.txt"), "--require-efa", "--out", str(tmp_path))
    assert tcp.returncode == 1 and "did not use EFA (transport: socket" in tcp.stderr and "Traceback" not in tcp.stderr
    lenient = invoke("efa.report", str(FIXTURES / "nccl-tests-2.13-socket-fallback.txt"), "--out", str(tmp_path))
    assert lenient.returncode == 0
    empty = tmp_path / "empty.txt"
    empty.write_text("hello\n")
    assert invoke("efa.report", str(empty)).returncode == 1


@pytest.mark.parametrize("instance,gpus,adapters", [("p4d.24xlarge", 8, 4), ("p5.48xlarge", 8, 32), ("g5.48xlarge", 8, 1)])
def test_mpijob_is_sized_from_env_and_validates(instance, gpus, adapters):
    s = S.load(environ={"GPU_INSTANCE_TYPE": instance, "GPU_NODES": "2"}, path=ROOT / ".env")
    job = efa.nccl_mpijob(s)
    jsonschema.validate(job, crd_schema("kubeflow.org_mpijobs-v2beta1.crd.yaml", "v2beta1"))
    command = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("-np") + 1] == str(2 * gpus)
    assert job["spec"]["slotsPerWorker"] == gpus
    limits = job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["vpc.amazonaws.com/efa"] == adapters
    assert command[-8:-6] == ["-b", "8"] or "-b" in command


def test_device_plugin_validates_and_is_pinned():
    s = S.load(environ={}, path=ROOT / ".env")
    for manifest in efa.device_plugin(s):
        k8s_validate(manifest)
        image = manifest["spec"]["template"]["spec"]["containers"][0]["image"]
        major, minor, patch = (int(x) for x in image.rsplit(":v", 1)[1].split("."))
        assert (major, minor, patch) >= (0, 5, 10)
        terms = manifest["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert "p4d.24xlarge" in terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]


def test_deploy_dry_run_prints_daemonset_and_operator(state_dir):
    result = invoke("efa.deploy", "--dry-run", env={"TARGET": "eks"})
    assert result.returncode == 0, result.stderr
    assert "kind: DaemonSet" in result.stdout and efa.MPI_OPERATOR_VERSION in result.stderr


@pytest.mark.slow
def test_local_allreduce_sweep_runs_with_two_processes(state_dir):
    result = invoke("efa.test", "--end", "1M", env={"NPROC_PER_NODE": "2", "COLUMNS": "200"}, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = nccl.parse((state_dir / "efa" / "allreduce-local.txt").read_text())
    assert report.transport == "gloo"
    assert [r.size for r in report.rows][:3] == [8, 16, 32] and report.rows[-1].size == 1048576
    assert all(r.oop_busbw is not None and r.oop_time_us > 0 for r in report.rows)
    assert (state_dir / "plots" / "allreduce-local-busbw.png").exists()


def test_parses_doeks_cpu_stand_in_and_never_calls_it_efa(tmp_path, state_dir):
    """doeks' nccl-tests stand-in on its own cluster (an MPI all-reduce on CPU, mpirun --tag-output): rows parsed,
    transport mpi-tcp, and --require-efa fails on it with a line that says what it is."""
    log = FIXTURES / "doeks-mpi-cpu-allreduce.txt"
    report = nccl.parse(log.read_text())
    assert report.transport == "mpi-tcp" and not report.efa
    assert [r.size for r in report.rows][:2] == [8, 16] and report.rows[-1].size == 65536
    assert all(r.oop_time_us > 0 and r.ip_busbw is not None for r in report.rows)
    strict = invoke("efa.report", str(log), "--require-efa", "--out", str(tmp_path))
    assert strict.returncode == 1 and "no EFA: this log is doeks' CPU stand-in" in strict.stderr
    assert invoke("efa.report", str(log), "--out", str(tmp_path)).returncode == 0


def test_the_mpijob_on_doeks_cluster_asks_for_no_gpu_efa_hugepages_or_node_type(state_dir):
    """One nccl_mpijob: on TARGET=kubernetes what the workers ask for follows the target (doeks' cluster: a CPU share,
    one rank per worker, no EFA exports); the plan says the image is a stand-in and the device plugin is skipped."""
    import yaml

    from doeks import targets

    s = S.load(environ={"TARGET": "kubernetes", "KUBECONFIG": "", "GPU_NODES": "2"}, path=ROOT / ".env")
    placement = targets.get(s).placement()  # the target's: what its nodes have
    job = efa.nccl_mpijob(s, end=efa.default_end(placement), placement=placement)
    jsonschema.validate(job, crd_schema("kubeflow.org_mpijobs-v2beta1.crd.yaml", "v2beta1"))
    worker = job["spec"]["mpiReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2 and job["spec"]["slotsPerWorker"] == 1
    pod = worker["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod and "volumes" not in pod
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}}
    command = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("-np") + 1] == "2" and command[command.index("-e") + 1] == "1M"
    assert not any(arg.startswith(("FI_", "NCCL_")) for arg in command)
    assert command[0] == "/opt/amazon/openmpi/bin/mpirun" and "/opt/nccl-tests/build/all_reduce_perf" in command
    plan = invoke("efa.test", "--dry-run", "--end", "64K", env={"TARGET": "kubernetes", "KUBECONFIG": ""})
    assert plan.returncode == 0, plan.stderr[-2000:]
    shown = [d for d in yaml.safe_load_all(plan.stdout) if d][0]
    assert shown["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"] == pod
    assert "is doeks' stand-in" in plan.stderr and "kubectl delete mpijob test-efa-nccl" in plan.stderr
    deploy = invoke("efa.deploy", "--dry-run", env={"TARGET": "kubernetes", "KUBECONFIG": ""})
    assert deploy.returncode == 0 and "kind: DaemonSet" not in deploy.stdout
    assert "the EFA device plugin is skipped" in deploy.stderr and "mpioperator/mpi-operator:0.8.0" in deploy.stderr


def test_waiting_for_the_mpijob_keeps_what_the_launcher_said_before_its_pod_is_deleted(monkeypatch):
    """A launcher that fails for good is deleted with its logs when its Job gives up (on doeks' cluster, with the ssh
    client setting removed from the stand-in image, efa.test's error had no launcher line): the wait keeps the last
    lines it read while polling."""
    import json
    import subprocess

    polls = iter([({"status": {"conditions": [{"type": "Running", "status": "True"}]}}, "Host key verification failed.\n"),
                  ({"status": {"conditions": [{"type": "Failed", "status": "True", "message": "backoff limit"}]}}, "")])
    current = {}

    def fake_run(argv, **kwargs):
        if argv[1] == "get":
            current["job"], current["log"] = next(polls)
            return subprocess.CompletedProcess(argv, 0, json.dumps(current["job"]), "")
        return subprocess.CompletedProcess(argv, 0, current["log"], "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr("doeks.kube.kubectl", lambda: "kubectl")
    state, said = efa.wait_for_mpijob("test-efa-nccl", "default", timeout_s=60, poll_s=0)
    assert state == "Failed (backoff limit)" and said == "Host key verification failed."


def test_deploy_replaces_eksctls_plugin_under_either_of_its_names(state_dir):
    """eksctl v0.204.0+ (eksctl#8201; doeks pins v0.215.0) names its EFA plugin DaemonSet aws-efa-k8s-device-plugin,
    before that aws-efa-k8s-device-plugin-daemonset: `efa.deploy` deletes it under both names, never doeks' own."""
    assert set(efa.EKSCTL_DAEMONSETS) == {"aws-efa-k8s-device-plugin", "aws-efa-k8s-device-plugin-daemonset"}
    result = invoke("efa.deploy", "--dry-run", env={"TARGET": "eks"})
    assert result.returncode == 0, result.stderr
    for name in efa.EKSCTL_DAEMONSETS:
        assert (f"kubectl delete daemonset -n kube-system --field-selector metadata.name={name} "
                "-l 'app.kubernetes.io/part-of!=doeks' --ignore-not-found") in result.stderr, result.stderr[-2000:]

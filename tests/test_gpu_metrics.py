"""gpu-metrics: the agent manifests validate; the local sampler really puts metrics to a moto server process, and
`show` reads them back with GetMetricData and plots them."""
from __future__ import annotations

import json

import pytest

from doeks import gpumetrics
from doeks import settings as S
from doeks import services

from .conftest import ROOT, invoke, wait_for
from .test_jobspec import k8s_validate


def test_agent_manifests_validate_and_use_env():
    s = S.load(environ={"AWS_REGION": "eu-west-1", "CLUSTER_NAME": "train-1"}, path=ROOT / ".env")
    docs = gpumetrics.manifests(s, interval=30)
    for doc in docs:
        k8s_validate(doc)
    config = json.loads(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["cwagentconfig.json"])
    assert config["agent"]["region"] == "eu-west-1"
    # top-level append_dimensions keeps only the four ${aws:...} keys: ClusterName goes on the plugin (test_identity)
    assert config["metrics"]["metrics_collected"]["nvidia_gpu"]["append_dimensions"]["ClusterName"] == "train-1"
    assert config["metrics"]["metrics_collected"]["nvidia_gpu"]["measurement"] == list(gpumetrics.GPU_MEASUREMENTS)
    assert config["metrics"]["metrics_collected"]["nvidia_gpu"]["metrics_collection_interval"] == 30
    daemonset = docs[-1]
    assert daemonset["spec"]["template"]["spec"]["nodeSelector"] == {"processor": "gpu"}
    assert all(d["metadata"].get("namespace") in (None, gpumetrics.K8S_NAMESPACE) for d in docs)


def test_deploy_dry_run_on_eks_prints_manifests(state_dir):
    result = invoke("gpu-metrics.deploy", "--agent", "--dry-run", "--interval", "15", env={"TARGET": "eks"})
    assert result.returncode == 0, result.stderr
    assert "kind: DaemonSet" in result.stdout and "kubectl apply --server-side" in result.stderr
    addon = invoke("gpu-metrics.deploy", "--dry-run", env={"TARGET": "eks"})  # the default: the EKS add-on
    assert addon.returncode == 0, addon.stderr
    assert "would call: eks.create_addon" in addon.stderr and "amazon-cloudwatch-observability" in addon.stderr
    assert "set-context" not in result.stdout + result.stderr


def test_bad_interval_and_since_are_one_line_errors(state_dir):
    bad = invoke("gpu-metrics.deploy", "--interval", "0")
    assert bad.returncode == 1 and "--interval 0" in bad.stderr and not (state_dir / "services").exists()
    since = invoke("gpu-metrics.show", "--since", "soon")
    assert since.returncode == 1 and "--since" in since.stderr and "Traceback" not in since.stderr


def test_local_sampler_puts_metrics_that_show_reads_back_and_plots(state_dir, tmp_path):
    deployed = invoke("gpu-metrics.deploy", "--interval", "1")
    assert deployed.returncode == 0, deployed.stderr
    sampler = services.gpu_sampler(state_dir)
    assert sampler.info() is not None
    heartbeat = state_dir / "services" / "gpu-metrics" / "heartbeat"  # rewritten after each put (doeks.gpumetrics)
    puts = set()  # the heartbeat's times (a read between its truncation and its write finds it empty)
    wait_for(lambda: puts.update({heartbeat.read_text()} - {""}) or len(puts) >= 3, 120, "three samples put by the sampler",
             poll=0.2)
    shown = invoke("gpu-metrics.show", "--since", "10m", "--out", str(tmp_path), env={"COLUMNS": "200"})
    assert shown.returncode == 0, shown.stderr
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs and all(p.stat().st_size > 3000 for p in tmp_path.glob("*.png"))
    assert any(name.startswith(("cpu_usage_active", "nvidia_smi_utilization_gpu")) for name in pngs)
    default = invoke("gpu-metrics.show", "--since", "10m", env={"COLUMNS": "200"})  # no --out: STATE_DIR/plots
    assert default.returncode == 0, default.stderr
    written = sorted((state_dir / "plots" / "gpu-metrics").glob("*.png"))
    assert [p.name for p in written] == pngs and all(f"plot: {p}" in default.stderr for p in written)
    assert invoke("gpu-metrics.delete").returncode == 0
    assert sampler.info() is None
    again = invoke("gpu-metrics.delete")
    assert again.returncode == 0 and "not running" in again.stderr
    assert invoke("eks.delete").returncode == 0
    assert services.moto(state_dir).info() is None

"""Where task outputs land (STATE_DIR/plots or --out, named after the input or job, path printed) and what the charts
show (inspected on the matplotlib Figure before it is saved: axis scales, labels with units, legend texts, limits)."""
from __future__ import annotations

import shutil
from datetime import datetime, timedelta, timezone

import matplotlib.dates as mdates
import pytest

from doeks import elastic, gpumetrics, nccl, plots
from doeks import settings as S

from .conftest import ROOT, invoke, shared_fixture

def seed_log():  # all_reduce_perf, 2 x p4d.24xlarge, EFA
    return shared_fixture("nccl-tests-p4d-efa4.txt")
# the header rank 0 writes (doeks/workload/train.py, _Metrics.FIELDS); val rows leave world_size empty, as there
HEADER = "time,kind,step,epoch,loss,accuracy,samples_per_s,world_size"


def _legend(ax) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend else []


def test_busbw_chart_is_log_log_in_bytes_and_gbps_and_small_messages_are_not_zero():
    report = nccl.parse(seed_log().read_text())
    # the real log prints 0.00 GB/s for every message up to 1 KiB (two decimals): the chart derives them from time
    assert [r.oop_busbw for r in report.rows[:8]] == [0.0] * 8
    points = dict(nccl.busbw_points(report))
    assert 1e-5 < points[8] < 1e-4 and points[1024] < points[2048] < points[4096]
    assert points[1073741824] == pytest.approx(42.03)  # printed exactly where it is large enough
    fig = nccl.chart_figure(report, "p4d")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert "bytes" in ax.get_xlabel() and "GB/s" in ax.get_ylabel()
    assert _legend(ax) == ["out-of-place", "in-place"]
    low, high = ax.get_ylim()
    assert low < points[8] and high > 42.03  # the whole range is on the chart: 6 decades
    assert ax.xaxis.get_major_formatter()(2 ** 20, 0) == "1MiB" and ax.xaxis.get_major_formatter()(8, 0) == "8B"
    plots._pyplot().close(fig)


def test_gpu_metric_with_one_point_spans_a_minute_not_years():
    now = datetime(2026, 11, 22, 21, 0, tzinfo=timezone.utc)
    fig = gpumetrics.metric_figure("cpu_usage_active", "ip-10-0-1-5", [(now, 12.5)])
    ax = fig.axes[0]
    low, high = ax.get_xlim()  # days since the epoch (matplotlib.dates)
    assert 0 < (high - low) * 86400 <= 120 and low < mdates.date2num(now) < high
    assert ax.get_ylabel() == "cpu_usage_active (%)" and ax.get_ylim() == (0, 100)
    assert _legend(ax) == ["ip-10-0-1-5"]
    plots._pyplot().close(fig)
    hour = [(now + timedelta(minutes=m), 250.0 + m) for m in range(0, 61, 5)]
    fig = gpumetrics.metric_figure("nvidia_smi_power_draw", "node-1/gpu0", hour)
    ax = fig.axes[0]
    low, high = ax.get_xlim()
    assert 60 * 60 < (high - low) * 86400 < 70 * 60
    assert ax.get_ylabel() == "nvidia_smi_power_draw (W)"
    assert gpumetrics.unit_of("node_gpu_memory_used") == "bytes" and gpumetrics.unit_of("nvidia_smi_memory_used") == "MiB"
    plots._pyplot().close(fig)


def test_training_plot_labels_world_size_changes_and_units():
    rows = [dict(zip(HEADER.split(","), line.split(","))) for line in
            [f"17953753{i:02d}.0,train,{i},0,1.5,0.4,{20 + i},{4 if i <= 10 else 2}" for i in range(1, 21)]
            + ["1795375399.0,val,20,0,1.2,0.55,,"]]
    fig = plots.training_figure(rows, "imagenet (resnet18)")
    loss, accuracy, throughput = fig.axes
    assert _legend(throughput) == ["all ranks", "world size 4 → 2 (step 11)"]
    assert _legend(accuracy) == ["train (batch)", "validation", "world size 4 → 2 (step 11)"]
    assert throughput.get_ylabel() == "samples/s" and "step" in loss.get_xlabel() and "fraction" in accuracy.get_ylabel()
    assert fig._suptitle.get_text() == "imagenet (resnet18) (world size 4 at start)"
    plots._pyplot().close(fig)


def test_efa_report_writes_under_state_dir_named_after_its_input(state_dir, tmp_path):
    inputs = tmp_path / "logs"
    inputs.mkdir()
    log = inputs / "p4d-run-3.txt"
    shutil.copy(seed_log(), log)
    result = invoke("efa.report", str(log), env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    png = state_dir / "plots" / "p4d-run-3-busbw.png"
    assert png.stat().st_size > 5000 and f"chart: {png}" in result.stderr
    assert sorted(p.name for p in inputs.iterdir()) == ["p4d-run-3.txt"]  # nothing beside the input
    folder = invoke("efa.report", str(log), "--out", str(tmp_path / "charts"))
    assert folder.returncode == 0 and (tmp_path / "charts" / "p4d-run-3-busbw.png").exists()
    named = invoke("efa.report", str(log), "--out", str(tmp_path / "mine.png"))
    assert named.returncode == 0 and (tmp_path / "mine.png").exists()


def test_elasticjob_plot_goes_to_plots_and_survives_a_fresh_deploy(state_dir):
    s = S.load(environ={"TARGET": "local", "STATE_DIR": str(state_dir)}, path=ROOT / ".env")
    metrics = elastic.metrics_dir(s)
    metrics.mkdir(parents=True)
    (metrics / "metrics.csv").write_text(HEADER + "\n" + "".join(
        f"17953753{i:02d}.0,train,{i},0,1.5,0.4,{20 + i},2\n" for i in range(1, 6)))
    result = invoke("elasticjob.plot")
    assert result.returncode == 0, result.stderr
    png = state_dir / "plots" / f"{s.job_name}-training.png"
    assert png.stat().st_size > 5000 and f"plot: {png}" in result.stderr
    elastic.clear_outputs(s)  # what `elasticjob.deploy --fresh` runs first (targets/local.py, targets/docker.py)
    assert not metrics.exists() and png.exists()

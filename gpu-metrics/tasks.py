"""gpu-metrics: the CloudWatch agent on GPU nodes (utilization, memory, temperature, power in the CWAgent namespace)
and `show`, which pulls the series with GetMetricData and draws a PNG per metric per node.

deploy/delete/status ask the target (doeks.targets: `metrics_deploy`, `metrics_delete`, `metrics_status`). On
TARGET=local/docker a sampler process puts the same metrics (nvidia-smi when present, else CPU and memory) to the local
AWS-API endpoint, so `show` works the same.
"""
from invoke import Collection

from doeks.taskkit import Int, Unit, runner, settings, target, task


@task(help={"interval": "seconds between samples", "agent": "the CloudWatch agent DaemonSet instead of the add-on (fallback)",
            "dry_run": "print the manifests or the sampler; change nothing"}, flags={"interval": Int(1, 3600)})
def deploy(c, interval=60, agent=False, dry_run=False):
    """GPU metrics per node: the CloudWatch observability add-on, or with --agent the CloudWatch agent DaemonSet.

    The add-on is amazon-cloudwatch-observability (Container Insights + DCGM exporter); the agent runs on GPU nodes;
    each with a Pod Identity role (TARGET=local/docker: the sampler)."""
    from doeks.errors import DoeksError

    interval = int(interval)
    if not 1 <= interval <= 3600:
        raise DoeksError(f"--interval {interval}: expected 1 to 3600 seconds")
    target().metrics_deploy(runner(dry_run), interval, agent)


@task(help={"dry_run": "print what would be deleted; change nothing"})
def delete(c, dry_run=False):
    """Delete the agent (TARGET=local/docker: stop the sampler); safe to run twice; never changes your kubectl namespace."""
    target().metrics_delete(runner(dry_run))


@task
def status(c):
    """Show where metrics come from (agent DaemonSet or local sampler)."""
    target().metrics_status()


@task(help={"since": "how far back, e.g. 30m, 3h, 1d", "out": "folder for the PNGs (default: STATE_DIR/plots/gpu-metrics)"})
def show(c, since="1h", out=None):
    """Pull the metric series with GetMetricData and draw a PNG per metric per node."""
    import re
    from datetime import timedelta
    from pathlib import Path

    from doeks import aws, gpumetrics, ui
    from doeks.errors import DoeksError

    match = re.fullmatch(r"(\d+)([smhd])", str(since))
    if not match:
        raise DoeksError(f"--since {since!r}: expected a number and s, m, h or d (e.g. 30m)")
    seconds = int(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
    s = settings()
    data = gpumetrics.series(aws.client(s, "cloudwatch"), timedelta(seconds=seconds), period=60 if seconds > 3600 else 10)
    if not data:
        raise DoeksError(f"no metrics in namespace {gpumetrics.NAMESPACE} for the last {since}: is `invoke gpu-metrics.deploy` running?")
    rows = [[metric, node, len(points), f"{points[-1][1]:.1f}" if points else ""]
            for metric, nodes in sorted(data.items()) for node, points in sorted(nodes.items())]
    ui.table(f"{gpumetrics.NAMESPACE} metrics, last {since}", ["metric", "node", "points", "latest"], rows)
    paths = gpumetrics.plot_series(data, Path(out) if out else s.state_dir / "plots" / "gpu-metrics")
    for path in paths:
        ui.say(f"plot: {path}")


ns = Collection("gpu-metrics", deploy, delete, status, show)
UNIT = Unit("gpu-metrics", order=40, up=deploy, down=delete)

"""gpu-metrics: the CloudWatch agent on GPU nodes (utilization, memory, temperature, power in the CWAgent namespace)
and `show`, which pulls the series with GetMetricData and draws a PNG per metric per node.

On TARGET=local/docker a sampler process puts the same metrics (nvidia-smi when present, else CPU and memory) to the local
AWS-API endpoint, so `show` works the same.
"""
from invoke import Collection

from doeks.taskkit import Int, Unit, runner, settings, task


@task(help={"interval": "seconds between samples", "agent": "the CloudWatch agent DaemonSet instead of the add-on (fallback)",
            "dry_run": "print the manifests or the sampler; change nothing"}, flags={"interval": Int(1, 3600)})
def deploy(c, interval=60, agent=False, dry_run=False):
    """GPU metrics per node: the CloudWatch observability add-on, or with --agent the CloudWatch agent DaemonSet.

    The add-on is amazon-cloudwatch-observability (Container Insights + DCGM exporter); the agent runs on GPU nodes;
    each with a Pod Identity role (TARGET=local/docker: the sampler)."""
    from doeks import aws, gpumetrics, kube, ui
    from doeks.errors import DoeksError
    from doeks.local import services

    s = settings()
    interval = int(interval)
    if not 1 <= interval <= 3600:
        raise DoeksError(f"--interval {interval}: expected 1 to 3600 seconds")
    r = runner(dry_run)
    if s.target == "kubernetes":
        ui.say("TARGET=kubernetes: GPU metrics go to CloudWatch, which is AWS's; nothing to deploy on this cluster")
        return
    if not s.on_this_machine:
        from doeks import identity, storage

        # one copy per node: the add-on's agent and the DaemonSet would both collect and put the same GPUs
        if agent:
            storage.delete_addon(s, r, gpumetrics.ADDON)
            identity.ensure(s, r, identity.get("cloudwatch-agent-gpu"))
            kube.apply(r, gpumetrics.manifests(s, interval))
            return
        kube.delete(r, [m for m in gpumetrics.manifests(s, interval) if m["kind"] in ("DaemonSet", "ConfigMap")])
        associations = identity.addon_associations(s, r, identity.get("cloudwatch-observability"))
        if not dry_run and storage.addon_exists(s, gpumetrics.ADDON):
            ui.say(f"add-on {gpumetrics.ADDON} exists")
            return
        r.call(aws.client(s, "eks"), "create_addon", clusterName=s.cluster_name, addonName=gpumetrics.ADDON,
               resolveConflicts="OVERWRITE", podIdentityAssociations=associations, tags={storage.TAG: s.cluster_name})
        return
    endpoint = "AWS_ENDPOINT_URL" if dry_run else aws.endpoint_url(s)
    sampler = services.gpu_sampler(s.state_dir, endpoint, s.aws_region, s.cluster_name, interval)
    if sampler.info():
        ui.say(f"local GPU-metrics sampler already running (pid {sampler.info()['pid']})")
        return
    r.step(f"start local GPU-metrics sampler every {interval}s -> {endpoint} (namespace {gpumetrics.NAMESPACE})", sampler.start)


@task(help={"dry_run": "print what would be deleted; change nothing"})
def delete(c, dry_run=False):
    """Delete the agent (TARGET=local/docker: stop the sampler); safe to run twice; never changes your kubectl namespace."""
    from doeks import gpumetrics, kube, ui
    from doeks.local import services

    s = settings()
    r = runner(dry_run)
    if s.target == "kubernetes":
        ui.say("TARGET=kubernetes: no GPU-metrics agent was deployed; nothing to delete")
        return
    if not s.on_this_machine:
        from doeks import identity, storage

        storage.delete_addon(s, r, gpumetrics.ADDON)
        identity.remove(s, r, identity.get("cloudwatch-observability"))
        kube.delete(r, gpumetrics.delete_manifests(s))
        identity.remove(s, r, identity.get("cloudwatch-agent-gpu"))
        return
    sampler = services.gpu_sampler(s.state_dir)
    if sampler.info() is None:
        ui.say("local GPU-metrics sampler is not running")
        return
    r.step("stop local GPU-metrics sampler", sampler.stop)


@task
def status(c):
    """Show where metrics come from (agent DaemonSet or local sampler)."""
    from doeks import gpumetrics, kube, ui
    from doeks.local import services

    s = settings()
    if s.target == "kubernetes":
        ui.say("TARGET=kubernetes: no GPU-metrics agent (CloudWatch is AWS's)")
        return
    if not s.on_this_machine:
        kube.show(runner(), ["daemonset", "-n", gpumetrics.K8S_NAMESPACE, "-o", "wide"])  # add-on's and agent's
        return
    info = services.gpu_sampler(s.state_dir).info()
    ui.table("gpu-metrics (local)", ["sampler", "pid"], [["running" if info else "stopped", info["pid"] if info else ""]])


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

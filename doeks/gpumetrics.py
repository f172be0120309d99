"""GPU metrics in CloudWatch: the CloudWatch agent as a DaemonSet on GPU nodes (EKS), or a local sampler process
that puts the same metrics to the AWS-API endpoint (nvidia-smi when present, else CPU and memory); `show` reads the
series back with GetMetricData and draws a PNG per metric per node.
"""
from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

NAMESPACE = "CWAgent"
INSIGHTS_NAMESPACE = "ContainerInsights"  # the amazon-cloudwatch-observability add-on's metrics (node_gpu_* via DCGM)
ADDON = "amazon-cloudwatch-observability"
K8S_NAMESPACE = "amazon-cloudwatch"
AGENT_IMAGE = "public.ecr.aws/cloudwatch-agent/cloudwatch-agent:1.300057.1b1167"
GPU_MEASUREMENTS = ("utilization_gpu", "utilization_memory", "temperature_gpu", "power_draw", "memory_total", "memory_used")
LABELS = {"app.kubernetes.io/part-of": "doeks", "app.kubernetes.io/name": "cloudwatch-agent-gpu"}


def agent_config(settings, interval: int) -> dict[str, Any]:
    """One series per node and GPU. aws/amazon-cloudwatch-agent (translator/translate/agent/ruleOmitHostname.go):
    in a container `omit_hostname` defaults to true, so the `host` dimension is dropped unless set to false; and
    top-level `append_dimensions` accepts only ImageId, InstanceId, InstanceType and AutoScalingGroupName with their
    ${aws:...} values (translator/translate/metrics/ruleAppendDimensions.go), so ClusterName goes on the plugin."""
    return {
        "agent": {"region": settings.aws_region, "metrics_collection_interval": interval, "omit_hostname": False},
        "metrics": {
            "namespace": NAMESPACE,
            "append_dimensions": {"InstanceId": "${aws:InstanceId}"},
            "metrics_collected": {"nvidia_gpu": {"measurement": list(GPU_MEASUREMENTS),
                                                 "metrics_collection_interval": interval,
                                                 "append_dimensions": {"ClusterName": settings.cluster_name}}},
        },
    }


def per_node_dimensions(config: dict[str, Any]) -> set[str]:
    """The dimensions that tell one node's series from another's in an agent config (empty: all nodes collapse)."""
    found = set()
    if config.get("agent", {}).get("omit_hostname") is False:
        found.add("host")
    top = config.get("metrics", {}).get("append_dimensions", {})
    if top.get("InstanceId") == "${aws:InstanceId}":
        found.add("InstanceId")
    return found


def manifests(settings, interval: int = 60) -> list[dict[str, Any]]:
    meta = {"namespace": K8S_NAMESPACE, "labels": LABELS}
    name = "cloudwatch-agent-gpu"
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": K8S_NAMESPACE, "labels": LABELS}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, **meta}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name, "labels": LABELS},
         "rules": [{"apiGroups": [""], "resources": ["pods", "nodes", "endpoints"], "verbs": ["get", "list", "watch"]},
                   {"apiGroups": [""], "resources": ["nodes/stats", "configmaps", "events"], "verbs": ["get", "create"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name, "labels": LABELS},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": K8S_NAMESPACE}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, **meta},
         "data": {"cwagentconfig.json": json.dumps(agent_config(settings, interval), indent=2)}},
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name, **meta},
         "spec": {"selector": {"matchLabels": {"name": name}},
                  "template": {"metadata": {"labels": {"name": name, **LABELS}}, "spec": {
                      "serviceAccountName": name,
                      "nodeSelector": {"processor": "gpu"},
                      "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                      "containers": [{
                          "name": "cloudwatch-agent", "image": AGENT_IMAGE,
                          # the NVIDIA container runtime (EKS GPU AMIs) mounts nvidia-smi into the container
                          "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                                  {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"},
                                  {"name": "AWS_REGION", "value": settings.aws_region},
                                  {"name": "HOST_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                          "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
                          "volumeMounts": [{"name": "config", "mountPath": "/etc/cwagentconfig"}],
                      }],
                      "volumes": [{"name": "config", "configMap": {"name": name}}],
                  }}}},
    ]


def log_group_prefix(cluster: str) -> str:
    """Where the add-on's agent and Fluent Bit write (Container Insights: application, dataplane, host, performance):
    log groups the add-on creates and nothing deletes, not even deleting the add-on."""
    return f"/aws/containerinsights/{cluster}/"


def delete_log_groups(settings, runner) -> int:
    """Delete the add-on's Container Insights log groups of this cluster (after the add-on is gone: its agent would
    write them again); how many there were. Safe twice."""
    from . import ui
    from .aws import client, lookup

    logs = client(settings, "logs")
    prefix = log_group_prefix(settings.cluster_name)
    groups = lookup(runner, f"log groups {prefix}*", lambda: [g["logGroupName"] for page in logs.get_paginator(
        "describe_log_groups").paginate(logGroupNamePrefix=prefix) for g in page["logGroups"]], None)
    if groups is None:  # a dry run without credentials
        runner.call(logs, "delete_log_group", logGroupName=f"<each log group {prefix}*, if any>")
        return 0
    if not groups:
        ui.say(f"no log group {prefix}*")
    for name in groups:
        try:
            runner.call(logs, "delete_log_group", logGroupName=name)
        except logs.exceptions.ResourceNotFoundException:
            pass
    return len(groups)


def delete_manifests(settings) -> list[dict[str, Any]]:
    """What `gpu-metrics.delete` removes, in reverse order: the agent's objects but never the amazon-cloudwatch
    Namespace, which the CloudWatch add-on owns (and may still run in)."""
    return [m for m in reversed(manifests(settings)) if m["kind"] != "Namespace"]


# -- local sampler ------------------------------------------------------------------------------------------------
def sample() -> list[tuple[str, dict[str, str], float, str]]:
    """(metric, dimensions, value, unit) now: GPU metrics from nvidia-smi, else host CPU and memory."""
    import shutil
    import socket
    import subprocess

    host = socket.gethostname()
    if shutil.which("nvidia-smi"):
        fields = ",".join(GPU_MEASUREMENTS).replace("utilization_", "utilization.").replace("temperature_gpu", "temperature.gpu") \
            .replace("power_draw", "power.draw").replace("memory_total", "memory.total").replace("memory_used", "memory.used")
        out = subprocess.run(["nvidia-smi", f"--query-gpu=index,{fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            points = []
            for line in out.stdout.strip().splitlines():
                index, *values = [v.strip() for v in line.split(",")]
                for name, value in zip(GPU_MEASUREMENTS, values):
                    try:
                        points.append((f"nvidia_smi_{name}", {"host": host, "index": index}, float(value), "None"))
                    except ValueError:
                        continue
            return points
    return [("cpu_usage_active", {"host": host}, _cpu_percent(), "Percent"),
            ("mem_used_percent", {"host": host}, _memory_percent(), "Percent")]


_LAST_CPU: list[tuple[int, int]] = []


def _cpu_percent() -> float:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle, total = values[3] + values[4], sum(values)
    if not _LAST_CPU:
        _LAST_CPU.append((idle, total))
        time.sleep(0.2)
        return _cpu_percent()
    last_idle, last_total = _LAST_CPU[-1]
    _LAST_CPU[-1] = (idle, total)
    return 100.0 * (1 - (idle - last_idle) / max(1, total - last_total))


def _memory_percent() -> float:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0])
    return 100.0 * (1 - info["MemAvailable"] / info["MemTotal"])


def put(cloudwatch, cluster: str, points) -> None:
    data = [{"MetricName": name, "Dimensions": [{"Name": k, "Value": v} for k, v in {**dims, "ClusterName": cluster}.items()],
             "Value": value, "Unit": unit, "Timestamp": datetime.now(timezone.utc)} for name, dims, value, unit in points]
    cloudwatch.put_metric_data(Namespace=NAMESPACE, MetricData=data)


def run_sampler(endpoint: str, region: str, cluster: str, interval: float, heartbeat: Path) -> None:
    """The local sampler's loop (its own process): sample, put, sleep; writes a heartbeat after each put."""
    import boto3

    cloudwatch = boto3.client("cloudwatch", endpoint_url=endpoint, region_name=region,
                              aws_access_key_id="testing", aws_secret_access_key="testing")
    while True:
        put(cloudwatch, cluster, sample())
        heartbeat.write_text(str(time.time()))
        time.sleep(interval)


# -- reading back -------------------------------------------------------------------------------------------------
def node_of(dims: dict[str, str]) -> str | None:
    """The node (and GPU) a series belongs to, or None for an aggregate (e.g. ClusterName only)."""
    node = dims.get("host") or dims.get("NodeName") or dims.get("InstanceId")
    if node is None:
        return None
    gpu = dims.get("index") or dims.get("GpuDevice")
    return node + (f"/gpu{gpu}" if gpu is not None else "")


def series(cloudwatch, since: timedelta, period: int = 60) -> dict[str, dict[str, list[tuple[datetime, float]]]]:
    """metric -> node (host[/gpu index]) -> [(time, value)], from the per-node series of the agent (CWAgent) or of
    the amazon-cloudwatch-observability add-on (ContainerInsights, node_gpu_* metrics)."""
    metrics = []
    for page in cloudwatch.get_paginator("list_metrics").paginate(Namespace=NAMESPACE):
        metrics.extend({**m, "Namespace": NAMESPACE} for m in page["Metrics"])
    for page in cloudwatch.get_paginator("list_metrics").paginate(Namespace=INSIGHTS_NAMESPACE):
        metrics.extend({**m, "Namespace": INSIGHTS_NAMESPACE} for m in page["Metrics"] if m["MetricName"].startswith("node_gpu_"))
    metrics = [m for m in metrics if node_of({d["Name"]: d["Value"] for d in m.get("Dimensions", [])}) is not None]
    end = datetime.now(timezone.utc) + timedelta(minutes=1)
    start = end - since - timedelta(minutes=1)
    result: dict[str, dict[str, list[tuple[datetime, float]]]] = {}
    for offset in range(0, len(metrics), 500):
        batch = metrics[offset:offset + 500]
        queries = [{"Id": f"m{i}", "MetricStat": {"Metric": m, "Period": period, "Stat": "Average"}, "ReturnData": True}
                   for i, m in enumerate(batch)]
        response = cloudwatch.get_metric_data(MetricDataQueries=queries, StartTime=start, EndTime=end)
        for item in response["MetricDataResults"]:
            metric = batch[int(item["Id"][1:])]
            dims = {d["Name"]: d["Value"] for d in metric.get("Dimensions", [])}
            node = node_of(dims)
            points = sorted(zip(item["Timestamps"], item["Values"]))
            result.setdefault(metric["MetricName"], {}).setdefault(node, []).extend(points)
    return result


# Units of the series doeks plots (first match wins): Container Insights' node_gpu_memory_used/total are bytes (AWS
# docs "Amazon EKS and Kubernetes Container Insights metrics", NVIDIA GPU table); the local sampler's and the
# CloudWatch agent's nvidia_smi_* come from `nvidia-smi --format=csv,nounits`, whose header units are %, C, W, MiB.
UNITS = (("node_gpu_memory_used", "bytes"), ("node_gpu_memory_total", "bytes"), ("utilization", "%"),
         ("percent", "%"), ("usage_active", "%"), ("temperature", "°C"), ("power", "W"), ("memory_total", "MiB"),
         ("memory_used", "MiB"))


def unit_of(metric: str) -> str:
    return next((unit for key, unit in UNITS if key in metric), "")


def metric_figure(metric: str, node: str, points: list[tuple[datetime, float]]):
    """One metric on one node against UTC time. The x range is the data's own, padded (at least a minute): a single
    point would otherwise get matplotlib's default date range of years."""
    import matplotlib.dates as mdates

    from .plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3))
    times, values = zip(*points)
    ax.plot(times, values, "o-", markersize=3, label=node)
    unit = unit_of(metric)
    ax.set(title=f"{metric} on {node}", xlabel="time (UTC)", ylabel=f"{metric} ({unit})" if unit else metric)
    first, last = min(times), max(times)
    pad = max(timedelta(seconds=30), (last - first) * 0.05)
    ax.set_xlim(first - pad, last + pad)
    locator = mdates.AutoDateLocator(tz=timezone.utc)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, tz=timezone.utc))
    if unit == "%":
        ax.set_ylim(0, max(100.0, max(values) * 1.05))
    ax.legend(fontsize="small")
    ax.grid(True, alpha=0.3)
    return fig


def plot_series(data, out_dir: Path) -> list[Path]:
    from .plots import save

    paths = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for metric, nodes in sorted(data.items()):
        for node, points in sorted(nodes.items()):
            if not points:
                continue
            fig = metric_figure(metric, node, points)
            paths.append(save(fig, out_dir / f"{metric}--{node.replace('/', '_')}.png", dpi=90))
    return paths

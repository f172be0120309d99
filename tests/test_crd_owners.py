"""One owner per controller and CRD, one copy per add-on: what each unit installs on the cluster, side by side.

INSTALLS maps a unit (or an upstream tool acting for one) to the objects it puts on the cluster: doeks' own are
rendered from its code; upstream ones are recorded with their source. Add a unit by adding an entry (the MPIJob CRD
and the training operator / Kubeflow platform belong to issue 12 and are added there).
"""
from __future__ import annotations

import re

from doeks import efa, gpumetrics
from doeks import settings as S

from .conftest import invoke

# eksctl-io/eksctl pkg/addons/assets/efa-device-plugin.yaml (eksctl installs it for a node group with efaEnabled):
# DaemonSet kube-system/aws-efa-k8s-device-plugin-daemonset, image .../eks/aws-efa-k8s-device-plugin:v0.3.3,
# tolerations CriticalAddonsOnly and aws.amazon.com/efa only.
EKSCTL_EFA = [{"apiVersion": "apps/v1", "kind": "DaemonSet",
               "metadata": {"name": "aws-efa-k8s-device-plugin-daemonset", "namespace": "kube-system"},
               "spec": {"template": {"spec": {"containers": [{"image": "602401143452.dkr.ecr.us-west-2.amazonaws.com/eks/aws-efa-k8s-device-plugin:v0.3.3"}],
                                              "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"},
                                                              {"key": "aws.amazon.com/efa", "operator": "Exists", "effect": "NoSchedule"}]}}}}]
# amazon-cloudwatch-observability add-on (aws-observability/helm-charts, charts/amazon-cloudwatch-observability):
# the operator runs DaemonSet amazon-cloudwatch/cloudwatch-agent (image cloudwatch-agent/cloudwatch-agent) and
# dcgm-exporter on GPU nodes.
CLOUDWATCH_ADDON = [{"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "cloudwatch-agent", "namespace": "amazon-cloudwatch"},
                     "spec": {"template": {"spec": {"containers": [{"image": "public.ecr.aws/cloudwatch-agent/cloudwatch-agent:1.300060.0b1248"}]}}}},
                    {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "dcgm-exporter", "namespace": "amazon-cloudwatch"},
                     "spec": {"template": {"spec": {"containers": [{"image": "public.ecr.aws/nvidia/k8s/dcgm-exporter:3.3.7-3.5.0-ubuntu22.04"}]}}}}]


def installs(s) -> dict[str, list[dict]]:
    return {"eksctl (efaEnabled)": EKSCTL_EFA, "efa": efa.device_plugin(s), "gpu-metrics (add-on)": CLOUDWATCH_ADDON,
            "gpu-metrics --agent": gpumetrics.manifests(s)}


# units that exclude each other (deploying one removes the other: test below)
EXCLUSIVE = [{"gpu-metrics (add-on)", "gpu-metrics --agent"}]


def repository(image: str) -> str:
    return re.sub(r"^[^/]*\.[^/]*/", "", image).rsplit("@", 1)[0].rsplit(":", 1)[0]


def controllers(docs):
    for doc in docs:
        if doc["kind"] in ("DaemonSet", "Deployment", "StatefulSet"):
            pod = doc["spec"]["template"]["spec"]
            for container in pod["containers"]:
                yield (doc["kind"], doc["metadata"].get("namespace"), doc["metadata"]["name"]), repository(container["image"]), pod


def test_no_controller_runs_twice(state_dir):
    s = S.load(environ={"TARGET": "eks"})
    seen: dict[str, tuple[str, tuple]] = {}
    for unit, docs in installs(s).items():
        for ident, repo, _ in controllers(docs):
            if repo in seen and seen[repo][1] != ident and not any({unit, seen[repo][0]} <= pair for pair in EXCLUSIVE):
                raise AssertionError(f"{repo} runs twice: {seen[repo][0]} as {seen[repo][1]} and {unit} as {ident}")
            seen.setdefault(repo, (unit, ident))


def test_one_object_two_writers_ends_as_doeks_copy_that_schedules_on_gpu_nodes(state_dir):
    """eksctl's and doeks' EFA device plugin are one DaemonSet (same name): doeks applies after eksctl with
    server-side apply --force-conflicts, so its pinned v0.5.10 (NVLink not counted as EFA) is what runs, and it
    tolerates the GPU node group's nvidia.com/gpu taint, which eksctl's copy does not (it would never run there)."""
    s = S.load(environ={"TARGET": "eks"})
    (ident_e, _, pod_e), = controllers(EKSCTL_EFA)
    (ident_d, _, pod_d), = controllers(efa.device_plugin(s))
    assert ident_e == ident_d
    assert not any(t["key"] == "nvidia.com/gpu" for t in pod_e["tolerations"])
    assert any(t["key"] == "nvidia.com/gpu" for t in pod_d["tolerations"])


def test_gpu_metrics_modes_remove_each_other(state_dir):
    agent = invoke("gpu-metrics.deploy", "--agent", "--dry-run", env={"TARGET": "eks"})
    assert agent.returncode == 0, agent.stderr
    assert "would call: eks.delete_addon" in agent.stderr and gpumetrics.ADDON in agent.stderr
    addon = invoke("gpu-metrics.deploy", "--dry-run", env={"TARGET": "eks"})
    assert addon.returncode == 0, addon.stderr
    assert "would delete DaemonSet " in addon.stderr  # the agent's, named

"""TARGET=kubernetes without a cluster: the plan a user reviews, the manifests for a plain cluster, the docs' tables.
The cluster itself is exercised in test_kubernetes_cluster.py."""
from __future__ import annotations

import yaml

from .conftest import ROOT, invoke


def test_up_dry_run_says_what_every_unit_does_on_kubernetes(state_dir):
    result = invoke("up", "--dry-run", "--full", env={"TARGET": "kubernetes", "KUBECONFIG": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    err = result.stderr
    for unit in ("eks", "csi", "efa", "gpu-metrics", "kubeflow", "elasticjob"):
        assert f"== up: {unit}" in err
    assert "doeks' own single-node cluster (Kubernetes v1.35.4)" in err
    assert "start kube-apiserver" in err and "start kubelet" in err and "install the network guard" in err
    assert "EFA is an AWS network adapter" in err and "CloudWatch, which is AWS's" in err
    assert "training-operator:v1-93c5489" in err  # the operator image doeks builds under upstream's name
    kinds = [d["kind"] for d in yaml.safe_load_all(result.stdout) if d]
    assert {"StorageClass", "PersistentVolume", "PersistentVolumeClaim", "Deployment", "Service", "PyTorchJob"} <= set(kinds)
    assert "would run: eksctl" not in err and "call: iam." not in err  # nothing of AWS on a plain cluster


def test_the_job_on_a_plain_cluster_asks_for_no_cloud_node_type_and_no_gpu(state_dir):
    result = invoke("elasticjob.deploy", "--dry-run", env={"TARGET": "kubernetes", "KUBECONFIG": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    job = [d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "PyTorchJob"][0]
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert "nodeSelector" not in pod
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}}
    assert pod["containers"][0]["image"].startswith("doeks-train:")  # built and imported here, never pulled
    gpus = invoke("elasticjob.deploy", "--dry-run", env={"TARGET": "kubernetes", "KUBECONFIG": "", "KUBE_GPUS": "2"})
    job = [d for d in yaml.safe_load_all(gpus.stdout) if d and d["kind"] == "PyTorchJob"][0]
    limits = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": 2}


def test_eks_keeps_the_node_type_and_its_gpus(state_dir):
    result = invoke("elasticjob.deploy", "--dry-run", env={"TARGET": "eks", "REGISTRY": "123456789012.dkr.ecr.us-west-2.amazonaws.com"})
    assert result.returncode == 0, result.stderr[-2000:]
    job = [d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "PyTorchJob"][0]
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["nodeSelector"]["node.kubernetes.io/instance-type"] == "p4d.24xlarge"
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8  # NPROC_PER_NODE=auto: a p4d has 8


def test_the_docs_table_of_local_images_is_in_step():
    from doeks.cluster import images

    text = (ROOT / "docs" / "kubernetes.md").read_text()
    assert images.render_table() in text


def test_outside_the_kubernetes_mark_no_cluster_of_the_machine_is_seen():
    """conftest's no_machine_cluster: the cluster folder is the test run's own, empty one, not the machine's
    (~/.local/share/doeks/cluster: the plan above read its pid files and, with a cluster up, its claim's state)."""
    import os
    from pathlib import Path

    from doeks.cluster import node, versions

    machine = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "doeks" / "cluster"
    assert versions.cluster_dir() != machine and not versions.cluster_dir().exists()
    assert not any(node.running().values())

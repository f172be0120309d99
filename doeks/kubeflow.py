"""Kubeflow on the cluster from the pinned upstream manifests (kubeflow/manifests): prerequisites checked first, the
default password replaced, `kustomize build` + server-side apply retried until the CRDs settle, then a wait for the
pods. The user's password is never printed: it is read from KUBEFLOW_PASSWORD or generated and written to a file
only the user can read.
"""
from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

from . import ui
from .errors import DoeksError

VERSION = "v1.10.1"
REPOSITORY = "https://github.com/kubeflow/manifests.git"
DEFAULT_USER = "user@example.com"
NAMESPACES = ("cert-manager", "istio-system", "auth", "oauth2-proxy", "knative-serving", "kubeflow", "kubeflow-user-example-com")


def checkout(settings) -> Path:
    return settings.state_dir / "kubeflow" / f"manifests-{VERSION}"


def overlay_dir(settings) -> Path:
    return settings.state_dir / "kubeflow" / "overlay"


def password_file(settings) -> Path:
    return settings.state_dir / "kubeflow" / "password"


def password(settings) -> str:
    """KUBEFLOW_PASSWORD, else one generated once and kept in a 0600 file (never the upstream default)."""
    given = settings.kubeflow_password
    if given:
        if len(given) < 12 or given == "12341234":
            raise DoeksError("KUBEFLOW_PASSWORD is too weak: use at least 12 characters (the upstream default is refused)")
        return given
    path = password_file(settings)
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_urlsafe(18)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


def dex_patch(hashed: str) -> str:
    """A kustomize patch of dex's config with our bcrypt hash for the default user."""
    import yaml

    config = {"issuer": "http://dex.auth.svc.cluster.local:5556/dex", "storage": {"type": "kubernetes", "config": {"inCluster": True}},
              "web": {"http": "0.0.0.0:5556"}, "logger": {"level": "debug", "format": "text"},
              "oauth2": {"skipApprovalScreen": True}, "enablePasswordDB": True,
              "staticPasswords": [{"email": DEFAULT_USER, "hash": hashed, "username": "user", "userID": "15841185641784"}],
              "staticClients": [{"idEnv": "OIDC_CLIENT_ID", "redirectURIs": ["/oauth2/callback"], "name": "Dex Login Application",
                                 "secretEnv": "OIDC_CLIENT_SECRET"}]}
    patch = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "dex", "namespace": "auth"},
             "data": {"config.yaml": yaml.safe_dump(config, sort_keys=False)}}
    return yaml.safe_dump(patch, sort_keys=False)


def write_overlay(settings) -> Path:
    """overlay/: upstream `example` plus our dex password patch."""
    import bcrypt

    overlay = overlay_dir(settings)
    overlay.mkdir(parents=True, exist_ok=True)
    hashed = bcrypt.hashpw(password(settings).encode(), bcrypt.gensalt(rounds=10)).decode()
    (overlay / "dex-password.yaml").write_text(dex_patch(hashed))
    upstream = os.path.relpath(checkout(settings) / "example", overlay)
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n- {upstream}\npatches:\n- path: dex-password.yaml\n")
    return overlay


def prerequisites(api_client) -> list[str]:
    """What stands in the way on this cluster (empty = ready): a default StorageClass, no foreign Istio, no MPIJob CRD
    from a standalone mpi-operator (Kubeflow's training operator serves MPIJob itself)."""
    from kubernetes import client as k8s

    problems = []
    classes = k8s.StorageV1Api(api_client).list_storage_class().items
    default = [c.metadata.name for c in classes
               if (c.metadata.annotations or {}).get("storageclass.kubernetes.io/is-default-class") == "true"]
    if not default:
        problems.append("no default StorageClass (Kubeflow's databases need one): annotate one with "
                        "storageclass.kubernetes.io/is-default-class=true")
    core = k8s.CoreV1Api(api_client)
    try:
        namespace = core.read_namespace("istio-system")
        if (namespace.metadata.labels or {}).get("app.kubernetes.io/part-of") != "kubeflow":
            problems.append("an Istio not installed by Kubeflow is present (namespace istio-system): remove it or install Kubeflow by hand")
    except k8s.ApiException as error:
        if error.status != 404:
            raise
    try:
        crd = k8s.ApiextensionsV1Api(api_client).read_custom_resource_definition("mpijobs.kubeflow.org")
        versions = [v.name for v in crd.spec.versions]
        problems.append(f"an MPIJob CRD ({', '.join(versions)}) from a standalone mpi-operator is installed: "
                        "remove it first (invoke efa.delete)")
    except k8s.ApiException as error:
        if error.status != 404:
            raise
    return problems


def api_client():
    from kubernetes import config

    try:
        return config.new_client_from_config()
    except Exception as error:  # noqa: BLE001
        raise DoeksError(f"no Kubernetes cluster configured ({type(error).__name__}): run `invoke eks.connect`") from None


def deploy(settings, runner, attempts: int = 20, wait_s: float = 15) -> None:
    from . import kube

    if runner.dry_run:
        runner.run(["git", "clone", "--depth", "1", "--branch", VERSION, REPOSITORY, str(checkout(settings))])
        runner.step(f"write {overlay_dir(settings)} (upstream example + dex password patch, bcrypt hash)", lambda: None)
        runner.run(["kubectl", "kustomize", str(overlay_dir(settings))])
        runner.run(["kubectl", "apply", "--server-side", "--force-conflicts", "-f", "-"])
        return
    problems = prerequisites(api_client())
    if problems:
        raise DoeksError("Kubeflow prerequisites not met: " + "; ".join(problems))
    if not checkout(settings).exists():
        runner.run(["git", "clone", "--depth", "1", "--branch", VERSION, REPOSITORY, str(checkout(settings))])
    overlay = write_overlay(settings)
    built = runner.run([kube.kubectl(), "kustomize", str(overlay)], mutating=False, capture=True).stdout
    with ui.progress() as bar:
        task_id = bar.add_task("applying Kubeflow (CRDs settle over several rounds)", total=attempts)
        for attempt in range(1, attempts + 1):
            result = runner.run([kube.kubectl(), "apply", "--server-side", "--force-conflicts", "-f", "-"],
                                input=built, check=False, capture=True)
            bar.update(task_id, completed=attempt)
            if result.returncode == 0:
                break
            time.sleep(wait_s)
        else:
            raise DoeksError(f"Kubeflow manifests did not apply after {attempts} rounds: see `kubectl get pods -A`")
    for namespace in NAMESPACES:
        runner.run([kube.kubectl(), "wait", "--for=condition=Ready", "pods", "--all", "-n", namespace, "--timeout=600s"], mutating=False)
    ui.say(f"Kubeflow {VERSION} is up; log in as {DEFAULT_USER} with the password in {password_file(settings)} "
           "(or KUBEFLOW_PASSWORD); `invoke kubeflow.expose` opens the dashboard")


def remove(settings, runner) -> None:
    from . import kube

    overlay = overlay_dir(settings)
    if not overlay.exists() and not runner.dry_run:
        ui.say("Kubeflow was not deployed by doeks here (no overlay): nothing to remove")
        return
    if runner.dry_run:
        runner.run(["kubectl", "delete", "--ignore-not-found", "-k", str(overlay)])
        return
    runner.run([kube.kubectl(), "delete", "--ignore-not-found", "-k", str(overlay)], check=False)


def pod_rows(api) -> list[list[Any]]:
    from kubernetes import client as k8s

    core = k8s.CoreV1Api(api)
    rows = []
    for namespace in NAMESPACES:
        try:
            pods = core.list_namespaced_pod(namespace).items
        except k8s.ApiException:
            continue
        ready = sum(1 for p in pods if p.status.phase in ("Running", "Succeeded"))
        rows.append([namespace, len(pods), ready])
    return rows

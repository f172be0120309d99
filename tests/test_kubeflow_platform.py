"""Kubeflow platform deploy: prerequisites read through the official kubernetes client from an HTTP fake of the
API; the default password replaced (bcrypt), never printed; dry-run shows the pinned manifests and commands."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import bcrypt
import pytest
import yaml

from doeks import kubeflow
from doeks import settings as S

from .conftest import ROOT, invoke
from .k8s_fake import FakeCluster, storage_class


@pytest.fixture
def cluster(tmp_path):
    fake = FakeCluster()
    fake.kubeconfig(tmp_path / "kubeconfig")
    yield fake, tmp_path / "kubeconfig"
    fake.close()


def client_for(path):
    from kubernetes import config

    return config.new_client_from_config(config_file=str(path))


def test_ready_cluster_has_no_problems(cluster):
    fake, path = cluster
    fake.storage_classes(storage_class("gp2", False), storage_class("gp3", True))
    assert kubeflow.prerequisites(client_for(path)) == []
    assert "/apis/storage.k8s.io/v1/storageclasses" in fake.requests and "/api/v1/namespaces/istio-system" in fake.requests


def test_every_blocking_condition_is_reported(cluster):
    fake, path = cluster
    fake.storage_classes(storage_class("gp2", False))
    fake.objects["/api/v1/namespaces/istio-system"] = {"kind": "Namespace", "apiVersion": "v1",
                                                       "metadata": {"name": "istio-system", "labels": {"owner": "mesh-team"}}}
    fake.objects["/api/v1/namespaces/cert-manager"] = {"kind": "Namespace", "apiVersion": "v1", "metadata": {"name": "cert-manager"}}
    problems = kubeflow.prerequisites(client_for(path))
    assert len(problems) == 3
    assert "default StorageClass" in problems[0] and "Istio" in problems[1] and "cert-manager" in problems[2]


def test_mpi_operator_does_not_block_the_platform(cluster):
    """26.03's example/ ships no MPIJob CRD (the v1 training operator is commented out), so the MPI operator that
    efa.deploy installs (order 30) must not stop kubeflow.deploy (was: 'remove it first')."""
    fake, path = cluster
    fake.storage_classes(storage_class("gp3", True))
    fake.objects["/apis/apiextensions.k8s.io/v1/customresourcedefinitions/mpijobs.kubeflow.org"] = {
        "kind": "CustomResourceDefinition", "apiVersion": "apiextensions.k8s.io/v1", "metadata": {"name": "mpijobs.kubeflow.org"},
        "spec": {"group": "kubeflow.org", "scope": "Namespaced", "names": {"kind": "MPIJob", "plural": "mpijobs"},
                 "versions": [{"name": "v2beta1", "served": True, "storage": True}]}}
    assert kubeflow.prerequisites(client_for(path)) == []


def test_second_deploy_sees_its_own_istio(cluster, state_dir, tmp_path, monkeypatch):
    """The overlay labels istio-system and cert-manager as Kubeflow's (upstream's Namespaces carry no such label:
    kubeflow/manifests 26.03 common/istio/istio-namespace/base/namespace.yaml, common/cert-manager/base), so the check
    passes after our own first deploy."""
    fake, path = cluster
    fake.storage_classes(storage_class("gp3", True))
    s = S.load(environ={"STATE_DIR": str(state_dir), "KUBEFLOW_PASSWORD": "a-long-enough-secret"}, path=ROOT / ".env")
    monkeypatch.setattr(kubeflow, "TRAINER_PLATFORM", os.path.relpath(release_standin(s, tmp_path), kubeflow.overlay_dir(s) / "trainer"))
    overlay = kubeflow.write_overlay(s)
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    patched = [yaml.safe_load((overlay / p["path"]).read_text()) for p in kustomization["patches"]]
    for namespace in (p for p in patched if p["kind"] == "Namespace"):
        name = namespace["metadata"]["name"]
        fake.objects[f"/api/v1/namespaces/{name}"] = {"kind": "Namespace", "apiVersion": "v1", "metadata": namespace["metadata"]}
    assert {"/api/v1/namespaces/istio-system", "/api/v1/namespaces/cert-manager"} <= set(fake.objects)
    assert kubeflow.prerequisites(client_for(path)) == []


def test_deploy_refuses_before_changing_anything(cluster, state_dir):
    fake, path = cluster
    fake.storage_classes()
    pinned = state_dir / "kube" / "eks-doeks.us-west-2.kubeconfig"  # what `eks.connect` writes for CLUSTER_NAME
    pinned.parent.mkdir(parents=True)
    pinned.write_text(path.read_text())
    result = invoke("kubeflow.deploy", env={"TARGET": "eks", "CLUSTER_NAME": "doeks", "AWS_REGION": "us-west-2"})
    assert result.returncode == 1 and "prerequisites not met: no default StorageClass" in result.stderr
    assert "Traceback" not in result.stderr and not (state_dir / "kubeflow").exists(), result.stderr


def test_password_is_generated_privately_hashed_and_never_printed(release, state_dir):
    s = release
    overlay = kubeflow.write_overlay(s)
    secret = kubeflow.password_file(s).read_text().strip()
    assert stat.S_IMODE(kubeflow.password_file(s).stat().st_mode) == 0o600 and len(secret) >= 20
    patch = yaml.safe_load((overlay / "dex-password.yaml").read_text())
    # 26.03: dex reads the hash from Secret auth/dex-passwords, key DEX_USER_PASSWORD (common/dex/base/config-map.yaml
    # `hashFromEnv: DEX_USER_PASSWORD`, dex-passwords.yaml; kubeflow/manifests tag 26.03)
    assert (patch["kind"], patch["metadata"]["namespace"], patch["metadata"]["name"]) == ("Secret", "auth", "dex-passwords")
    hashed = patch["stringData"]["DEX_USER_PASSWORD"]
    assert bcrypt.checkpw(secret.encode(), hashed.encode())
    assert not bcrypt.checkpw(b"12341234", hashed.encode())  # the upstream default no longer works
    assert kubeflow.password(s) == secret  # stable across runs
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert kustomization["resources"][0].startswith(f"../manifests-{kubeflow.VERSION}/common/")
    assert "trainer" in kustomization["resources"]
    weak = S.load(environ={"STATE_DIR": str(state_dir), "KUBEFLOW_PASSWORD": "12341234"}, path=ROOT / ".env")
    with pytest.raises(Exception, match="too weak"):
        kubeflow.password(weak)


def test_deploy_dry_run_names_the_pinned_release(state_dir):
    result = invoke("kubeflow.deploy", "--dry-run", env={"TARGET": "eks", "KUBEFLOW_PASSWORD": "a-long-enough-secret"})
    assert result.returncode == 0, result.stderr
    assert kubeflow.VERSION == "26.03"  # kubeflow/manifests' current dated release
    assert f"--branch {kubeflow.VERSION}" in result.stderr and "kubectl apply --server-side" in result.stderr
    assert f"Kubeflow platform {kubeflow.VERSION}" in result.stderr
    assert "a-long-enough-secret" not in result.stdout + result.stderr


def release_standin(s, tmp: Path) -> Path:
    """A stand-in of the kubeflow/manifests 26.03 checkout with the layout write_overlay reads (example/ lists dex and
    the trainer overlay among other resources; applications/trainer/overlays sets kubeflow-system and patches the
    Deployments), each resource a tiny local base, so `kubectl kustomize` renders our overlay offline. The Trainer
    base stands in for kubeflow/trainer v2.3.0 manifests/overlays/kubeflow-platform."""
    root = kubeflow.checkout(s)

    def base(rel: str, docs: list[dict]) -> None:
        folder = root / rel
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "all.yaml").write_text(yaml.safe_dump_all(docs))
        (folder / "kustomization.yaml").write_text("resources:\n- all.yaml\n")

    base("common/istio/istio-namespace/base", [{"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": "istio-system", "labels": {"istio-injection": "disabled"}}}])
    base("common/cert-manager/overlays/kubeflow", [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "cert-manager"}}])
    base("common/dex/overlays/oauth2-proxy", [{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "dex-passwords", "namespace": "auth"},
                                               "stringData": {"DEX_USER_PASSWORD": "$2y$12$upstream-default-hash"}}])
    (root / "example").mkdir(parents=True)
    (root / "example" / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "sortOptions": {"order": "legacy", "legacySortOptions": {"orderFirst": ["Namespace", "CustomResourceDefinition"], "orderLast": []}},
        "resources": ["../common/cert-manager/overlays/kubeflow", "../common/istio/istio-namespace/base", "../common/dex/overlays/oauth2-proxy", kubeflow.EXAMPLE_TRAINER]}))
    (root / "applications/trainer/overlays").mkdir(parents=True)
    (root / "applications/trainer/overlays/kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "kubeflow-system",
        "resources": ["../upstream/overlays/kubeflow-platform"],
        "patches": [{"target": {"group": "apps", "version": "v1", "kind": "Deployment", "name": "kubeflow-trainer-controller-manager"},
                     "patch": "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: kubeflow-trainer-controller-manager\n"
                              "spec:\n  template:\n    metadata:\n      annotations:\n        traffic.sidecar.istio.io/excludeInboundPorts: \"9443\"\n"}]}))
    trainer = tmp / "trainer-v2.3.0"
    trainer.mkdir()
    (trainer / "all.yaml").write_text(yaml.safe_dump_all([
        {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {"name": "trainjobs.trainer.kubeflow.org"},
         "spec": {"group": "trainer.kubeflow.org", "scope": "Namespaced", "names": {"plural": "trainjobs", "kind": "TrainJob"},
                  "versions": [{"name": "v1alpha1", "served": True, "storage": True}]}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "kubeflow-trainer-controller-manager", "namespace": "kubeflow"},
         "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {"metadata": {"labels": {"a": "b"}}, "spec": {
             "containers": [{"name": "manager", "image": "ghcr.io/kubeflow/trainer/trainer-controller-manager:v2.3.0"}]}}}}]))
    (trainer / "kustomization.yaml").write_text("resources:\n- all.yaml\n")
    return trainer


@pytest.fixture
def release(state_dir, tmp_path, monkeypatch):
    s = S.load(environ={"STATE_DIR": str(state_dir)}, path=ROOT / ".env")
    trainer = release_standin(s, tmp_path)
    monkeypatch.setattr(kubeflow, "TRAINER_PLATFORM", os.path.relpath(trainer, kubeflow.overlay_dir(s) / "trainer"))
    return s


def render(folder: Path) -> list[dict]:
    from doeks import kube

    out = subprocess.run([kube.kubectl(), "kustomize", str(folder)], capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_overlay_renders_release_with_trainer_v2_3_and_own_password(release):
    overlay = kubeflow.write_overlay(release)
    docs = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in render(overlay)}
    secret = docs[("Secret", "auth", "dex-passwords")]
    assert bcrypt.checkpw(kubeflow.password(release).encode(), secret["stringData"]["DEX_USER_PASSWORD"].encode())
    for name in ("istio-system", "cert-manager"):
        assert docs[("Namespace", None, name)]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kubeflow"
    manager = docs[("Deployment", "kubeflow-system", "kubeflow-trainer-controller-manager")]  # the release's namespace
    assert manager["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":v2.3.0")
    assert manager["spec"]["template"]["metadata"]["annotations"]  # the release's Istio patch kept
    assert ("CustomResourceDefinition", None, "trainjobs.trainer.kubeflow.org") in docs
    ours = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert ours["sortOptions"]["order"] == "legacy" and len(ours["resources"]) == 4


def test_overlay_refuses_an_unknown_layout(release):
    example = kubeflow.checkout(release) / "example" / "kustomization.yaml"
    data = yaml.safe_load(example.read_text())
    data["resources"].remove(kubeflow.EXAMPLE_TRAINER)
    example.write_text(yaml.safe_dump(data))
    with pytest.raises(Exception, match="not the 26.03 layout"):
        kubeflow.write_overlay(release)

"""Operators side by side: the standalone training operator (v1) and the MPI operator each own their CRDs once.

The operator's kustomization (doeks.kubeflow.operator_kustomization) is rendered offline with the real `kubectl
kustomize` over a stand-in of the upstream standalone overlay built from tests/fixtures/kubeflow-upstream-facts.yaml
(CRD names/versions, the Deployment's name and container, derived from kubeflow/trainer v1.9.4 and kubeflow/mpi-operator
v0.8.0). Where the upstream git mirrors are present, the real overlay is rendered too and the facts are re-derived.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from doeks import efa, kube, kubeflow

from .conftest import ROOT, invoke, schema_path

FACTS = yaml.safe_load((ROOT / "tests" / "fixtures" / "kubeflow-upstream-facts.yaml").read_text())
MIRRORS = Path(os.environ.get("DOEKS_UPSTREAM_MIRRORS", "/work/.mirror"))
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # upstream CRDs are thousands of lines


def load_all(text: str) -> list[dict]:
    return [d for d in yaml.load_all(text, Loader=LOADER) if d]


def crd(name: str, versions: list[str]) -> dict:
    group = name.split(".", 1)[1]
    plural = name.split(".", 1)[0]
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {"name": name},
            "spec": {"group": group, "scope": "Namespaced", "names": {"plural": plural, "kind": plural},
                     "versions": [{"name": v, "served": True, "storage": i == 0} for i, v in enumerate(versions)]}}


def standin_overlay(folder: Path) -> Path:
    """The v1.9.4 standalone overlay's CRDs and Deployment, as the facts describe them."""
    facts = FACTS["training-operator"]
    folder.mkdir(parents=True)
    docs = [crd(name, versions) for name, versions in facts["crds"].items()]
    docs.append({"apiVersion": "apps/v1", "kind": "Deployment",
                 "metadata": {"name": facts["deployment"], "namespace": facts["namespace"]},
                 "spec": {"selector": {"matchLabels": {"app": "x"}}, "template": {"metadata": {"labels": {"app": "x"}}, "spec": {
                     "containers": [{"name": facts["container"], "image": facts["image"], "command": facts["command"]}]}}}})
    (folder / "all.yaml").write_text(yaml.safe_dump_all(docs))
    (folder / "kustomization.yaml").write_text("resources:\n- all.yaml\n")
    return folder


def render(base: Path, tmp: Path) -> list[dict]:
    ours = tmp / "ours"
    ours.mkdir()
    (ours / "kustomization.yaml").write_text(kubeflow.operator_kustomization(base=os.path.relpath(base, ours)))
    out = subprocess.run([kube.kubectl(), "kustomize", str(ours)], capture_output=True, text=True, check=True).stdout
    return load_all(out)


def owners(*units: tuple[str, list[dict]]) -> dict[str, list[tuple[str, list[str]]]]:
    found: dict[str, list[tuple[str, list[str]]]] = {}
    for unit, docs in units:
        for d in docs:
            if d["kind"] == "CustomResourceDefinition":
                found.setdefault(d["metadata"]["name"], []).append((unit, [v["name"] for v in d["spec"]["versions"]]))
    return found


def mpi_operator_facts() -> list[dict]:
    return [crd(name, versions) for name, versions in FACTS["mpi-operator"]["crds"].items()]


def check_side_by_side(operator_docs: list[dict], mpi_docs: list[dict]) -> None:
    crds = owners(("training-operator", operator_docs), ("mpi-operator", mpi_docs))
    # kubeflow/trainer#1930: two owners of mpijobs.kubeflow.org (v1 vs v2beta1) make the second apply fail
    assert crds[efa.MPIJOB_CRD] == [("mpi-operator", ["v2beta1"])]
    assert all(len(units) == 1 for units in crds.values()), crds
    assert {"pytorchjobs.kubeflow.org", "tfjobs.kubeflow.org"} <= set(crds)
    deployment = next(d for d in operator_docs if d["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    enabled = sorted(a.split("=", 1)[1] for a in args if a.startswith("--enable-scheme="))
    # every scheme the operator supports except MPIJob, which the MPI operator serves
    assert enabled == sorted(set(FACTS["training-operator"]["schemes"]) - {"mpijob"})
    assert deployment["spec"]["template"]["spec"]["containers"][0]["command"] == FACTS["training-operator"]["command"]


def test_one_mpijob_crd_owner_from_facts(tmp_path):
    docs = render(standin_overlay(tmp_path / "upstream"), tmp_path)
    check_side_by_side(docs, mpi_operator_facts())
    # and the pins the facts were derived from are the ones deployed
    assert FACTS["training-operator"]["ref"] == kubeflow.TRAINING_OPERATOR_REF
    assert FACTS["mpi-operator"]["ref"] == efa.MPI_OPERATOR_VERSION
    assert f"?ref={kubeflow.TRAINING_OPERATOR_REF}" in kubeflow.TRAINING_OPERATOR_BASE


def test_without_the_patch_there_are_two_owners(tmp_path):
    """The contract the patch exists for: the stock overlay next to the MPI operator owns mpijobs twice."""
    base = standin_overlay(tmp_path / "upstream")
    out = subprocess.run([kube.kubectl(), "kustomize", str(base)], capture_output=True, text=True, check=True).stdout
    crds = owners(("training-operator", list(yaml.safe_load_all(out))), ("mpi-operator", mpi_operator_facts()))
    assert len(crds[efa.MPIJOB_CRD]) == 2


def git_archive(repo: Path, ref: str, path: str, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", ref, path], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


@pytest.mark.skipif(not (MIRRORS / "kubeflow+trainer" / "repo").exists() or not (MIRRORS / "kubeflow+mpi-operator" / "repo").exists(),
                    reason="upstream git mirrors of kubeflow/trainer and kubeflow/mpi-operator not present")
def test_real_upstream_renders_one_owner_and_matches_facts(tmp_path):
    trainer, mpi = MIRRORS / "kubeflow+trainer" / "repo", MIRRORS / "kubeflow+mpi-operator" / "repo"
    for part in ("manifests/base", "manifests/overlays/standalone"):
        git_archive(trainer, FACTS["training-operator"]["ref"], part, tmp_path / "trainer")
    stock = subprocess.run([kube.kubectl(), "kustomize", str(tmp_path / "trainer/manifests/overlays/standalone")],
                           capture_output=True, text=True, check=True).stdout
    stock_docs = load_all(stock)
    assert {n: v for n, [(_, v)] in owners(("t", stock_docs)).items()} == FACTS["training-operator"]["crds"]
    git_archive(mpi, FACTS["mpi-operator"]["ref"], "deploy/v2beta1", tmp_path / "mpi")
    mpi_docs = load_all((tmp_path / "mpi/deploy/v2beta1/mpi-operator.yaml").read_text())
    assert {n: v for n, [(_, v)] in owners(("m", mpi_docs)).items()} == FACTS["mpi-operator"]["crds"]
    ours = render(tmp_path / "trainer/manifests/overlays/standalone", tmp_path)
    check_side_by_side(ours, mpi_docs)


def test_operator_deploy_and_delete_dry_run_use_the_same_kustomization(state_dir):
    env = {"TARGET": "eks"}
    deploy = invoke("kubeflow.training-operator.deploy", "--dry-run", env=env)
    assert deploy.returncode == 0, deploy.stderr
    kustomization = yaml.safe_load(deploy.stdout)
    assert kustomization["resources"] == [kubeflow.TRAINING_OPERATOR_BASE]
    assert any("mpijobs.kubeflow.org" in p["patch"] and "$patch: delete" in p["patch"] for p in kustomization["patches"])
    folder = kubeflow.operator_dir(__import__("doeks.settings", fromlist=["load"]).load(environ={"STATE_DIR": str(state_dir)}, path=ROOT / ".env"))
    assert f"kubectl apply --server-side -k {folder}" in deploy.stderr
    assert not folder.exists()  # a dry run writes nothing
    delete = invoke("kubeflow.training-operator.delete", "--dry-run", env=env)
    assert delete.returncode == 0, delete.stderr
    # delete goes through the same kustomization (less the shared namespace), so it never deletes the MPI operator's
    # MPIJob CRD
    assert f"kubectl delete --ignore-not-found -k {folder / 'delete'}" in delete.stderr
    assert "github.com" not in delete.stderr


@pytest.mark.skipif(not (MIRRORS / "kubeflow+manifests" / "repo").exists() or not (MIRRORS / "kubeflow+trainer" / "repo").exists(),
                    reason="upstream git mirrors of kubeflow/manifests and kubeflow/trainer not present")
def test_platform_and_trainer_facts_match_upstream():
    """The 26.03 layout write_overlay relies on, and the v2.3.0 runtime doeks' TrainJob patches, as upstream has them."""
    manifests, trainer = MIRRORS / "kubeflow+manifests" / "repo", MIRRORS / "kubeflow+trainer" / "repo"

    def show(repo: Path, ref: str, path: str) -> str:
        return subprocess.run(["git", "-C", str(repo), "show", f"{ref}:{path}"], capture_output=True, text=True, check=True).stdout

    platform = FACTS["platform"]
    assert platform["ref"] == kubeflow.VERSION
    example = yaml.safe_load(show(manifests, platform["ref"], "example/kustomization.yaml"))
    assert kubeflow.EXAMPLE_TRAINER in example["resources"]
    assert not any("training-operator" in r for r in example["resources"])  # commented out in 26.03
    listed = subprocess.run(["git", "-C", str(manifests), "grep", "-l", "name: mpijobs.kubeflow.org", platform["ref"]],
                            capture_output=True, text=True).stdout.split()
    assert all("applications/training-operator/" in path for path in listed)
    secret = yaml.safe_load(show(manifests, platform["ref"], "common/dex/base/dex-passwords.yaml"))
    assert (secret["metadata"]["name"], list(secret["stringData"])) == (platform["dex_password_secret"]["name"], [platform["dex_password_secret"]["key"]])
    facts = FACTS["trainer"]
    runtime = yaml.safe_load(show(trainer, facts["ref"], "manifests/base/runtimes/torch_distributed.yaml"))
    assert (runtime["kind"], runtime["metadata"]["name"]) == (facts["runtime_kind"], facts["runtime"])
    rjob = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]
    assert rjob["name"] == facts["replicated_job"] and rjob["template"]["metadata"]["labels"] == facts["ancestor_label"]
    assert rjob["template"]["spec"]["template"]["spec"]["containers"][0]["name"] == facts["container"]
    crd = yaml.safe_load(show(trainer, facts["ref"], "manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml"))
    shared = yaml.safe_load(schema_path("trainer.kubeflow.org_trainjobs-v2.3.0.crd.yaml").read_text())
    assert crd["spec"]["versions"] == shared["spec"]["versions"]

"""The images Kubeflow Trainer's runtimes name, on doeks' own cluster (doeks.cluster.runtimes): read from the runtimes
`kubeflow.trainer.deploy` applies there (the Trainer v2.3.0 Go module's manifests/overlays/runtimes, which `invoke
setup --kubernetes` downloads), the PyTorch one made here, the others named as unavailable. On the cluster:
tests/test_kubernetes_sdk.py."""
from __future__ import annotations

import os

import pytest
import yaml

from doeks import trainimage
from doeks.cluster import operators, runtimes, versions

from .conftest import ROOT, invoke

FACTS = yaml.safe_load((ROOT / "tests" / "fixtures" / "kubeflow-upstream-facts.yaml").read_text())["trainer"]
# kubeflow/trainer v2.3.0 manifests/base/runtimes: every runtime but torch-distributed names images of other frameworks
NOT_HERE = {"deepspeed-distributed", "mlx-distributed", "jax-distributed", "xgboost-distributed",
            "torchtune-llama3.2-1b", "torchtune-llama3.2-3b", "torchtune-qwen2.5-1.5b"}


def test_the_torch_runtime_image_doeks_makes_is_the_one_the_runtime_names_with_doeks_torch():
    assert versions.TORCH_RUNTIME_IMAGE == FACTS["runtime_image"]
    assert versions.TORCH_RUNTIME_IMAGE.split(":")[1].startswith(f"{trainimage.TORCH_VERSION}-")


@pytest.fixture
def trainer_module():
    if not operators.binary(operators.TRAINER).exists():  # setup --kubernetes built it, so its module is cached
        if os.environ.get("CI"):
            pytest.fail("CI must have Trainer built: `invoke setup --kubernetes` should have built it")
        pytest.skip("Trainer not built here (invoke setup --kubernetes)")


def test_of_the_8_runtimes_applied_torch_distributed_runs_here_the_7_others_are_named(trainer_module):
    applied = runtimes.manifests()
    assert len(applied) == 8
    made, unavailable = runtimes.split(applied)
    assert made == [versions.TORCH_RUNTIME_IMAGE]
    assert set(unavailable) == NOT_HERE
    torch = next(r for r in applied if r["metadata"]["name"] == "torch-distributed")
    assert runtimes.pod_images(torch) == [versions.TORCH_RUNTIME_IMAGE]
    assert "ghcr.io/kubeflow/trainer/deepspeed-runtime:v2.3.0" in unavailable["deepspeed-distributed"]


def test_trainer_deploy_dry_run_names_the_runtime_image_and_the_runtimes_it_cannot_run(trainer_module, state_dir):
    result = invoke("kubeflow.trainer.deploy", "--dry-run", env={"TARGET": "kubernetes", "KUBECONFIG": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    said = result.stdout + result.stderr
    assert f"docker tag {trainimage.CPU_BASE} {versions.TORCH_RUNTIME_IMAGE} (the runtime's image: doeks' CPU torch)" in said
    line = next(line for line in said.splitlines() if "runtimes unavailable on doeks' cluster" in line)
    assert all(name in said for name in NOT_HERE) and "torch-distributed" not in line

"""The images Kubeflow Trainer's ClusterTrainingRuntimes name, on doeks' own cluster (no registry).

`kubeflow.trainer.deploy` applies Trainer v2.3.0's runtimes as upstream ships them (manifests/overlays/runtimes: 8
runtimes, which the Kubeflow SDK lists). Each names the images its pods run. The PyTorch one, torch-distributed, names
`pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime` (versions.TORCH_RUNTIME_IMAGE); doeks makes it from its CPU torch
base, the same torch (images/pytorch/Dockerfile), and imports it under that name, so the SDK's
`train(trainer=CustomTrainer(func=...))` runs. The others' images (DeepSpeed, MLX, JAX on NVIDIA's GPU image, XGBoost,
torchtune's LLM trainer and its initializers, which fetch models and data sets from the internet) cannot be made
here: `kubeflow.trainer.deploy` and `invoke doctor` name those runtimes as unavailable on this cluster instead of
leaving a job of theirs to fail at pull time.
"""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from .. import ui
from ..errors import DoeksError
from . import images, operators, versions

RECIPE = Path(__file__).resolve().parent / "images" / "pytorch"
MAKEABLE = {versions.TORCH_RUNTIME_IMAGE: RECIPE}   # runtime image -> the recipe doeks makes it from (on the CPU base)
CRD = "clustertrainingruntimes.trainer.kubeflow.org"


def pod_images(runtime: dict) -> list[str]:
    """Every image a runtime's pods run (containers and init containers of each replicated job), in order."""
    found: list[str] = []
    for job in runtime.get("spec", {}).get("template", {}).get("spec", {}).get("replicatedJobs", []):
        pod = job.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("initContainers", []) + pod.get("containers", []):
            if container.get("image") and container["image"] not in found:
                found.append(container["image"])
    return found


def manifests() -> list[dict]:
    """The runtimes `kubeflow.trainer.deploy` applies on doeks' cluster: the Trainer module's overlays/runtimes."""
    import yaml

    from ..kube import kubectl

    folder = operators.module_dir(operators.TRAINER) / "manifests" / "overlays" / "runtimes"
    result = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True)
    if result.returncode != 0:
        raise DoeksError(f"kustomize of Trainer's runtimes failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc and doc.get("kind") == "ClusterTrainingRuntime"]


def split(runtimes: list[dict]) -> tuple[list[str], dict[str, list[str]]]:
    """(the images doeks makes that these runtimes name, {runtime: its images doeks cannot make})."""
    made: list[str] = []
    unavailable: dict[str, list[str]] = {}
    for runtime in runtimes:
        for ref in pod_images(runtime):
            if ref in MAKEABLE:
                made += [ref] if ref not in made else []
            else:
                unavailable.setdefault(runtime["metadata"]["name"], []).append(ref)
    return made, unavailable


def unavailable_line(unavailable: dict[str, list[str]]) -> str:
    """The runtimes, then the images they name that doeks cannot make (each once)."""
    refs: list[str] = []
    for name in sorted(unavailable):
        refs += [ref for ref in unavailable[name] if ref not in refs]
    return f"{', '.join(sorted(unavailable))} (images {', '.join(refs)})"


def _recipe(folder: Path, base: str) -> str:
    digest = hashlib.sha256(base.encode() + b"\0")
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def build(ref: str, base: str) -> None:
    """`docker build` of the image's recipe on the CPU torch base, once per recipe and base (a label holds their hash;
    a changed one is rebuilt and the node's old copy removed)."""
    folder = MAKEABLE[ref]
    recipe = _recipe(folder, base)
    if images.docker_label(ref, "doeks.recipe") == recipe:
        return
    ui.say(f"building image {ref} from {folder.name}/ on {base}")
    result = subprocess.run(["docker", "build", "-q", "--build-arg", f"BASE_IMAGE={base}", "--label",
                             f"doeks.recipe={recipe}", "-t", ref, str(folder)], capture_output=True, text=True)
    if result.returncode != 0:
        raise DoeksError(f"docker build {ref} failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    from . import node

    if node.pid("containerd") and images.in_containerd(ref):
        node.ctr("images", "rm", images.containerd_name(ref))


def ensure_images(settings, runner) -> dict[str, list[str]]:
    """The runtimes' images doeks can make, built (the CPU torch base first, when missing) and imported into the node;
    returns the runtimes whose images it cannot make, which it names."""
    from .. import trainimage

    made, unavailable = split(manifests())
    base = trainimage.CPU_BASE
    for ref in made:
        if runner.dry_run:
            runner.step(f"docker build {base} from elasticjob/Dockerfile.torch-cpu (if missing)", lambda: None)
            runner.step(f"docker build {ref} from doeks/cluster/images/{MAKEABLE[ref].name} on {base} (if the recipe "
                        "or the base changed): the runtime's image, doeks' CPU torch", lambda: None)
            continue
        from ..container import _client

        client = _client()
        if not trainimage._has_image(client, base):
            runner.note(f"building the CPU training base {base} (once; a few minutes)")
            trainimage.build_cpu_base(settings, runner, client)
        build(ref, base)
    images.ensure(runner, made)
    if unavailable:
        ui.say(f"runtimes unavailable on doeks' cluster (their images cannot be made here, so a job of theirs would "
               f"not start): {unavailable_line(unavailable)}", style="yellow")
    return unavailable


def check(get) -> list[tuple[str, bool, str, bool]]:
    """`invoke doctor`'s rows on doeks' cluster: the applied runtimes whose images are on the node, and those whose
    images cannot be made here. `get(*kubectl args)` -> (parsed JSON or None, error)."""
    found, error = get("get", "clustertrainingruntimes")
    if found is None:
        return [("Kubeflow Trainer runtimes", False, "not deployed: `invoke kubeflow.trainer.deploy` (the Kubeflow SDK "
                 "submits TrainJobs against them)", False)]
    runtimes = found.get("items", [])
    made, unavailable = split(runtimes)
    on_node = [ref for ref in made if images.in_containerd(ref)]
    ready = sorted(r["metadata"]["name"] for r in runtimes if r["metadata"]["name"] not in unavailable
                   and all(ref in on_node for ref in pod_images(r)))
    missing = [ref for ref in made if ref not in on_node]
    rows = [("Kubeflow Trainer runtimes runnable here", bool(ready) and not missing,
             (", ".join(ready) or "none") + (f"; {', '.join(missing)} not on the node: `invoke kubeflow.trainer.deploy` "
                                              "imports it" if missing else ""), False)]
    if unavailable:
        rows.append(("Kubeflow Trainer runtimes unavailable on this cluster", False,
                     f"{unavailable_line(unavailable)}: not made here (no registry), so a job of theirs would not "
                     "start", False))
    return rows


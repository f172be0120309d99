"""The images Kubeflow Trainer's ClusterTrainingRuntimes name, on doeks' own cluster (no registry).

`kubeflow.trainer.deploy` applies Trainer v2.3.0's runtimes as upstream ships them (manifests/overlays/runtimes: 8
runtimes, which the Kubeflow SDK lists). Each names the images its pods run. The PyTorch one, torch-distributed, names
`pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime` (versions.TORCH_RUNTIME_IMAGE); here it is doeks' CPU torch base
itself under that name (the same torch; python, pip, torchrun and bash on the PATH, which the SDK's
`CustomTrainer(func=...)` command uses: `bash -c "... printf ... > fn.py; torchrun fn.py"`), imported into the node
without streaming its layers again (import_sharing_layers), so the SDK's `train(trainer=CustomTrainer(func=...))`
runs. The others' images (DeepSpeed, MLX, JAX on NVIDIA's GPU image, XGBoost,
torchtune's LLM trainer and its initializers, which fetch models and data sets from the internet) cannot be made
here: `kubeflow.trainer.deploy` and `invoke doctor` name those runtimes as unavailable on this cluster instead of
leaving a job of theirs to fail at pull time.
"""
from __future__ import annotations

import subprocess

from .. import ui
from ..errors import DoeksError
from . import images, operators, versions

MAKEABLE = {versions.TORCH_RUNTIME_IMAGE}   # the runtime images doeks makes (each: the CPU torch base, renamed)
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


def tag(ref: str, base: str) -> bool:
    """The runtime's image in docker is the CPU torch base itself under the runtime's name; returns whether the tag
    moved (a new base), in which case the node's old copy is removed."""
    from ..container import _client

    client = _client()
    image = client.images.get(base)
    if has_same_id(client, ref, image.id):
        return False
    image.tag(ref)
    from . import node

    if node.pid("containerd") and images.in_containerd(ref):
        node.ctr("images", "rm", images.containerd_name(ref))
    return True


def has_same_id(client, ref: str, image_id: str) -> bool:
    import docker

    try:
        return client.images.get(ref).id == image_id
    except docker.errors.ImageNotFound:
        return False


def _json(digest: str) -> dict | None:
    import json

    from . import node

    got = node.ctr("content", "get", digest)
    if got.returncode != 0:
        return None
    try:
        return json.loads(got.stdout)
    except ValueError:
        return None


def donor_layers(diff_ids: list[str]) -> list[dict] | None:
    """The layer descriptors (digest, size, media type as the node stores them) of an image on the node whose first
    layers are exactly `diff_ids` (the training image, built on the same base), or None."""
    from . import node

    listed = node.ctr("images", "list").stdout.splitlines()[1:]
    for line in sorted(listed, key=lambda row: "doeks-train" not in row):  # the training image first
        fields = line.split()
        if len(fields) < 3 or not fields[2].startswith("sha256:"):
            continue
        manifest = _json(fields[2])
        if not manifest or "config" not in manifest or len(manifest.get("layers", [])) < len(diff_ids):
            continue
        config = _json(manifest["config"]["digest"]) or {}
        if config.get("rootfs", {}).get("diff_ids", [])[:len(diff_ids)] == diff_ids:
            return manifest["layers"][:len(diff_ids)]
    return None


CONFIG_KEYS = ("User", "ExposedPorts", "Env", "Entrypoint", "Cmd", "Volumes", "WorkingDir", "Labels", "StopSignal")


def import_sharing_layers(ref: str) -> bool:
    """`ref` into the node's containerd without streaming its layers through `docker save` (2.5 min for the 3.9 GB
    base here): when an image on the node already holds every layer (the training image, built on the same base),
    only a manifest naming those layers and the image's config (from `docker image inspect`) are imported, as an OCI
    layout archive; containerd finds the layers' content and unpacked snapshots already there. Returns False (nothing
    done) when no image on the node holds them."""
    import hashlib
    import io
    import json
    import tarfile

    from ..container import _client

    info = _client().images.get(ref).attrs
    diff_ids = info["RootFS"]["Layers"]
    layers = donor_layers(diff_ids)
    if layers is None:
        return False
    config = json.dumps({"architecture": info["Architecture"], "os": info["Os"], "created": info["Created"],
                         "config": {k: v for k, v in (info.get("Config") or {}).items() if k in CONFIG_KEYS and v},
                         "rootfs": {"type": "layers", "diff_ids": diff_ids}}, sort_keys=True).encode()
    config_desc = {"mediaType": "application/vnd.docker.container.image.v1+json", "size": len(config),
                   "digest": "sha256:" + hashlib.sha256(config).hexdigest()}
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                           "config": config_desc, "layers": layers}, sort_keys=True).encode()
    manifest_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json", "digest": manifest_digest,
        "size": len(manifest), "annotations": {"io.containerd.image.name": images.containerd_name(ref),
                                               "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]}}]}).encode()
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        for name, data in (("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index),
                           (f"blobs/sha256/{config_desc['digest'][7:]}", config),
                           (f"blobs/sha256/{manifest_digest[7:]}", manifest)):
            entry = tarfile.TarInfo(name)
            entry.size = len(data)
            tar.addfile(entry, io.BytesIO(data))
    from . import node

    result = subprocess.run(["ctr", "--address", str(node.CONTAINERD_SOCKET), "--namespace", "k8s.io", "images",
                             "import", "--no-unpack=false", "-"], input=archive.getvalue(), capture_output=True)
    if result.returncode != 0 or not images.in_containerd(ref):
        raise DoeksError(f"importing {ref} into the cluster's containerd failed: "
                         f"{(result.stderr.decode(errors='replace').strip().splitlines() or ['not listed after import'])[-1]}")
    return True


def ensure_images(settings, runner) -> dict[str, list[str]]:
    """The runtimes' images doeks can make, built (the CPU torch base first, when missing) and imported into the node;
    returns the runtimes whose images it cannot make, which it names."""
    from .. import trainimage

    made, unavailable = split(manifests())
    base = trainimage.CPU_BASE
    for ref in made:
        if runner.dry_run:
            runner.step(f"docker build {base} from elasticjob/Dockerfile.torch-cpu (if missing)", lambda: None)
            runner.step(f"docker tag {base} {ref} (the runtime's image: doeks' CPU torch); import it into the cluster's "
                        "containerd: a manifest naming the layers the training image brought (docker save | ctr "
                        "images import when none did)", lambda: None)
            continue
        from ..container import _client

        client = _client()
        if not trainimage._has_image(client, base):
            runner.note(f"building the CPU training base {base} (once; a few minutes)")
            trainimage.build_cpu_base(settings, runner, client)
        tag(ref, base)
        if not images.in_containerd(ref):
            ui.say(f"importing {ref} into the cluster")
            if not import_sharing_layers(ref):
                images.import_image(ref)
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


"""Images: what is inside each image a manifest names.

- The management container installs what its tasks import: every third-party module imported (at any depth, also
  inside functions) by the task files and doeks' cluster-side modules must come from a distribution the
  Dockerfile's `pip install` brings (doeks' dependencies plus the extras it names, plus what it names explicitly).
- Every image a cluster manifest names is a fully qualified, pinned reference (no Docker Hub short name, no
  `latest`), or the training image (TRAIN_IMAGE, built by the project).
"""
from __future__ import annotations

import ast
import re
import shlex
import sys
import tomllib
from importlib import metadata

from doeks import efa, gpumetrics
from doeks import trainimage
from doeks import settings as S

from .conftest import ROOT

TASK_FILES = ["tasks.py", "eks/tasks.py", "csi/tasks.py", "gpu-metrics/tasks.py", "kubeflow/tasks.py", "kubeflow/sagemaker.py",
              "efa-device-plugin/tasks.py", "elasticjob/tasks.py"]
# local-only code (TARGET=local: torchrun agents, samplers, etcd) and the training script run elsewhere, not in it
NOT_IN_THE_MANAGEMENT_IMAGE = {"doeks/local", "doeks/workload"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def dockerfile_installs() -> set[str]:
    """Distribution names the Dockerfile's `pip install`s bring in (one level: what pyproject names). The dependency
    layer installs `-r requirements.txt`, which the Dockerfile writes from pyproject's dependencies and the extras it
    names (`["optional-dependencies"]["cloud"]`); the project itself is then installed `--no-deps`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    names = set()
    for command in (part for part in re.split(r"&&|;", text) if "pip install" in part):
        words = shlex.split(command[command.index("pip install") + len("pip install"):])
        for i, word in enumerate(words):
            if word == "-r" and i + 1 < len(words) and words[i + 1] == "requirements.txt":
                assert "requirements.txt" in text and 'p["dependencies"]' in text, "requirements.txt not from pyproject"
                names |= {_name(r) for r in project["dependencies"]}
                for extra in re.findall(r'\["optional-dependencies"\]\["([\w-]+)"\]', text):
                    names |= {_name(r) for r in project["optional-dependencies"][extra]}
            elif word.startswith("-") or (i > 0 and words[i - 1] == "-r") or word.startswith("/"):
                continue
            elif word == "." or word.startswith(".["):
                names |= {_name(r) for r in project["dependencies"]}
                for extra in re.findall(r"\[(.*)\]", word)[0].split(",") if "[" in word else []:
                    names |= {_name(r) for r in project["optional-dependencies"][extra.strip()]}
            else:
                names.add(_name(word))
    return names


def imported_modules() -> dict[str, set[str]]:
    """Top-level third-party module -> files importing it (function-level imports included)."""
    # doeks/pod/torchrun.py and what it starts (doeks/pod/worker.py, doeks/pod/zygote.py, doeks/pod/watchdog.py) run only in the
    # training image (its torchrun, its workers) and under the local agent, doeks/pod/launch.py only in the training image
    # (its default command), doeks/pod/torchcompat.py beside them (and beside checkpoints.py): never a task's import
    agent_side = ("torchrun.py", "worker.py", "zygote.py", "watchdog.py", "launch.py", "torchcompat.py")
    files = [ROOT / f for f in TASK_FILES] + [p for p in (ROOT / "doeks").glob("*.py") if p.name not in agent_side]
    found: dict[str, set[str]] = {}
    for path in files:
        tree = ast.parse(path.read_text())
        optional = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError") for h in t.handlers)
            for stmt in t.body for n in ast.walk(stmt)}  # `try: import x / except ImportError:` has a way without it
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "doeks":
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def with_dependencies(names: set[str]) -> set[str]:
    """The names plus what they require (unconditional requirements, recursively, as installed here)."""
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return seen


def test_management_image_installs_what_its_tasks_import():
    installed = with_dependencies(dockerfile_installs())
    providers = metadata.packages_distributions()
    missing = {}
    for module, files in imported_modules().items():
        dists = {d.lower().replace("_", "-") for d in providers.get(module, [module])}
        if not dists & installed:
            missing[module] = sorted(files)
    assert not missing, f"imported by tasks but not installed in the management image: {missing}"


def test_cluster_manifests_name_pinned_qualified_images(state_dir):
    s = S.load(environ={"TARGET": "eks"})
    from importlib import util

    spec = util.spec_from_file_location("doeks_unit_csi_images", ROOT / "csi" / "tasks.py")
    csi = util.module_from_spec(spec)
    spec.loader.exec_module(csi)
    docs = gpumetrics.manifests(s) + efa.device_plugin(s) + csi.stage_manifests(s, "s3://doeks-training/data/imagenet", False)
    images = []
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        images += [c["image"] for c in pod.get("containers", []) + pod.get("initContainers", [])]
    assert trainimage.reference(s, on_this_machine=False) in images  # the staging Job runs the training image, not `doeks:latest`
    for image in images:
        registry = image.split("/", 1)[0]
        assert "/" in image and ("." in registry or ":" in registry), f"{image}: a short name resolves to Docker Hub"
        tag = image.rsplit(":", 1)[-1] if ":" in image.split("/")[-1] else ""
        assert "@sha256:" in image or (tag and tag != "latest"), f"{image}: not pinned"

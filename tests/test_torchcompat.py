"""One torch everywhere: the torch of every image is the one the suite runs, and every private torch name doeks uses
is listed in doeks.pod.torchcompat and checked before use (one line, never a traceback in a pod)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from doeks.pod import torchcompat

from .conftest import ROOT

torch = pytest.importorskip("torch")


def _base(version: str) -> str:
    return version.split("+", 1)[0]


def test_the_running_torch_is_the_tested_one_and_has_every_private_name():
    assert _base(torch.__version__) in torchcompat.TESTED
    assert torchcompat.missing() == []


def test_every_image_runs_the_tested_torch():
    """The CPU base (local, docker, kubernetes, the rehearsal), the training image on the AWS DLC (eks), Trainer's
    runtime image and SageMaker's sourcedir all name the torch this suite runs: an image with another torch fails here."""
    import tomllib

    from doeks import sagemaker, trainimage
    from doeks.cluster import versions

    tested = set(torchcompat.TESTED)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [r for r in project["optional-dependencies"]["train"] if r.startswith("torch==")]
    assert [pin.split("==")[1] for pin in pins] == [trainimage.TORCH_VERSION]
    assert trainimage.TORCH_VERSION in tested
    dockerfile = (ROOT / "elasticjob" / "Dockerfile").read_text()
    assert re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.M).group(1) == trainimage.TORCH_VERSION
    assert re.search(r"^ARG TORCHVISION_VERSION=(\S+)$", dockerfile, re.M).group(1) == trainimage.TORCHVISION_VERSION
    assert "python3 -m doeks.pod.torchcompat" in dockerfile  # the build itself refuses a torch that lacks a name
    assert versions.TORCH_RUNTIME_IMAGE.split(":")[1].split("-")[0] in tested
    assert f"torch=={trainimage.TORCH_VERSION}" in sagemaker.torch_requirements()
    locked = re.search(r"^torch==(\S+)", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    assert locked in tested


def test_every_private_torch_module_doeks_imports_is_listed():
    """A private torch module or name imported anywhere in doeks is in torchcompat's list (checked at start)."""
    listed_modules = {module for _, module, _ in torchcompat.NAMES}
    listed = {(module, path.split(".")[0]) for _, module, path in torchcompat.NAMES}
    found = set()
    for path in (ROOT / "doeks").rglob("*.py"):
        text = path.read_text()
        for module, names in re.findall(r"from (torch(?:\.[\w.]+)?) import ([\w, ]+)", text):
            for name in (n.strip() for n in names.split(",")):
                if re.search(r"\._", module):
                    found.add((path.name, module, None))
                elif name.startswith("_"):
                    found.add((path.name, module, name))
    assert found, "the scan found nothing: it no longer reads doeks' imports"
    for where, module, name in sorted(found, key=str):
        if name is None:
            assert module in listed_modules, f"{where} imports {module}, not in doeks.pod.torchcompat.NAMES"
        else:
            assert (module, name) in listed, f"{where} imports {module}.{name}, not in doeks.pod.torchcompat.NAMES"


def test_a_torch_without_a_patched_name_ends_torchrun_in_one_line():
    """The image's torchrun on a torch that lacks a name it patches: exit 2 and one line naming the torch version,
    before anything is patched (the name deleted here stands for a torch that moved it)."""
    probe = ("import sys\n"
             "from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as m\n"
             "del m.SubprocessHandler._popen\n"
             "sys.argv = ['torchrun', '--help']\n"
             "from doeks.pod import torchrun\n"
             "sys.exit(torchrun.main())\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if "lacks" in line]
    assert len(lines) == 1 and f"torch {torch.__version__}" in lines[0] and "SubprocessHandler._popen" in lines[0], out


def test_a_checkpoint_store_on_such_a_torch_says_it_in_one_line(monkeypatch, tmp_path):
    from doeks.workload import checkpoints

    monkeypatch.setattr(checkpoints, "_TORCH_CHECKED", False)
    monkeypatch.setattr(torchcompat, "NAMES", torchcompat.NAMES + (
        ("checkpoints", "torch.distributed.checkpoint.filesystem", "_NoSuchReaderPart"),))
    with pytest.raises(checkpoints.CheckpointError, match=r"torch .* lacks .*_NoSuchReaderPart"):
        checkpoints.Store(str(tmp_path))


def test_the_module_says_the_running_torch_in_one_line():
    result = subprocess.run([sys.executable, "-m", "doeks.pod.torchcompat"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"doeks: torch {torch.__version__} has every private name doeks uses"

"""The job's code: the user's training script (TRAIN_SCRIPT, TRAIN_SOURCE, TRAIN_ARGS, TRAIN_REQUIREMENTS) or doeks'
own ImageNet workload (doeks/workload/train.py, the default), resolved once from settings for every target.

A job's code is a folder (its *source*) and an entry in it: a script path relative to the folder, or a module. In the
training image the source is at CODE_DIR, which is also the working directory; the local target maps CODE_DIR to the
source folder itself and runs the processes from there. The built-in workload is one such job: only it gets the
ImageNet flags (`jobspec.train_args`), only its arguments are checked against its parser and only its data layout is
checked. Every job gets the same environment (`contract`, documented in docs/your-own-script.md).
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import DoeksError
from .settings import PROJECT_ROOT

CODE_DIR = "/workspace"  # where the training image keeps the job's source, and the processes' working directory
BUILTIN_SOURCE = PROJECT_ROOT / "doeks" / "workload"
BUILTIN_ENTRY = "train.py"
SKIP = {"__pycache__", ".git", ".venv", "venv", ".mypy_cache", ".pytest_cache", ".ipynb_checkpoints", ".doeks"}
MAX_SOURCE_BYTES = 200 * 1024 * 1024


@dataclass(frozen=True)
class Code:
    source: Path                  # folder on this machine: copied to CODE_DIR in the image, the local processes' cwd
    entry: str                    # a path relative to `source`, or a module name when `module`
    module: bool = False
    args: tuple[str, ...] = ()    # TRAIN_ARGS, verbatim
    requirements: Path | None = None
    builtin: bool = False         # doeks' own ImageNet workload

    @property
    def script(self) -> str:
        """The script as the image and the manifests name it (CODE_DIR/entry), or the module."""
        return self.entry if self.module else f"{CODE_DIR}/{self.entry}"

    def launcher(self) -> list[str]:
        """The torchrun command that starts the code (what comes before the arguments)."""
        return ["torchrun", "-m", self.entry] if self.module else ["torchrun", self.script]

    def shown(self) -> str:
        return f"-m {self.entry}" if self.module else str(self.source / self.entry)

    def files(self) -> list[Path]:
        """The source folder's files (what the image and the SageMaker source archive get), sorted."""
        if self.builtin:
            return sorted(p for p in self.source.rglob("*") if p.suffix in (".py", ".c") and p.is_file()
                          and "__pycache__" not in p.parts)  # .c: the loader's _jpegcrop, built in the image
        found = []
        for path in sorted(self.source.rglob("*")):
            rel = path.relative_to(self.source)
            if any(part in SKIP for part in rel.parts) or not path.is_file():
                continue
            found.append(path)
        return found

    def digest(self) -> str:
        """A hash of the source's files (names and contents) and the requirements: a changed script is a new tag."""
        h = hashlib.sha256(("module:" if self.module else "script:").encode() + self.entry.encode() + b"\0")
        total = 0
        for path in self.files():
            data = path.read_bytes()
            total += len(data)
            if total > MAX_SOURCE_BYTES:
                raise DoeksError(f"TRAIN_SOURCE {self.source} holds more than {MAX_SOURCE_BYTES >> 20} MiB: point it at "
                                 "the folder of your code alone (data belongs on the shared volume or in S3)")
            h.update(path.relative_to(self.source).as_posix().encode() + b"\0" + data + b"\0")
        if self.requirements is not None:
            h.update(b"requirements\0" + self.requirements.read_bytes())
        return h.hexdigest()[:12]


def _path(raw: str) -> Path:
    path = Path(os.path.expanduser(raw))  # an unknown ~user stays as written (Path.expanduser raises)
    return (path if path.is_absolute() else PROJECT_ROOT / path).resolve()


def resolve(settings) -> Code:
    """The job's code from TRAIN_SCRIPT / TRAIN_SOURCE / TRAIN_ARGS / TRAIN_REQUIREMENTS; one line naming the key when
    a file or folder is not there."""
    try:
        args = tuple(shlex.split(settings.train_args))
    except ValueError as error:
        raise DoeksError(f"TRAIN_ARGS={settings.train_args!r} is not accepted: {error}") from None
    raw = settings.train_script.strip()
    if not raw or _path(raw) == BUILTIN_SOURCE / BUILTIN_ENTRY:
        return Code(BUILTIN_SOURCE, BUILTIN_ENTRY, args=args, builtin=True)
    if raw.startswith("-m"):
        module = raw[2:].strip()
        if not module or not all(part.isidentifier() for part in module.split(".")):
            raise DoeksError(f"TRAIN_SCRIPT={raw!r} is not accepted: expected a .py file or -m package.module")
        source = _path(settings.train_source) if settings.train_source else PROJECT_ROOT
        if not source.is_dir():
            raise DoeksError(f"TRAIN_SOURCE={settings.train_source!r}: no such folder ({source})")
        return Code(source, module, module=True, args=args, requirements=_requirements(settings, source))
    script = _path(raw)
    if script.suffix != ".py":
        raise DoeksError(f"TRAIN_SCRIPT={raw!r} is not accepted: expected a .py file or -m package.module")
    if not script.is_file():
        raise DoeksError(f"TRAIN_SCRIPT={raw!r}: no such file ({script})")
    source = _path(settings.train_source) if settings.train_source else script.parent
    if not source.is_dir():
        raise DoeksError(f"TRAIN_SOURCE={settings.train_source!r}: no such folder ({source})")
    if source not in script.parents:
        raise DoeksError(f"TRAIN_SCRIPT={raw!r} is not inside TRAIN_SOURCE={str(source)!r}: the source folder is what "
                         "the job runs from, so it must hold the script")
    return Code(source, script.relative_to(source).as_posix(), args=args, requirements=_requirements(settings, source))


def _requirements(settings, source: Path) -> Path | None:
    if settings.train_requirements:
        path = _path(settings.train_requirements)
        if not path.is_file():
            raise DoeksError(f"TRAIN_REQUIREMENTS={settings.train_requirements!r}: no such file ({path})")
        return path
    default = source / "requirements.txt"
    return default if default.is_file() else None


# -- the environment contract: the same names on every target ------------------------------------------------------
def contract(settings, mount: str, run_id: str, hosts: list[str]) -> dict[str, str]:
    """What every job's processes find in their environment on the Kubernetes-shaped targets (local, docker,
    kubernetes/eks): doeks' names and SageMaker's for the same folders, so a script written for either runs on both.
    SageMaker sets its own SM_* (and doeks.targets.sagemaker the DOEKS_* ones) to its /opt/ml folders."""
    from .jobpaths import checkpoint_uri, job_folder, model_uri

    models, output = job_folder(settings, "models", mount), job_folder(settings, "output", mount)
    return {
        "DOEKS_DATA_DIR": f"{mount}/data",
        "DOEKS_CHECKPOINT_DIR": job_folder(settings, "checkpoints", mount),
        "DOEKS_CHECKPOINT_URI": checkpoint_uri(settings, mount),
        "DOEKS_KEEP_CHECKPOINTS": str(settings.keep_checkpoints),
        "DOEKS_MODEL_DIR": models,
        "DOEKS_MODEL_URI": model_uri(settings, mount),
        "DOEKS_OUTPUT_DIR": output,
        "DOEKS_RUN_ID": run_id,
        "SM_CHANNEL_TRAINING": f"{mount}/data",
        "SM_CHANNELS": json.dumps(["training"]),
        "SM_MODEL_DIR": models,
        "SM_OUTPUT_DATA_DIR": output,
        "SM_HOSTS": json.dumps(hosts),
        "SM_NUM_GPUS": str(settings.nproc_per_node),  # the GPUs a pod requests; local and docker train on CPU: 0
    }


def host_names(job_name: str, replicas: int) -> list[str]:
    """The replicas' host names: the training operator's pod names (docker's container names, too)."""
    return [f"{job_name}-worker-{i}" for i in range(replicas)]


def env_list(values: dict[str, Any]) -> list[dict[str, str]]:
    return [{"name": k, "value": str(v)} for k, v in values.items()]

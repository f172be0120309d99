"""Typed, validated settings from `.env` (python-dotenv) with environment variables taking precedence.

Every key is declared once in `KEYS` with its unit, default, help and check; `.env` documents the same keys, and a
test keeps the two in step. A bad value raises `SettingsError` with one line naming the key, the value and what is
accepted.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from . import catalog as _catalog
from .errors import SettingsError

PROJECT_ROOT = Path(__file__).resolve().parent.parent

from .keys import KEY_BY_NAME, KEYS, BadValue, Key


class Settings:
    """The effective, validated settings; read a key as an attribute in lower case (`settings.cluster_name`)."""

    def __init__(self, values: dict[str, Any], raw: dict[str, str], sources: dict[str, str],
                 problems: dict[str, str] | None = None):
        self._values = values
        self._raw = raw
        self._sources = sources
        self._problems = problems or {}  # key -> its error, when loaded leniently (config, doctor): default used
        self._filled: dict[str, str] = {}  # key -> why: a target's default for a key left empty (with_defaults)
        self._filled_for = ""  # the TARGET whose defaults those are

    @property
    def problems(self) -> dict[str, str]:
        """The values not accepted (key -> the one-line error) when loaded with lenient=True; empty otherwise."""
        return dict(self._problems)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name.upper()]
        except KeyError:
            raise AttributeError(name) from None

    def raw(self, name: str) -> str:
        return self._raw[name]

    def source(self, name: str) -> str:
        return self._sources[name]

    def secrets(self) -> list[str]:
        return [self._raw[k.name] for k in KEYS if k.secret and self._raw[k.name]]

    def with_overrides(self, **overrides: Any) -> "Settings":
        """A copy with some keys replaced by raw strings (e.g. task flags), validated like `.env` values."""
        raw = dict(self._raw)
        sources = dict(self._sources)
        for name, value in overrides.items():
            if value is None:
                continue
            raw[name.upper()] = str(value).lower() if isinstance(value, bool) else str(value)
            sources[name.upper()] = "flag"
        result = _validate(raw, sources)
        kept = {k: self._values[k] for k in self._filled if not raw[k].strip()}
        if kept and result.target == self._filled_for:  # the target's defaults stay while TARGET does
            result = result.with_defaults(self._filled_for, {k: self._filled[k] for k in kept}, **kept)
        return result

    def with_defaults(self, target: str, why: dict[str, str], **values: Any) -> "Settings":
        """A copy in which keys left empty take `values`: what TARGET `target` uses when the user names nothing
        (doeks.targets.settled asks the target). The raw value stays empty (`.env` is the user's); `invoke config`
        shows the value in effect and `why[key]`; with_overrides keeps them while TARGET stays `target`."""
        filled = {k: v for k, v in values.items() if not self._raw[k].strip()}
        if not filled:
            return self
        result = Settings({**self._values, **filled}, self._raw, self._sources, self._problems)
        result._filled = {**self._filled, **{k: why[k] for k in filled}}
        result._filled_for = target
        return result

    def filled(self, name: str) -> str:
        """Why `name` has the value it has when the user left it empty and the target filled it ("" otherwise)."""
        return self._filled.get(name, "")

    @property
    def on_this_machine(self) -> bool:
        """The cloud is stood in for on this machine (TARGET=local or docker): etcd and the moto AWS-API endpoint run
        here, the shared volume is a folder, there is no cluster to create. The job's own verbs are doeks.targets'."""
        return self.target in ("local", "docker")

    @property
    def own_cluster(self) -> bool:
        """TARGET=kubernetes on doeks' own cluster (KUBECONFIG empty, or its own kubeconfig): it runs here."""
        if self.target != "kubernetes":
            return False
        from .cachedirs import kubeconfig

        return not self.kubeconfig or Path(self.kubeconfig).resolve() == kubeconfig().resolve()

    @property
    def crop(self) -> int:
        """CROP_SIZE, or ImageNet's 224 where GPUs train (eks, SageMaker) and 32 where this machine's CPU trains (local,
        docker, SageMaker local mode), so the local demo takes about a minute."""
        if self.crop_size:
            return self.crop_size
        cpu = self.on_this_machine or self.own_cluster or (self.target == "kubernetes" and not self.kube_gpus)
        return 32 if cpu or (self.target == "sagemaker" and self.sagemaker_local) else 224

    @property
    def instance_facts_unknown(self) -> bool:
        """NPROC_PER_NODE or EFA_PER_NODE follow GPU_INSTANCE_TYPE (auto) and EC2 has not been asked about it yet
        (doeks.instancetypes asks it and caches the answer)."""
        auto = self._raw["NPROC_PER_NODE"] == "auto" or self._raw["EFA_PER_NODE"] == "auto"
        return self.target == "eks" and auto and self._values["INSTANCE_FACTS"] != "EC2 DescribeInstanceTypes"

    @property
    def state_dir(self) -> Path:
        path = Path(self._values["STATE_DIR"])
        return path if path.is_absolute() else PROJECT_ROOT / path

    def rows(self) -> list[list[str]]:
        def shown(k: Key) -> list[str]:
            if k.name in self._filled:
                return [str(self._values[k.name]), f"{self._sources[k.name]} ({self._filled[k.name]})"]
            if k.name in _DERIVED and not self._raw[k.name].strip():
                return [str(self._values[k.name]), f"{self._sources[k.name]} ({_DERIVED[k.name]})"]
            marked = " (NOT ACCEPTED: see below)" if k.name in self._problems else ""
            return [mask_value(k, self._raw[k.name]) + marked, self._sources[k.name]]

        return [[k.unit, k.name, *shown(k)] for k in KEYS]


_DERIVED = {"SAGEMAKER_IMAGE": "from AWS_REGION", "SAGEMAKER_ROLE_NAME": "from AWS_REGION", "JOB_NAME": "from TRAIN_SCRIPT"}  # empty = derived: `invoke config` shows the value in effect
_GENERIC_NAMES = {"train", "training", "main", "run", "__main__", "script", "scripts", "src", "code", "app", "entry",
                  "launch", "workload", "examples"}
BUILTIN_JOB_NAME = "imagenet"


def job_name_of(train_script: str) -> str:
    """The job's name when JOB_NAME is empty, from its code (TRAIN_SCRIPT): `imagenet` for the built-in workload;
    else the script's name, or, for a name that says nothing (train.py, main.py, -m pkg.train), its folder's or
    package's (examples/ddp-plain/train.py: ddp-plain), as a DNS-1035 label. Two scripts are two jobs: their
    checkpoints, metrics, models and runs never meet."""
    raw = train_script.strip()
    if raw.startswith("-m"):
        parts = raw[2:].strip().split(".")
    elif raw:
        path = Path(os.path.expanduser(raw))  # an unknown ~user stays as written (Path.expanduser raises)
        path = (path if path.is_absolute() else PROJECT_ROOT / path).resolve()
        if path == PROJECT_ROOT / "doeks" / "workload" / "train.py":
            return BUILTIN_JOB_NAME
        parts = [*path.parent.parts, path.stem]
    else:
        return BUILTIN_JOB_NAME
    for part in reversed(parts):
        name = re.sub(r"^[^a-z]+", "", re.sub(r"[^a-z0-9]+", "-", part.lower()))[:50].strip("-")
        if name and part.lower() not in _GENERIC_NAMES:
            return name
    return "job"


def mask_value(key: Key, raw: str) -> str:
    if key.secret and raw:
        return "****"
    return raw


def env_file() -> Path:
    return Path(os.environ.get("DOEKS_ENV_FILE", PROJECT_ROOT / ".env"))


def read_env_file(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    from dotenv import dotenv_values

    return {k: ("" if v is None else v) for k, v in dotenv_values(path).items()}


def load(environ: dict[str, str] | None = None, path: Path | None = None, lenient: bool = False) -> Settings:
    """Read `.env` and `.env.local`, let the environment override them, validate every key; raises SettingsError on
    the first bad one, naming where its value came from. `lenient` (config, doctor): a bad value is recorded in
    `problems` and its default used, so the tools to find it still run. Unknown keys in the files are warned about."""
    environ = os.environ if environ is None else environ
    path = path or env_file()
    files = {".env": read_env_file(path), ".env.local": read_env_file(path.with_name(path.name + ".local"))}
    _warn_unknown(files, path)
    raw, sources = {}, {}
    for key in KEYS:
        if key.name in environ:
            raw[key.name], sources[key.name] = environ[key.name], "environment"
        elif key.name in files[".env.local"]:
            raw[key.name], sources[key.name] = files[".env.local"][key.name], ".env.local"
        elif key.name in files[".env"]:
            raw[key.name], sources[key.name] = files[".env"][key.name], ".env"
        else:
            raw[key.name], sources[key.name] = key.default, "default"
    return _validate(raw, sources, lenient)


_WARNED: set[str] = set()


def unknown_keys(files: dict[str, dict[str, str]]) -> list[tuple[str, str, str | None]]:
    """(file, key, the closest known key or None) for each key of the files that doeks does not know."""
    import difflib

    found = []
    for name, values in files.items():
        for key in values:
            if key not in KEY_BY_NAME:
                close = difflib.get_close_matches(key.upper(), list(KEY_BY_NAME), n=1, cutoff=0.6)
                found.append((name, key, close[0] if close else None))
    return found


def _warn_unknown(files: dict[str, dict[str, str]], path: Path) -> None:
    for name, key, close in unknown_keys(files):
        shown = path.name if name == ".env" else path.name + ".local"
        line = (f"warning: {shown}: unknown key {key} is ignored" + (f": did you mean {close}?" if close else
                                                                  ": `invoke config` lists the keys"))
        if line not in _WARNED:  # once per process
            _WARNED.add(line)
            import sys

            print(line, file=sys.stderr)


_SHOWN_SOURCES = {".env": ".env", ".env.local": ".env.local", "environment": "the environment"}


def _where(message: str, sources: dict[str, str]) -> str:
    """` (from .env)`: where the values a message names came from (defaults and flags are not said)."""
    named = [n for n in dict.fromkeys(re.findall(r"\b[A-Z][A-Z0-9_]+\b", message)) if sources.get(n) in _SHOWN_SOURCES]
    if not named:
        return ""
    if len(named) == 1 and message.startswith(named[0] + "="):
        return f" (from {_SHOWN_SOURCES[sources[named[0]]]})"
    return " (" + ", ".join(f"{n} from {_SHOWN_SOURCES[sources[n]]}" for n in named) + ")"


def _validate(raw: dict[str, str], sources: dict[str, str], lenient: bool = False) -> Settings:
    values: dict[str, Any] = {}
    problems: dict[str, str] = {}
    for key in KEYS:
        value = raw[key.name].strip() if not key.secret else raw[key.name]
        try:
            values[key.name] = key.parse(value)
        except BadValue as bad:
            shown = mask_value(key, value)
            message = f"{key.name}={shown!r} is not accepted: expected {bad}"
            if not lenient:
                raise SettingsError(message + _where(message, sources)) from None
            problems[key.name] = message + _where(message, sources)
            values[key.name] = key.parse(key.default)
    try:
        _check_ranges(values, raw)
    except SettingsError as error:
        if not lenient:
            raise SettingsError(f"{error}{_where(str(error), sources)}") from None
        problems[str(error).split("=", 1)[0]] = f"{error}{_where(str(error), sources)}"
    # the GPU node type's GPUs and EFA interfaces: EC2's answer cached by doeks.instancetypes (offline: a table)
    gpus, efa, facts = _catalog.instance_facts(values["AWS_REGION"], values["GPU_INSTANCE_TYPE"])
    values["NODE_GPUS"], values["INSTANCE_FACTS"] = gpus, facts
    if values["EFA_PER_NODE"] == "auto":
        values["EFA_PER_NODE"] = (efa or 0) if values["GPU_EFA"] else 0
    elif not values["GPU_EFA"]:
        values["EFA_PER_NODE"] = 0
    if values["NPROC_PER_NODE"] == "auto":  # GPUs per node follow the node
        if values["TARGET"] == "eks":
            values["NPROC_PER_NODE"] = gpus or 1
        else:  # kubernetes: KUBE_GPUS per pod when it asks for GPUs; CPU targets: 2 processes
            values["NPROC_PER_NODE"] = values["KUBE_GPUS"] if values["TARGET"] == "kubernetes" and values["KUBE_GPUS"] else 2
    if not values["JOB_NAME"]:  # derived from the code, shown as such by `invoke config`
        values["JOB_NAME"] = job_name_of(values["TRAIN_SCRIPT"])
    if not values["SAGEMAKER_ROLE_NAME"]:  # one per region: IAM is global, the role's policy is the region's
        values["SAGEMAKER_ROLE_NAME"] = f"doeks-sagemaker-execution-{values['AWS_REGION']}"
    if not values["SAGEMAKER_IMAGE"]:  # derived from the region (doeks.catalog), shown as such by `invoke config`
        values["SAGEMAKER_IMAGE"] = _catalog.sagemaker_image(values["AWS_REGION"])
    return Settings(values, raw, sources, problems)


def _check_ranges(values: dict[str, Any], raw: dict[str, str]) -> None:
    def ordered(low: str, mid: str, high: str) -> None:
        if not values[low] <= values[mid] <= values[high]:
            raise SettingsError(
                f"{mid}={raw[mid]!r} is not accepted: expected {low} <= {mid} <= {high} "
                f"(here {values[low]} <= {values[mid]} <= {values[high]})")

    ordered("MIN_REPLICAS", "REPLICAS", "MAX_REPLICAS")
    _check_fsx(values, raw)
    if values["SAGEMAKER_SPOT"] and values["SAGEMAKER_MAX_WAIT"] < values["SAGEMAKER_MAX_RUN"]:
        raise SettingsError(f"SAGEMAKER_MAX_WAIT={raw['SAGEMAKER_MAX_WAIT']!r} is not accepted: expected >= SAGEMAKER_MAX_RUN ({values['SAGEMAKER_MAX_RUN']}) with spot training")
    if values["EFS_FILE_SYSTEM_ID"] and not values["SAGEMAKER_SUBNETS"]:
        raise SettingsError(f"EFS_FILE_SYSTEM_ID={raw['EFS_FILE_SYSTEM_ID']!r} is not accepted: expected SAGEMAKER_SUBNETS to be set too (EFS data needs VPC training)")
    for group in ("SYSTEM", "CPU", "GPU"):
        ordered(f"{group}_NODES_MIN", f"{group}_NODES", f"{group}_NODES_MAX")
    if values["AMI_FAMILY"] == "AmazonLinux2" and \
            _catalog.version_key(values["EKS_VERSION"]) > _catalog.version_key(_catalog.AL2_LAST_VERSION):
        raise SettingsError(f"AMI_FAMILY='AmazonLinux2' is not accepted: expected AmazonLinux2023 (or Bottlerocket, Ubuntu) "
                            f"with EKS_VERSION={values['EKS_VERSION']} (EKS builds no AL2 AMIs after {_catalog.AL2_LAST_VERSION})")
    if values["CAPACITY_RESERVATION_ID"] and values["GPU_SPOT"]:
        raise SettingsError("GPU_SPOT='true' is not accepted: expected false when CAPACITY_RESERVATION_ID is set")


def _check_fsx(values: dict[str, Any], raw: dict[str, str]) -> None:
    kind, capacity, throughput = values["FSX_DEPLOYMENT_TYPE"], values["FSX_STORAGE_CAPACITY"], values["FSX_THROUGHPUT"]
    if capacity != 1200 and capacity % 2400:
        raise SettingsError(f"FSX_STORAGE_CAPACITY={raw['FSX_STORAGE_CAPACITY']!r} is not accepted: expected 1200 or a multiple of 2400")
    allowed = {"PERSISTENT_2": (125, 250, 500, 1000), "PERSISTENT_1": (50, 100, 200), "SCRATCH_2": (0, 125, 250, 500, 1000)}[kind]
    if throughput not in allowed:
        raise SettingsError(f"FSX_THROUGHPUT={raw['FSX_THROUGHPUT']!r} is not accepted: expected one of {', '.join(map(str, allowed))} for {kind}")


_CACHE: dict[str, Settings] = {}


def current(lenient: bool = False) -> Settings:
    """The settings for this process, loaded and validated once (lenient: bad values in `problems`, see load)."""
    which = "lenient" if lenient else "s"
    if which not in _CACHE:
        _CACHE[which] = load(lenient=lenient)
    return _CACHE[which]


def reset() -> None:
    _CACHE.clear()


def render_env_file() -> str:
    """The documented `.env` with every key at its default (what the repository ships)."""
    lines = ["# doeks settings. Every key: what it is [unit] (default). Environment variables override this file.",
             "# Validated at start: a bad value stops the task with one line naming the key. `invoke config` shows the effect.",
             "# Keep secrets out of this file: put them in the environment or in .env.local (git-ignored, read after this)."]
    unit = None
    for key in KEYS:
        if key.unit != unit:
            unit = key.unit
            lines += ["", f"# ---- {unit} ----"]
        lines.append(f"# {key.help} [{key.unit}] (default: {key.default or 'empty'}; accepted: {key.accepted})")
        lines.append(f"{key.name}={key.default}")
    return "\n".join(lines) + "\n"


def render_reference_table() -> str:
    """The `.env` reference in docs/env-reference.md (a test keeps it in step with KEYS)."""
    rows = ["| key | unit | default | what | accepted |", "|---|---|---|---|---|"]
    for key in KEYS:
        rows.append(f"| `{key.name}` | {key.unit} | `{key.default}` | {key.help} | {key.accepted} |".replace("``", "(empty)"))
    return "\n".join(rows)


def sync_readme(path: Path = PROJECT_ROOT / "docs" / "env-reference.md") -> bool:
    """Rewrite the `.env` reference block (docs/env-reference.md, linked from the README); True if it changed."""
    return replace_block(path, "env-reference", render_reference_table())


def replace_block(path: Path, name: str, body: str) -> bool:
    """Put `body` between a page's `<!-- NAME:start -->` and `<!-- NAME:end -->` markers; True if the page changed.
    The generated parts of the docs are kept in step this way (and checked by the tests)."""
    text = path.read_text()
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    new = f"{head}{start}\n{body}\n{end}{tail}"
    if new != text:
        path.write_text(new)
    return new != text

"""Which job the job tasks (status, logs, delete, scale, artifacts, plot, history...) act on when the user names none:
the one last deployed from this folder to TARGET, remembered at deploy in STATE_DIR/last-job.json.

Without it a shell that lacked the deploy's TRAIN_SCRIPT or JOB_NAME acted on another job (the demo's `imagenet`)
and left the one just deployed running. A name given now (--job-name, or JOB_NAME / TRAIN_SCRIPT in the environment)
wins; a --job-name that matches no job is one line listing those that exist.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

NAMING = ("JOB_NAME", "TRAIN_SCRIPT")  # the keys that name a job
# what a later task needs to find the deployed job and its outputs (its name, code, where it writes, its size bounds)
CARRIED = ("JOB_NAME", "TRAIN_SCRIPT", "TRAIN_SOURCE", "CHECKPOINT_URI", "MODEL_URI", "MIN_REPLICAS", "MAX_REPLICAS")
_GIVEN = ("environment", "flag")


def path(settings) -> Path:
    return settings.state_dir / "last-job.json"


def _read(settings) -> dict:
    try:
        found = json.loads(path(settings).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def remember(settings) -> None:
    """Record the job just deployed as TARGET's last: its name and the keys a later task needs (CARRIED), as typed."""
    found = _read(settings)
    found[settings.target] = {"job": settings.job_name, "when": time.time(),
                              "keys": {key: settings.raw(key) for key in CARRIED if key != "JOB_NAME"}}
    target = path(settings)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(found, indent=2))
    os.replace(tmp, target)


def last(settings) -> dict | None:
    """TARGET's last deployed job as recorded ({"job", "when", "keys"}), None when none was deployed from here."""
    record = _read(settings).get(settings.target)
    return record if isinstance(record, dict) and record.get("job") else None


def named(settings) -> bool:
    """The user named the job now: --job-name, or JOB_NAME / TRAIN_SCRIPT in the environment."""
    return any(settings.source(key) in _GIVEN for key in NAMING)


def choose(settings, say=None):
    """The settings of the job to act on: as given when the user named one (a --job-name must match a job that
    exists); else those of TARGET's last deployed job (said in one line through `say` where it is not the job the
    settings name anyway); else as they are."""
    if named(settings):
        if settings.source("JOB_NAME") == "flag":
            _refuse_unknown(settings)
        return settings
    record = last(settings)
    if record is None:
        return settings
    keys = {k: v for k, v in (record.get("keys") or {}).items()
            if k in CARRIED and settings.source(k) not in _GIVEN}  # a key set now (MAX_REPLICAS=4 ...) wins
    from .errors import SettingsError

    try:
        chosen = settings.with_overrides(job_name=record["job"], **{k.lower(): v for k, v in keys.items()})
    except SettingsError:  # its script moved or a value no longer accepted: the job is still found by its name
        chosen = settings.with_overrides(job_name=record["job"])
    if say is not None and chosen.job_name != settings.job_name:  # the job these settings name needs no word
        say(f"job {chosen.job_name} (last deployed to TARGET={settings.target} from here; --job-name names another)")
    return chosen


def known(settings) -> list[str]:
    """The jobs deployed from here to TARGET (their runs, and the last one recorded), sorted."""
    from .targets import runs

    names = set(runs.jobs(settings, settings.target))
    record = last(settings)
    if record is not None:
        names.add(record["job"])
    return sorted(names)


def _refuse_unknown(settings) -> None:
    """--job-name X where no job X was deployed from here and TARGET has none by that name: one line naming those
    that exist (a job another machine deployed to a cluster is found there, and passes)."""
    from .errors import DoeksError

    names = known(settings)
    if settings.job_name in names:
        return
    from . import targets

    try:
        status = targets.get(settings).describe()
    except DoeksError:  # the target cannot be read now: the task says so itself, with its fix
        return
    if status.run:  # there on the target (deployed from elsewhere, or before the records)
        return
    there = f"the jobs deployed from here: {', '.join(names)}" if names else \
        "no job was deployed from here (`invoke elasticjob.deploy` starts one)"
    raise DoeksError(f"--job-name {settings.job_name}: no such job on TARGET={settings.target}; {there}")

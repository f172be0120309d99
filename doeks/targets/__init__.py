"""Where a job runs: one interface (`base.Target`), one class per TARGET, looked up by name.

    target = targets.get(settings)          # chosen once, from TARGET
    plan = target.plan(target.job(train_args, fresh))  # the job as one value, resolved once
    plan.show(runner)                       # the dry run
    target.submit(plan, runner)             # the run
    target.describe() / logs() / scale(n) / cancel() / artifacts()

This package and `doeks.settings` are the only places that branch on TARGET. A place to run is one file here (or a
module named in DOEKS_TARGETS): a class deriving from `Target` (or one of these) with a `name`, answering the job's
verbs and the units' (see `base.Target`), listed in doeks.keys.BUILTIN_TARGETS (or DOEKS_TARGETS for one of yours).
"""
from __future__ import annotations

from .base import (COLUMNS, FINAL, STATES, Job, JobStatus, NotSupported, Plan, ReplicaStatus, Step, Target, World)

# The KFP pipeline's training_runtime values (the seed's kubernetes and sagemaker, and doeks' own) -> targets.
RUNTIMES = {"kubernetes": "eks", "eks": "eks", "sagemaker": "sagemaker", "local": "local", "docker": "docker"}
VERBS = ("checks", "plan", "submit", "describe", "logs", "scale", "cancel", "artifacts")


def names() -> tuple[str, ...]:
    """Every TARGET value: doeks.keys.BUILTIN_TARGETS, then DOEKS_TARGETS' modules'."""
    from ..keys import target_names

    return target_names()


def _class(settings, name: str | None = None) -> type:
    import importlib

    from ..errors import DoeksError
    from ..keys import REHEARSAL_TARGET, target_classes

    name = name or settings.target
    found = target_classes()
    if name not in found:
        raise DoeksError(f"TARGET={name!r}: expected one of {', '.join(names())}")
    module, cls = found[name]
    if name == "eks" and getattr(settings, "eks_rehearsal", False):  # EKS_REHEARSAL: the eks target on this machine
        module, cls = REHEARSAL_TARGET
    return getattr(importlib.import_module(module), cls)


def settled(settings, cls: type | None = None):
    """The settings with what TARGET's class (or `cls`) fills in for keys the user left empty (Target.store_defaults:
    where the job's checkpoints and model go); the same settings where it fills nothing."""
    cls = cls or _class(settings)
    defaults = cls.store_defaults(settings)
    why = {key: f"TARGET={cls.name}'s default" for key in defaults}
    return settings.with_defaults(cls.name, why, **defaults) if defaults else settings


def get(settings, name: str | None = None) -> Target:
    """The target for TARGET (or `name`): its class found by doeks.keys.target_classes, constructed once, with
    the settings as it fills them (`settled`)."""
    cls = _class(settings, name)
    return cls(settled(settings, cls))


def for_runtime(settings, runtime: str) -> Target:
    """The target a pipeline `training_runtime` value maps onto."""
    from ..errors import DoeksError

    if runtime not in RUNTIMES:
        raise DoeksError(f"training_runtime {runtime!r}: expected one of {', '.join(RUNTIMES)}")
    return get(settings.with_overrides(target=RUNTIMES[runtime]))


__all__ = ["COLUMNS", "FINAL", "STATES", "World", "Job", "JobStatus", "NotSupported", "Plan", "ReplicaStatus", "Step", "Target",
           "RUNTIMES", "VERBS", "get", "for_runtime", "names", "settled"]

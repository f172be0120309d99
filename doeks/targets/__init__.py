"""Where a job runs: one interface (`base.Target`), one class per TARGET, looked up by name.

    target = targets.get(settings)          # chosen once, from TARGET
    plan = target.plan(targets.Job(settings, train_args, fresh))
    plan.show(runner)                       # the dry run
    target.submit(plan, runner)             # the run
    target.describe() / logs() / scale(n) / cancel() / artifacts()

This package and `doeks.settings` are the only places that branch on TARGET for the job.
"""
from __future__ import annotations

from .base import (COLUMNS, FINAL, STATES, Job, JobStatus, NotSupported, Plan, ReplicaStatus, Step, Target)

_CLASSES = {
    "local": ("doeks.targets.local", "LocalTarget"),
    "docker": ("doeks.targets.docker", "DockerTarget"),
    "kubernetes": ("doeks.targets.kubernetes", "KubernetesTarget"),
    "eks": ("doeks.targets.eks", "EksTarget"),
    "sagemaker": ("doeks.targets.sagemaker", "SageMakerTarget"),
}
# The KFP pipeline's training_runtime values (the seed's kubernetes and sagemaker, and doeks' own) -> targets.
RUNTIMES = {"kubernetes": "eks", "eks": "eks", "sagemaker": "sagemaker", "local": "local", "docker": "docker"}
VERBS = ("checks", "plan", "submit", "describe", "logs", "scale", "cancel", "artifacts")


def names() -> tuple[str, ...]:
    return tuple(_CLASSES)


def get(settings, name: str | None = None) -> Target:
    """The target for TARGET (or `name`)."""
    import importlib

    from ..errors import DoeksError

    name = name or settings.target
    if name not in _CLASSES:
        raise DoeksError(f"TARGET={name!r}: expected one of {', '.join(_CLASSES)}")
    module, cls = _CLASSES[name]
    return getattr(importlib.import_module(module), cls)(settings)


def for_runtime(settings, runtime: str) -> Target:
    """The target a pipeline `training_runtime` value maps onto."""
    from ..errors import DoeksError

    if runtime not in RUNTIMES:
        raise DoeksError(f"training_runtime {runtime!r}: expected one of {', '.join(RUNTIMES)}")
    return get(settings.with_overrides(target=RUNTIMES[runtime]))


__all__ = ["COLUMNS", "FINAL", "STATES", "Job", "JobStatus", "NotSupported", "Plan", "ReplicaStatus", "Step", "Target",
           "RUNTIMES", "VERBS", "get", "for_runtime", "names"]

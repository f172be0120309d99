"""What every unit's tasks.py uses: a `task` decorator that turns failures into one-line errors, settings and a
runner for the task, and the unit declaration that gives root `up`/`down` their order.

Kept light on purpose: `invoke --list` imports this module, so nothing heavy (torch, boto3, kubernetes) is imported
here; tasks import what they need when they run.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from invoke import Exit
from invoke import task as _invoke_task

from .errors import DoeksError

_FOREIGN_ERRORS = ("botocore", "boto3", "kubernetes", "docker", "requests", "urllib3", "etcd", "yaml")


def task(*args, **kwargs):
    """Like `invoke.task`, but a DoeksError (or a library error) ends the task with one line and exit code 1."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(c, *a, **kw):
            try:
                return fn(c, *a, **kw)
            except Exit:
                raise
            except DoeksError as error:
                raise Exit(f"error: {error}", code=1) from None
            except KeyboardInterrupt:
                raise Exit("interrupted", code=130) from None
            except Exception as error:  # noqa: BLE001 - library errors become one line, not a traceback
                if type(error).__module__.split(".")[0] in _FOREIGN_ERRORS:
                    from .settings import current

                    message = str(error).splitlines()[0] if str(error) else type(error).__name__
                    for secret in _safe_secrets(current):
                        message = message.replace(secret, "****")
                    raise Exit(f"error: {type(error).__name__}: {message}", code=1) from None
                raise

        return _invoke_task(**kwargs)(wrapper)

    if args and callable(args[0]):
        return decorate(args[0])
    return decorate


def _safe_secrets(current) -> list[str]:
    try:
        return current().secrets()
    except DoeksError:
        return []


def settings(**overrides):
    """The validated settings, with task flags (non-None) applied on top."""
    from .settings import current

    base = current()
    return base.with_overrides(**overrides) if any(v is not None for v in overrides.values()) else base


def runner(dry_run: bool = False):
    from .runner import Runner

    return Runner(dry_run=dry_run, secrets=settings().secrets())


@dataclass(frozen=True)
class Unit:
    """A unit's place in setup order; root `up` runs `up` tasks in ascending order and `down` tasks in reverse."""

    name: str
    order: int
    up: Callable
    down: Callable


def int_flag(name: str, value, low: int | None = None, high: int | None = None) -> int | None:
    """A task flag that must be an integer: one line naming the flag otherwise (None stays None)."""
    if value is None:
        return None
    try:
        number = int(str(value).strip())
    except ValueError:
        raise DoeksError(f"--{name.replace('_', '-')} {value!r}: expected an integer") from None
    if (low is not None and number < low) or (high is not None and number > high):
        raise DoeksError(f"--{name.replace('_', '-')} {number}: expected an integer from {low} to {high}")
    return number

"""What every unit's tasks.py uses: a `task` decorator that turns failures into one-line errors, settings and a
runner for the task, and the unit declaration that gives root `up`/`down` their order.

Kept light on purpose: `invoke --list` imports this module, so nothing heavy (torch, boto3, kubernetes) is imported
here; tasks import what they need when they run.
"""
from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from typing import Callable

from invoke import Exit, Task
from invoke import task as _invoke_task

from .errors import DoeksError, FlagError, library_error

_FOREIGN_ERRORS = ("botocore", "boto3", "kubernetes", "docker", "requests", "urllib3", "etcd", "yaml")


class _Task(Task):
    """An invoke Task whose int and float flags reach the wrapper as text: invoke casts them while it parses the
    command line, where a bad value is a ValueError traceback (invoke 3.0 tasks.py arg_opts: kind = type(default));
    the wrapper converts them with a one-line error that names the flag."""

    def arg_opts(self, name, default, taken_names):
        # invoke 3.0 gives a flag the first character of its name no other flag took as its short flag, '-' too: a
        # task with many flags showed `--=STRING, --train-requirements=STRING` (and `--` parsed as that flag)
        taken_names = set(taken_names) | {"-"}
        if name != "dry_run" and "dry_run" in inspect.signature(self.body).parameters:
            taken_names |= {"d"}  # -d is --dry-run in every task that has one
        opts = super().arg_opts(name, default, taken_names)
        validator = getattr(self.body, "doeks_flags", {}).get(name)
        if opts.get("kind") in (int, float):
            opts["kind"] = str
        if validator is not None and hasattr(validator, "describe"):  # the help says what the STRING must be
            opts["help"] = f"{opts.get('help') or name.replace('_', ' ')} ({validator.describe()})"
        return opts


def task(*args, **kwargs):
    """Like `invoke.task`, but a DoeksError (or a library error) ends the task with one line and exit code 1.

    Flags are validated before the body runs: every flag with an int (float) default must be one; `flags` maps
    other flag names to validators (`Int`, `Float`, `Choice`, `Duration`: callables (flag, value) -> value)."""
    flags = dict(kwargs.pop("flags", None) or {})

    def decorate(fn: Callable) -> Callable:
        validators = dict(flags)
        for name, parameter in inspect.signature(fn).parameters.items():
            default = parameter.default
            if name not in validators and type(default) in (int, float):
                validators[name] = Int() if type(default) is int else Float()
        unknown = set(flags) - set(inspect.signature(fn).parameters)
        if unknown:
            raise TypeError(f"{fn.__name__}: flags for unknown parameters {sorted(unknown)}")

        @functools.wraps(fn)
        def wrapper(c, *a, **kw):
            try:
                if validators:
                    bound = inspect.signature(fn).bind(c, *a, **kw)
                    for name, validate in validators.items():
                        if name in bound.arguments:
                            bound.arguments[name] = validate(name, bound.arguments[name])
                    a, kw = bound.args[1:], bound.kwargs
                return fn(c, *a, **kw)
            except Exit:
                raise
            except DoeksError as error:
                raise Exit(f"error: {_mask(error)}", code=1) from None
            except KeyboardInterrupt:
                raise Exit("interrupted", code=130) from None
            except Exception as error:  # noqa: BLE001 - library errors become one line, not a traceback
                typed = library_error(error)
                if typed is not None:
                    raise Exit(f"error: {_mask(typed)}", code=1) from None
                if type(error).__module__.split(".")[0] in _FOREIGN_ERRORS:
                    message = str(error).splitlines()[0] if str(error) else type(error).__name__
                    raise Exit(f"error: {type(error).__name__}: {_mask(message)}", code=1) from None
                raise

        wrapper.doeks_flags = validators
        return _invoke_task(klass=_Task, **kwargs)(wrapper)

    if args and callable(args[0]):
        return decorate(args[0])
    return decorate


def _mask(message) -> str:
    from .settings import current

    message = str(message)
    for secret in _safe_secrets(current):
        message = message.replace(secret, "****")
    return message


def _safe_secrets(current) -> list[str]:
    try:
        return current().secrets()
    except DoeksError:
        return []


def settings(**overrides):
    """The validated settings, with task flags (non-None) applied on top."""
    from .settings import current

    from .errors import SettingsError

    base = current()
    from . import targets

    if targets.get(base).connect():  # kubectl and the Python client of this process talk to the target's cluster
        from .settings import reset  # the target set this process's AWS endpoint and credentials (the rehearsal)

        reset()
        base = current()
        targets.get(base).connect()
    if base.instance_facts_unknown:  # NPROC_PER_NODE/EFA_PER_NODE=auto: EC2 says what the GPU node type has, once
        from . import instancetypes
        from .settings import reset

        if instancetypes.refresh(base):
            reset()
            base = current()
    if not any(v is not None for v in overrides.values()):
        return targets.settled(base)  # what the target fills in where the user named nothing (checkpoints, model)
    try:
        return targets.settled(base.with_overrides(**overrides))
    except SettingsError as error:  # name the flag the user typed, not the key it overrides
        for name, value in overrides.items():
            prefix = f"{name.upper()}="
            if value is not None and str(error).startswith(prefix):
                raise FlagError(f"{_flag(name)} {str(error)[len(prefix):]}") from None
        # a check across keys (MIN_REPLICAS <= REPLICAS <= MAX_REPLICAS) that names a .env key: say which flags
        # typed took part, else `--min-replicas 3 --max-replicas 2` read as a complaint about .env's REPLICAS=2
        typed = [f"{_flag(name)} {value}" for name, value in overrides.items()
                 if value is not None and re.search(rf"\b{name.upper()}\b", str(error))]
        if typed:
            raise FlagError(f"{', '.join(typed)}: {error}") from None
        raise


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


def target(s=None, **overrides):
    """The target of TARGET for the task (settings with the task's flags applied), connected."""
    from . import targets

    return targets.get(s or settings(**overrides))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def int_flag(name: str, value, low: int | None = None, high: int | None = None) -> int | None:
    """A task flag that must be an integer: one line naming the flag otherwise (None stays None)."""
    return Int(low, high)(name, value)


class Int:
    """An integer flag, optionally within [low, high] (None stays None)."""

    def __init__(self, low: int | None = None, high: int | None = None):
        self.low, self.high = low, high

    def __call__(self, name: str, value):
        if value is None or isinstance(value, bool):
            return value
        try:
            number = int(str(value).strip())
        except ValueError:
            raise FlagError(f"{_flag(name)} {value!r}: expected an integer{self._range()}") from None
        if (self.low is not None and number < self.low) or (self.high is not None and number > self.high):
            raise FlagError(f"{_flag(name)} {number}: expected an integer{self._range()}")
        return number

    def describe(self) -> str:
        return "an integer" + self._range()

    def _range(self) -> str:
        if self.low is not None and self.high is not None:
            return f" from {self.low} to {self.high}"
        if self.low is not None:
            return f" >= {self.low}"
        return f" <= {self.high}" if self.high is not None else ""


class Float(Int):
    """A number flag, optionally within [low, high]."""

    def describe(self) -> str:
        return "a number" + self._range()

    def __call__(self, name: str, value):
        if value is None or isinstance(value, bool):
            return value
        try:
            number = float(str(value).strip())
        except ValueError:
            raise FlagError(f"{_flag(name)} {value!r}: expected a number{self._range()}") from None
        if number != number or (self.low is not None and number < self.low) or (self.high is not None and number > self.high):
            raise FlagError(f"{_flag(name)} {value}: expected a number{self._range()}")
        return number


class Choice:
    """One of a fixed set of words."""

    def __init__(self, *choices: str):
        self.choices = choices

    def describe(self) -> str:
        return "one of " + ", ".join(self.choices)

    def __call__(self, name: str, value):
        if value is None or value in self.choices:
            return value
        raise FlagError(f"{_flag(name)} {value!r}: expected one of {', '.join(self.choices)}")


_DURATION = re.compile(r"(\d+)([smhd])")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class Duration:
    """A duration such as 90s, 15m, 1h or 2d (also 1h30m); the value stays text, checked here."""

    def describe(self) -> str:
        return "a duration such as 90s, 15m, 1h or 2d"

    def __call__(self, name: str, value):
        if value is None:
            return value
        text = str(value).strip()
        if not text or _DURATION.sub("", text) or not _DURATION.findall(text):
            raise FlagError(f"{_flag(name)} {value!r}: expected a duration such as 90s, 15m, 1h or 2d")
        return text

    @staticmethod
    def seconds(text: str) -> int:
        return sum(int(n) * _SECONDS[unit] for n, unit in _DURATION.findall(text))


class Size:
    """A byte size as nccl-tests reads it (its parsesize: digits with an optional K, M or G), e.g. 64M or 1G."""

    def describe(self) -> str:
        return "a size such as 8, 64M or 1G"

    def __call__(self, name: str, value):
        if value is None:
            return value
        text = str(value).strip()
        if not re.fullmatch(r"\d+[KMGkmg]?", text):
            raise FlagError(f"{_flag(name)} {value!r}: expected a size such as 8, 64M or 1G")
        return text

"""One bounded wait: a predicate polled until it gives a truthy value or the limit passes, and then an error that
names what was waited for and for how long (every wait in doeks has a limit and says what it waited for)."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

from .errors import DoeksError

T = TypeVar("T")


def until(predicate: Callable[[], T], timeout: float, what: str, poll: float = 0.2,
          error: type[Exception] = DoeksError) -> T:
    """The predicate's first truthy value, or `error` saying "timed out after <timeout>s waiting for <what>"."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise error(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(poll)

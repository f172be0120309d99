"""Terminal output: everything human-facing goes to stderr, so stdout stays a clean YAML stream. A task whose
answer *is* the output (`invoke config`) prints its table to stdout instead (`table(..., stdout=True)`)."""
from __future__ import annotations

import functools
import sys


@functools.lru_cache(maxsize=None)
def console():
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def say(message: str, style: str | None = None) -> None:
    console().print(message, style=style, markup=False)


def warn(message: str) -> None:
    console().print(f"warning: {message}", style="yellow", markup=False)


def stdout_console():
    """A console on stdout. Piped (not a terminal), rich would wrap and cut cells at 80 columns: there it is as
    wide as the content needs (a table is never wider than its cells), so `... | grep` sees whole values."""
    from rich.console import Console

    wide = None if sys.stdout.isatty() else 100_000
    return Console(file=sys.stdout, highlight=False, soft_wrap=True, width=wide)


def stderr_table_console():
    """The console tables on stderr print to: piped (not a terminal), as wide as the content needs, as on stdout, so
    an id a later command takes (`elasticjob.history`'s run for `logs --run`) or a path is never cut to `…`."""
    if sys.stderr.isatty():
        return console()
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True, width=100_000)


def table(title: str, columns: list[str], rows: list[list[object]], stdout: bool = False) -> None:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for column in columns:
        t.add_column(column, overflow="fold" if stdout else "ellipsis")
    for row in rows:
        t.add_row(*["" if cell is None else str(cell) for cell in row])
    (stdout_console() if stdout else stderr_table_console()).print(t)


def progress(transient: bool = False):
    """A rich progress display on stderr (a context manager)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console(),
        transient=transient,
    )

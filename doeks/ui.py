"""Terminal output: everything human-facing goes to stderr, so stdout stays a clean YAML stream."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def console():
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def say(message: str, style: str | None = None) -> None:
    console().print(message, style=style, markup=False)


def warn(message: str) -> None:
    console().print(f"warning: {message}", style="yellow", markup=False)


def table(title: str, columns: list[str], rows: list[list[object]]) -> None:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for column in columns:
        t.add_column(column)
    for row in rows:
        t.add_row(*["" if cell is None else str(cell) for cell in row])
    console().print(t)


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

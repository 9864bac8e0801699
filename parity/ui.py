"""Terminal output shared by every command: rich tables and progress bars."""

from __future__ import annotations

# Imports inside functions: rich's table and progress load when first shown (start-up time).
from contextlib import contextmanager
from typing import Any, Iterator


def console(width: int = 140) -> Any:
    """A rich Console; piped output gets `width` columns instead of being squeezed to 80."""
    from rich.console import Console
    c = Console()
    return c if c.is_terminal else Console(width=width)


class Bar:
    """One progress bar; `None`-safe for callers: a disabled bar's methods do nothing."""

    def __init__(self, progress: Any = None, task: Any = None):
        self.progress, self.task = progress, task

    def advance(self, n: int = 1, description: str | None = None) -> None:
        if self.progress is not None:
            kw = {} if description is None else {"description": description}
            self.progress.update(self.task, advance=n, **kw)

    def completed(self, n: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=n)


@contextmanager
def progress(label: str, total: int | None, enabled: bool = True, completed: int = 0,
             eta: bool = False, transient: bool = False) -> Iterator[Bar]:
    """A labelled bar with count and elapsed time (and time remaining with `eta`)."""
    if not enabled or total == 0:
        yield Bar()
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    cols = [TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    if eta:
        cols.append(TimeRemainingColumn())
    with Progress(*cols, TextColumn("{task.description}"), transient=transient) as p:
        yield Bar(p, p.add_task("", total=total, completed=completed))

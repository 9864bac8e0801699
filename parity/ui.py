"""Terminal output shared by every command: rich tables and progress bars."""

from __future__ import annotations

# Imports inside functions: rich's table and progress load when first shown (start-up time).
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

# The bar on screen, if any: long work below it (a rollout) reports through its description,
# since a second live display cannot open beside it.
_shown: list["Bar"] = []


def console(width: int = 140, stderr: bool = False) -> Any:
    """A rich Console on stdout (or `stderr`); piped output gets `width` columns instead of
    being squeezed to 80."""
    from rich.console import Console
    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(width=width, stderr=stderr)


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

    def describe(self, text: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=text)


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
        bar = Bar(p, p.add_task("", total=total, completed=completed))
        _shown.append(bar)
        try:
            yield bar
        finally:
            _shown.remove(bar)


def say(text: str) -> None:
    """One line on stderr when long work starts (building a model, starting an engine)."""
    print(f"parity: {text}", file=sys.stderr, flush=True)


class Ticker:
    """Progress of one piece of work that is usually quick (a rollout) and sometimes is not: silent
    for its first `after_s`, then `label done/total unit` at most once a second, in the
    description of the bar on screen or, without one, as a line on stderr every 10 s."""

    def __init__(self, label: str, total: int, unit: str, after_s: float = 30.0):
        self.label, self.total, self.unit, self.after_s = label, total, unit, after_s
        self.t0 = self.last = time.monotonic()

    def __call__(self, done: int) -> None:
        now = time.monotonic()
        bar = _shown[-1] if _shown else None
        if now - self.t0 < self.after_s or now - self.last < (1.0 if bar else 10.0):
            return
        self.last = now
        text = f"{self.label}: {done}/{self.total} {self.unit}, {now - self.t0:.0f} s"
        if bar is not None:
            bar.describe(text)
        else:
            say(text)

"""A progress bar for the long waits outside training (indexing shards, packing): rich on a terminal, nothing
otherwise (logs stay clean)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


@contextmanager
def progress_bar(description: str, total: float) -> Iterator[Callable[[float], None]]:
    """Yields `advance(amount)`; the bar is drawn only when stderr is a terminal."""
    if not sys.stderr.isatty():
        yield lambda amount: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda amount: bar.advance(task, amount)

"""Progress for the long waits around a run: scanning a dataset, generating the built-in one, a benchmark's runs.

    with waiting(f"scanning {root}", unit="files") as progress:
        for path in ...:
            progress.advance()

On a terminal: a bar (or, without a total, a count) with the rate, elapsed time and ETA, log lines printed above
it. Off a terminal: the same numbers as a log line every LOG_EVERY_S. Either way, a wait that took MIN_REPORT_S or
more ends with one log line: what, how many, how long, how fast. `advance` is cheap enough to call per file: it
counts, and passes the count on at most every PUSH_EVERY_S. One bar at a time: a wait inside another reports into
the outer one.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from stoker.common.terminal import StderrAbove

log = logging.getLogger("stoker")

LOG_EVERY_S = 10.0
MIN_REPORT_S = 1.0
PUSH_EVERY_S = 0.1


def rate_text(count: int, seconds: float, unit: str) -> str:
    """'31,096 files/s', '2.5 runs/s' or '18.2 s each' (below one a second)."""
    if count <= 0 or seconds <= 0:
        return f"- {unit}/s"
    rate = count / seconds
    if rate >= 10:
        return f"{rate:,.0f} {unit}/s"
    if rate >= 1:
        return f"{rate:.1f} {unit}/s"
    return f"{seconds / count:.1f} s each"


class Waiting:
    """The count of one wait; `advance` and `update` from the code that waits."""

    def __init__(self, description: str, total: int | None, unit: str, bar: Progress | None,
                 rate: bool = True, silent: bool = False) -> None:
        self.description = description
        self.silent = silent  # a wait inside another: counted, never shown (the outer one is)
        self.total = total
        self.unit = unit
        self.rate = rate
        self.count = 0
        self.started = self._last_push = self._last_log = time.monotonic()
        self._bar = bar
        self._task = bar.add_task(description, total=total) if bar is not None else None

    def advance(self, amount: int = 1) -> None:
        self.update(self.count + amount)

    def update(self, count: int) -> None:
        self.count = count
        now = time.monotonic()
        if now - self._last_push >= PUSH_EVERY_S:
            self._push(now)

    def _push(self, now: float) -> None:
        if self.silent:
            return
        self._last_push = now
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=self.count)
        elif now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            log.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        elapsed = (time.monotonic() if now is None else now) - self.started
        count = f"{self.count:,}" if self.total is None else f"{self.count:,}/{self.total:,}"
        rate = f" ({rate_text(self.count, elapsed, self.unit)})" if self.rate else ""
        return f"{self.description}: {count} {self.unit} in {elapsed:.1f} s{rate}"


_current: Waiting | None = None


@contextmanager
def waiting(description: str, total: int | None = None, unit: str = "files", rate: bool = True
            ) -> Iterator[Waiting]:
    """`rate=False` for a wait counted in seconds (a soak test), where a rate says nothing."""
    global _current
    if _current is not None:  # one bar at a time: the outer wait's (a benchmark's runs, not each run's scan)
        yield Waiting(description, total, unit, None, rate, silent=True)
        return
    stderr = StderrAbove() if sys.stderr.isatty() else None
    bar = _bar(stderr, total is not None, unit, rate) if stderr is not None else None
    _current = progress = Waiting(description, total, unit, bar, rate)
    try:
        if bar is not None:
            bar.start()
        yield progress
    finally:
        _current = None
        if bar is not None:
            bar.stop()
        if stderr is not None:
            stderr.restore()
    if time.monotonic() - progress.started >= MIN_REPORT_S:
        log.info("%s", progress.line())


def _bar(stderr: StderrAbove, with_total: bool, unit: str, rate: bool) -> Progress:
    columns: list[ProgressColumn | str] = [SpinnerColumn(), TextColumn("{task.description}")]
    if with_total:
        columns += [BarColumn(), TextColumn(f"{{task.completed:,}}/{{task.total:,}} {unit}")]
    else:
        columns += [TextColumn(f"{{task.completed:,}} {unit}")]
    columns += [_Rate(unit)] if rate else []
    columns += [TimeElapsedColumn()]
    if with_total:
        columns += [TimeRemainingColumn()]
    return Progress(*columns, console=stderr.console, transient=True, redirect_stderr=False)


class _Rate(ProgressColumn):
    """The average rate since the start: the figure the closing log line gives."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        return Text(rate_text(int(task.completed), task.elapsed or 0.0, self.unit))

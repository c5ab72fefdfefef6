"""Progress while a run goes: a rich bar on a terminal, plain log lines (no control characters) otherwise."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

log = logging.getLogger("stoker")


@dataclass(frozen=True)
class Snapshot:
    epoch: int
    epochs: int
    step: int
    total_steps: int
    samples_per_s: float
    loss: float | None
    stall: float
    producers: int
    val_accuracy: float | None

    def line(self) -> str:
        loss = f"{self.loss:.3f}" if self.loss is not None else "-"
        accuracy = f"{self.val_accuracy:.1%}" if self.val_accuracy is not None else "-"
        return (f"epoch {self.epoch + 1}/{self.epochs} step {self.step}/{self.total_steps} "
                f"{self.samples_per_s:,.0f} samples/s loss {loss} stall {self.stall:.1%} "
                f"producers {self.producers} val acc {accuracy}")


class ProgressView:
    def __init__(self, total_steps: int, interval_s: float, enabled: bool = True) -> None:
        self.interval_s = interval_s
        self._last_line = 0.0
        self._bar: Progress | None = None
        if enabled and sys.stderr.isatty():
            self._bar = Progress(TextColumn("[bold]stoker"), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.description}"),
                                 console=Console(stderr=True), transient=False)
            self._task = self._bar.add_task("starting", total=total_steps)
            self._bar.start()
        self.enabled = enabled

    def update(self, snapshot: Snapshot) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=snapshot.step, total=snapshot.total_steps,
                             description=snapshot.line())
        elif self.enabled and time.monotonic() - self._last_line >= self.interval_s:
            self._last_line = time.monotonic()
            log.info("%s", snapshot.line())

    def close(self) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.stop()

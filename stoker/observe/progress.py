"""Progress while a run goes: on a terminal, one rich live panel updated in place for the whole run (epoch and
run bars with ETA, each consumer's time split, queue fill, producers, loss, accuracy and the verdict) with every
log line and every child's warning printed above it; otherwise plain log lines with the same numbers and no
control characters."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

from rich.console import Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from stoker.common.terminal import StderrAbove

log = logging.getLogger("stoker")
REFRESH_S = 0.25


@dataclass(frozen=True)
class Snapshot:
    epoch: int
    epochs: int
    epoch_step: int
    steps_per_epoch: int
    step: int
    total_steps: int
    samples_per_s: float
    loss: float | None
    val_accuracy: float | None
    consumers: tuple[tuple[float, float, float], ...]  # per consumer: compute, input wait, averaging shares
    queue_fill: float
    producers: int
    producer_budget: int
    producer_utilization: float
    verdict: str
    host: tuple[float, ...] = ()  # per consumer: the device idle for the host (GPUs; 0 on the CPU)

    def line(self) -> str:
        loss = f"{self.loss:.3f}" if self.loss is not None else "-"
        accuracy = f"{self.val_accuracy:.1%}" if self.val_accuracy is not None else "-"
        compute, wait, averaging = (sum(c[i] for c in self.consumers) / max(1, len(self.consumers))
                                    for i in range(3))
        host = f" host {sum(self.host) / len(self.host):.0%}" if any(self.host) else ""
        return (f"epoch {self.epoch + 1}/{self.epochs} step {self.step}/{self.total_steps} "
                f"{self.samples_per_s:,.0f} samples/s loss {loss} val acc {accuracy} | compute {compute:.0%} "
                f"input wait {wait:.0%}{host} averaging {averaging:.0%} | queue {self.queue_fill:.0%} producers "
                f"{self.producers} (up to {self.producer_budget}) busy {self.producer_utilization:.0%} | "
                f"{self.verdict}")


class ProgressView:
    """Ask `due()` before building a snapshot: the terminal panel takes one every REFRESH_S, log lines every
    `interval_s`, and a quiet run none, so the controller's loop builds none in between."""

    def __init__(self, total_steps: int, steps_per_epoch: int, interval_s: float, enabled: bool = True) -> None:
        self.interval_s = interval_s
        self.enabled = enabled
        self._last_shown = 0.0
        self._live: Live | None = None
        self._stderr: StderrAbove | None = None
        if enabled and sys.stderr.isatty():
            self._bars = Progress(TextColumn("{task.description:>6}"), BarColumn(), MofNCompleteColumn(),
                                  TimeRemainingColumn())
            self._epoch_bar = self._bars.add_task("epoch", total=steps_per_epoch)
            self._run_bar = self._bars.add_task("run", total=total_steps)
            self._stderr = StderrAbove()  # before any child starts: they inherit descriptor 2
            self._live = Live(self._bars, console=self._stderr.console, refresh_per_second=1 / REFRESH_S,
                              redirect_stderr=False)
            self._live.start()

    def due(self) -> bool:
        interval = REFRESH_S if self._live is not None else self.interval_s
        return self.enabled and time.monotonic() - self._last_shown >= interval

    def update(self, snapshot: Snapshot) -> None:
        self._last_shown = time.monotonic()
        if self._live is not None:
            self._bars.update(self._epoch_bar, completed=snapshot.epoch_step, total=snapshot.steps_per_epoch,
                              description=f"epoch {snapshot.epoch + 1}/{snapshot.epochs}")
            self._bars.update(self._run_bar, completed=snapshot.step, total=snapshot.total_steps)
            self._live.update(Group(self._bars, panel(snapshot)))
        elif self.enabled:
            log.info("%s", snapshot.line())

    def close(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.stop()
        stderr, self._stderr = self._stderr, None
        if stderr is not None:
            stderr.restore()


def panel(snapshot: Snapshot) -> Group:
    table = Table(box=None, padding=(0, 2), show_edge=False)
    for column in ("consumer", "device compute", "input wait", "host", "averaging"):
        table.add_column(column, justify="right")
    host = snapshot.host or (0.0,) * len(snapshot.consumers)
    for rank, ((compute, wait, averaging), idle_for_host) in enumerate(zip(snapshot.consumers, host)):
        table.add_row(str(rank), f"{compute:.0%}", f"{wait:.0%}", f"{idle_for_host:.0%}", f"{averaging:.0%}")
    loss = f"{snapshot.loss:.3f}" if snapshot.loss is not None else "-"
    accuracy = f"{snapshot.val_accuracy:.1%}" if snapshot.val_accuracy is not None else "-"
    summary = (f"{snapshot.samples_per_s:,.0f} samples/s   loss {loss}   val acc {accuracy}   ready queue "
               f"{snapshot.queue_fill:.0%}   producers {snapshot.producers} (up to {snapshot.producer_budget}) busy "
               f"{snapshot.producer_utilization:.0%}")
    return Group(table, summary, f"[bold]{snapshot.verdict}")

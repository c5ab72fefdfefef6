"""What SIGINT and SIGTERM mean at each moment of a run, in one place.

A run goes through three phases, and a signal means something different in each:

- training: the first signal asks for a clean stop (finish the step, checkpoint, summary "interrupted"); a second
  one raises `Interrupted` to stop now (the last committed checkpoint stands).
- closing (children are stopped and joined, the summary is written): nothing may escape any more, or the summary
  and the cleanup would be lost; a signal here kills every child at once, and shutdown goes on.
- reporting (training is over and saved): a signal skips the report and nothing else; the run stays "completed".

Before a run starts, and around the one-shot commands (bench, pack, eval, predict), SIGTERM is Ctrl-C
(`startup_signals`): the command's own cleanup runs, where SIGTERM's default killed it and left what it made.

Children never see these signals (`procs.start` blocks them before the fork): a SIGTERM to the whole process group,
as Slurm, docker stop and systemd send it, or a Ctrl-C during a child's start-up, reaches the controller alone.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from stoker.common import faults
from stoker.common.procs import kill_children

log = logging.getLogger(__name__)

Phase = Literal["training", "closing", "reporting"]
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """A second signal while training: stop now."""


class StartupInterrupted(KeyboardInterrupt):
    """SIGTERM (or Ctrl-C) before the run started: nothing was started, so nothing needs stopping."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


@contextmanager
def startup_signals(keep_ignored: bool = False) -> Iterator[None]:
    """Around what comes before the run (settings, indexing the data, checks), and around a one-shot command
    (bench, pack, eval, predict): SIGTERM ends it as Ctrl-C does, through its own cleanup (a pack's hidden folder, a
    benchmark's scratch folder), with a message, instead of killing the command silently (exit 143) and leaving
    them. `keep_ignored`: a signal the process was started ignoring stays ignored, as Python leaves it (a script's
    background job ignores Ctrl-C: the one-shot commands did before SIGTERM was handled, and do)."""
    previous = _install(_on_startup_signal, keep_ignored)
    try:
        yield
    finally:
        _restore(previous)


def _on_startup_signal(signum: int, _frame: Any) -> None:
    raise StartupInterrupted("Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name)


class ReportInterrupted(BaseException):
    """A signal while the report is drawn. A BaseException, as KeyboardInterrupt is: it is not the report's
    failure, and drawing code that catches `Exception` must let it through."""


class Lifecycle:
    """`with lifecycle.handling_signals():` around the whole run; `closing()` and `reporting()` mark its phases."""

    def __init__(self) -> None:
        self.phase: Phase = "training"
        self.interrupted = False  # a signal arrived while training: stop cleanly
        self.forced = False  # a signal arrived while closing: children were killed

    @contextmanager
    def handling_signals(self) -> Iterator[None]:
        previous = _install(self._on_signal)
        try:
            yield
        finally:
            _restore(previous)

    def closing(self) -> None:
        """From here on nothing raises: the summary is always written and every child is stopped."""
        self.phase = "closing"
        faults.maybe_inject("controller", "closing")

    def stop_now(self) -> None:
        """Kill every child now (a second signal): joins that follow return at once."""
        self.forced = True
        kill_children()

    @contextmanager
    def reporting(self) -> Iterator[None]:
        self.phase = "reporting"
        try:
            yield
        except ReportInterrupted:
            log.warning("interrupted while drawing the report: report skipped (the run completed and is saved; "
                        "draw it later with `stoker report RUN_DIR`)")
        finally:
            self.phase = "closing"

    def _on_signal(self, signum: int, _frame: Any) -> None:
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if self.phase == "reporting":
            raise ReportInterrupted
        if self.phase == "closing":
            if not self.forced:
                log.warning("%s while shutting down: stopping every process now", name)
                self.stop_now()
            return
        if self.interrupted:
            raise Interrupted  # a second signal: stop now, the last committed checkpoint stands
        log.warning("%s: stopping after the steps already prepared, with a checkpoint (%s again to stop now)",
                    name, name)
        self.interrupted = True


def _install(handler: Callable[[int, Any], None], keep_ignored: bool = False) -> dict[int, Any]:
    previous: dict[int, Any] = {}
    for signum in SIGNALS:
        if keep_ignored and signal.getsignal(signum) is signal.SIG_IGN:
            continue
        try:
            previous[signum] = signal.signal(signum, handler)
        except ValueError:  # not the main thread: the caller handles signals
            pass
    return previous


def _restore(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)

"""What reaches the terminal while a live display (the run's panel, a progress bar) is drawn on it: every line
written to stderr, by this process or by its children, is printed above the display instead of through it."""

from __future__ import annotations

import os
import sys
import threading
from multiprocessing import resource_tracker

from rich.console import Console
from rich.text import Text


class StderrAbove:
    """While a live display is drawn, file descriptor 2 is a pipe, and each line that comes through it is printed
    above the display: this process's log lines, and the warnings and tracebacks of producers and consumers, which
    inherit descriptor 2 when they start. Written straight to the terminal, each would push the display up and
    leave a stale copy of it behind. Make it before starting children; `restore()` gives this process the terminal
    back, and lines from children still running then are printed as they come. While it holds descriptor 2,
    `sys.stderr.isatty()` is false, so a second live display is not drawn over the first."""

    def __init__(self) -> None:
        # The resource tracker outlives any display and warns when this process exits: it keeps the real stderr.
        resource_tracker.ensure_running()
        sys.stderr.flush()
        self.terminal = os.fdopen(os.dup(2), "w", buffering=1, encoding=sys.stderr.encoding, errors="replace")
        self.console = Console(file=self.terminal)
        self._saved: int | None = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        threading.Thread(target=self._forward, args=(read,), name="stoker stderr", daemon=True).start()

    def _forward(self, read: int) -> None:
        with os.fdopen(read, "rb") as pipe:
            for line in pipe:  # until every process holding the pipe has closed it (after `restore`)
                self.console.print(Text.from_ansi(line.decode(errors="replace").rstrip("\n")))
        self.terminal.close()

    def restore(self) -> None:
        """Idempotent."""
        saved, self._saved = self._saved, None
        if saved is not None:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)

"""What reaches the terminal while a live display (the run's panel, a progress bar) is drawn on it: every line
written to stderr, by this process or by its children, is printed above the display instead of through it."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading

from rich.console import Console
from rich.text import Text

from stoker.common.procs import start_resource_tracker


class StderrAbove:
    """While a live display is drawn, file descriptor 2 is a pipe, and each line that comes through it is printed
    above the display: this process's log lines, and the warnings and tracebacks of producers and consumers, which
    inherit descriptor 2 when they start. Written straight to the terminal, each would push the display up and
    leave a stale copy of it behind. Make it before starting children; `restore()` gives this process the terminal
    back, and lines from children still running then are printed as they come. While it holds descriptor 2,
    `sys.stderr.isatty()` is false, so a second live display is not drawn over the first."""

    def __init__(self) -> None:
        # The resource tracker outlives any display and warns when this process exits: it keeps the real stderr.
        start_resource_tracker()
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


# C0 controls (newline, escape, carriage return...), DEL, C1 controls (0x9b is a one-byte CSI), and the lone
# surrogates that stand for a file name's undecodable bytes: a name holding them would clear the screen, forge a log
# line or fail to print.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def printable(text: str) -> str:
    """`text` with every control character escaped as Python writes it (`\\x1b`, `\\n`); an undecodable byte of a
    file name as `\\xNN`. For what reaches a terminal or a log; the JSON files keep the real names."""
    return _UNPRINTABLE.sub(_escape, text)


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:  # os.fsdecode's stand-in for the byte code - 0xDC00
        return f"\\x{code - 0xDC00:02x}"
    return repr(match.group())[1:-1]


class EscapedArguments(logging.Filter):
    """Log records' arguments (file names, shard keys, paths) printable: a handler's filter, so that every
    `log.warning("refused %s: %s", path, reason)` is safe wherever it is written."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(printable(os.fspath(a)) if isinstance(a, str | os.PathLike) else a
                                for a in record.args)
        return True

"""A command (the real CLI) in a pseudo-terminal, its output read through a terminal emulator (pyte): what a person
would see, scrollback included. The child gets the pty as its controlling terminal, so writing Ctrl-C to it signals the
whole foreground process group, as a keyboard does."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import pyte

CTRL_C = b"\x03"


@dataclass
class Terminal:
    returncode: int
    lines: list[str]  # scrollback then the screen, trailing blanks removed
    raw: bytes

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _take_terminal() -> None:
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


OnOutput = Callable[[list[str], Callable[[bytes], None]], None]


def run_in_terminal(command: list[str], env: dict[str, str], columns: int = 140, rows: int = 40,
                    timeout_s: float = 180, on_output: OnOutput | None = None) -> Terminal:
    """Run `command` on a `columns` x `rows` terminal until it exits. `on_output(screen, type)` is called after
    every read with the lines on the screen now and may type keys. Without pyte the test is skipped: it is imported
    here, not with the module, so that collecting the tests (`pytest -m gpu` on a GPU image) never needs it."""
    pyte = pytest.importorskip("pyte")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    environment = {**env, "TERM": "xterm-256color", "COLUMNS": str(columns), "LINES": str(rows)}
    environment.pop("NO_COLOR", None)
    process = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave,
                               env=environment, preexec_fn=_take_terminal, close_fds=True)
    os.close(slave)
    screen = pyte.HistoryScreen(columns, rows, history=10_000)
    stream = pyte.ByteStream(screen)
    raw = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if not ready:
                if process.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every process holding the terminal has closed it
                break
            if not chunk:
                break
            raw += chunk
            stream.feed(chunk)
            if on_output is not None:
                on_output([line.rstrip() for line in screen.display], lambda keys: os.write(master, keys))
        returncode = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(master)
    return Terminal(returncode, _lines(screen), bytes(raw))


def _lines(screen: pyte.HistoryScreen) -> list[str]:
    history = ["".join(line[x].data for x in range(screen.columns)).rstrip() for line in screen.history.top]
    lines = history + [line.rstrip() for line in screen.display]
    while lines and not lines[-1]:
        lines.pop()
    return lines

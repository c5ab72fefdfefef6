"""What every stoker process shares: its title, the parent-death check, errors carried as values, shutdown."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, cast

import setproctitle

from stoker.common.memory import available_memory

log = logging.getLogger(__name__)

# spawn, not fork: children start clean (no copied torch threads or locks) on every platform.
CONTEXT = mp.get_context("spawn")
POLL_S = 0.2
# Producers one run may have alive: each is a process (about 30 MB of its own, 60 MB resident), and a count past
# this is a slip of the keyboard, not a machine (100000 once forked until the kernel's OOM killer stepped in).
MAX_PRODUCERS = 512
PRODUCER_MEMORY = 64 * 2**20  # resident, measured: 59-66 MB a producer of the built-in set
_PR_SET_PDEATHSIG = 1
CHILD_IGNORES = {signal.SIGINT, signal.SIGTERM}


def name_process(title: str) -> None:
    """`ps` and `top` show who is who: 'stoker controller', 'stoker producer 3', 'stoker consumer 1'."""
    setproctitle.setproctitle(title)


def stoker_processes() -> list[tuple[int, str]]:
    """(pid, title) of every live stoker process on this machine, found by the titles `name_process` sets."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                title = handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if title.startswith(("stoker producer", "stoker consumer", "stoker controller")):
            found.append((int(entry), title))
    return found


def started_by() -> int:
    """The pid of the process that started us, as multiprocessing recorded it at the spawn. `os.getppid()` asked
    later would already name the reaper if the parent died while we were still importing."""
    parent = mp.parent_process()
    return parent.pid if parent is not None and parent.pid is not None else os.getppid()


def check_memory_for_producers(count: int, setting: str = "producers") -> None:
    """Before any process starts: `count` producers at once must fit the memory this process can still use (the
    machine's, or its container's where that is less: `common/memory.py`)."""
    available = available_memory()
    if available is None:  # not Linux: nothing to check against
        return
    if count * PRODUCER_MEMORY > available:
        raise ValueError(f"{setting}={count}: {count} producer processes need about "
                         f"{count * PRODUCER_MEMORY / 2**30:.1f} GiB (64 MiB each) and {available / 2**30:.1f} GiB "
                         f"is available (this machine's, or its container's limit where lower); expected at most "
                         f"{available // PRODUCER_MEMORY}")


def exit_with_parent() -> None:
    """Ask the kernel for SIGKILL when the controller dies, on Linux; `ParentWatch` covers the rest. SIGKILL, not
    SIGTERM: children never take SIGTERM (see `start`), and a killed controller leaves nothing for them to finish.
    A parent already gone by now will never send it, so we leave at once."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != started_by():
        os._exit(1)


class ParentWatch:
    """True once the process that started us is gone (the parent pid changes when we are re-parented)."""

    def __init__(self) -> None:
        self._parent = started_by()

    def parent_gone(self) -> bool:
        return os.getppid() != self._parent


@dataclass(frozen=True)
class ChildError:
    """An exception carried as a value from a child to the controller, with where it happened."""

    role: str
    pid: int
    where: str
    error: str
    trace: str

    @classmethod
    def capture(cls, role: str, where: str, error: BaseException) -> ChildError:
        return cls(role, os.getpid(), where, f"{type(error).__name__}: {error}", traceback.format_exc())

    def __str__(self) -> str:
        return f"{self.role} (pid {self.pid}) failed while {self.where}: {self.error}"


class StokerRunError(RuntimeError):
    """The run could not finish; the message says which process, what it was doing and why."""


class Mailbox:
    """The controller's ends of one pipe per child. multiprocessing.Queue's writers share one lock, so a child
    SIGKILLed while sending would leave it held and every other child stuck; here a child killed mid-message can
    only break its own pipe, which then reads as closed."""

    def __init__(self) -> None:
        self._ends: list[Connection] = []

    def open(self) -> Connection:
        """A new pipe; returns the child's end, which the caller hands to the child and then closes."""
        mine, theirs = CONTEXT.Pipe(duplex=False)
        self._ends.append(mine)
        return theirs

    def receive(self, timeout_s: float) -> list[Any]:
        """Whatever arrived within the timeout (one message per pipe that has one, in no particular order)."""
        messages = []
        # wait returns some of the objects it was given: here, only our Connections
        for end in cast(list[Connection], wait(self._ends, timeout_s)):
            try:
                messages.append(end.recv())
            except (EOFError, OSError):  # the child exited or died, maybe mid-message: its process check says why
                self._ends.remove(end)
                end.close()
        return messages

    def close(self) -> None:
        ends, self._ends = self._ends, []
        for end in ends:
            end.close()


def start(target, args: tuple, title: str) -> BaseProcess:
    """Start a child that never sees SIGINT or SIGTERM: Ctrl-C and a scheduler's SIGTERM reach the whole process
    group, and only the controller decides what they mean (checkpoint, then stop every child itself)."""
    process = CONTEXT.Process(target=target, args=args, name=title, daemon=True)
    with signals_blocked_for_children(CHILD_IGNORES):
        process.start()
    return process


@contextlib.contextmanager
def signals_blocked_for_children(signals: set[signal.Signals]) -> Iterator[None]:
    """Children started inside are born with `signals` blocked, from before the fork, so even one still importing
    torch is safe; the mask survives exec and the child keeps it. This process's own signals wait, not lost, until
    the block ends. multiprocessing starts its resource tracker at the first child's start and then unblocks SIGINT
    and SIGTERM in this thread whatever the mask was (resource_tracker.ensure_running): it runs first here, or that
    first child and every later one of the block were born with nothing blocked (a pack's Ctrl-C printed a
    worker's traceback)."""
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def stop_processes(processes: list[BaseProcess], timeout_s: float) -> None:
    """Join with a shared deadline, then kill (children do not take SIGTERM): no child outlives this call."""
    deadline = time.monotonic() + timeout_s  # not timeout_s / n each: 16 producers got 0.3 s, one still importing
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            log.warning("%s (pid %s) did not stop in time; killing it", process.name, process.pid)
            process.kill()
            process.join(timeout=2.0)


def kill_children() -> None:
    """Every child still alive, at once: a second signal during shutdown means stop now. Checkpoints are atomic,
    so a consumer killed while writing one leaves the previous one standing."""
    for process in CONTEXT.active_children():
        process.kill()


def describe_exit(process: BaseProcess) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"

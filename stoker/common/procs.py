"""What every stoker process shares: its title, the parent-death check, errors carried as values, shutdown."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
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


# The command line's log lines: the time, the level, the message; children forked from a zygote log the same way.
LOG_FORMAT, LOG_DATEFMT = "%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"


def log_as_the_controller() -> None:
    """A child forked from a zygote (a fresh interpreter, not the controller's copy) has no logging set up: its
    warnings reached the terminal bare, without the time every other line carries."""
    if not logging.root.handlers:
        logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT, datefmt=LOG_DATEFMT)


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
        if title.startswith(("stoker producer", "stoker consumer", "stoker controller", "stoker zygote")):
            found.append((int(entry), title))
    return found


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the process's name (its state, then its parent's pid, ...: proc(5) from
    field 3); None once it is gone. The name is passed by its last ')': it may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def parent_of(pid: int | str) -> int | None:
    """The pid of the process's parent; None once it is gone."""
    fields = stat_fields(pid)
    try:
        return int(fields[1]) if fields is not None else None
    except (IndexError, ValueError):
        return None


def descendants(root: int) -> list[int]:
    """The live processes below `root` (children, theirs, ...), from each process's parent in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (parent := parent_of(entry)) is not None:
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
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
    """Ask the kernel for SIGKILL when our parent dies, on Linux; `ParentWatch` covers the rest. SIGKILL, not
    SIGTERM: children never take SIGTERM (see `start`), and a killed controller leaves nothing for them to finish.
    The parent is the controller, or for a forked child the zygote, which the kernel kills at the controller's death.
    A controller already gone by now will never be the cause of a signal, so we leave at once."""
    _ask_for_kill_at_parent_death()
    if ParentWatch().parent_gone():
        os._exit(1)


def exit_with_parent_pid(parent: int) -> None:
    """`exit_with_parent` for a process multiprocessing did not start (the zygote): `parent` is who started it."""
    _ask_for_kill_at_parent_death()
    if os.getppid() != parent:
        os._exit(1)


def _ask_for_kill_at_parent_death() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class ParentWatch:
    """True once the process that started us is gone: its end of the pipe multiprocessing gave us is closed (the
    controller's, also for a child forked by a zygote), or we were re-parented (the parent pid changed)."""

    def __init__(self) -> None:
        self._parent = started_by()
        self._forked_by = os.getppid()  # the zygote, for a forked child; else the same as `_parent`
        parent = mp.parent_process()
        self._sentinel = parent.sentinel if parent is not None else None

    def parent_gone(self) -> bool:
        if os.getppid() not in (self._parent, self._forked_by):
            return True
        return self._sentinel is not None and bool(wait([self._sentinel], 0))


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


def start(target, args: tuple, title: str, context: Any = CONTEXT) -> BaseProcess:
    """Start a child that never sees SIGINT or SIGTERM: Ctrl-C and a scheduler's SIGTERM reach the whole process
    group, and only the controller decides what they mean (checkpoint, then stop every child itself)."""
    process = context.Process(target=target, args=args, name=title, daemon=True)
    with signals_blocked_for_children(CHILD_IGNORES), main_script_hidden_when_unreadable():
        process.start()
    return process


def main_script_unreadable() -> bool:
    """The main module names a file that is not there (`python - <<EOF`: '<stdin>'), so a spawned child, which
    runs the main script again before its own work, would die of FileNotFoundError."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    return spec_name is None and path is not None and not os.path.isfile(path)


@contextlib.contextmanager
def main_script_hidden_when_unreadable() -> Iterator[None]:
    """While a child starts, a main module without a readable file looks like `python -c`'s (no `__file__`), which
    spawn starts without re-running it: stoker's children need nothing of the script."""
    main = sys.modules.get("__main__")
    if main is None or not main_script_unreadable():
        yield
        return
    path = main.__file__
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


@contextlib.contextmanager
def signals_blocked_for_children(signals: set[signal.Signals]) -> Iterator[None]:
    """Children started inside are born with `signals` blocked, from before the fork, so even one still
    importing torch is safe; the mask survives exec and the child keeps it. Only this thread's mask changes: a
    signal to this process may still reach another thread, whose Python handler then runs in the main thread.
    multiprocessing starts its resource tracker at the first child's start and then unblocks SIGINT and SIGTERM
    in this thread whatever the mask was (resource_tracker.ensure_running): it runs first here, or that first
    child and every later one of the block were born with nothing blocked (a pack's Ctrl-C printed a worker's
    traceback)."""
    start_resource_tracker()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def signals_deferred(signals: set[signal.Signals]) -> Iterator[None]:
    """`signals` recorded meanwhile and delivered again at the end, for steps no signal may split (a pack's two
    renames). Python runs signal handlers in the main thread whichever thread the kernel picks, so the handlers are
    swapped, not the thread's mask; off the main thread the caller owns the signals and nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {signum: signal.signal(signum, lambda number, _frame: arrived.append(number)) for signum in signals}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        for number in dict.fromkeys(arrived):
            signal.raise_signal(number)


# The tracker's own warnings all begin so: "resource_tracker: There appear to be 1 leaked shared_memory objects to
# clean up at shutdown" is what a SIGKILLed Loader's user read on the terminal, for a segment the tracker then
# removed as it should (`-W` fields are split at colons, so the message is matched by this prefix).
_TRACKER_QUIET = "ignore:resource_tracker:UserWarning"


def start_resource_tracker() -> None:
    """multiprocessing's resource tracker, started (when not yet running) with its clean-up warnings off: it still
    unlinks what a killed process leaves, the one thing a SIGKILL lets no code of ours do. Its command line takes
    this interpreter's `-W` options, read once as it starts."""
    sys.warnoptions.append(_TRACKER_QUIET)
    try:
        resource_tracker.ensure_running()
    finally:
        sys.warnoptions.remove(_TRACKER_QUIET)


def executor_processes(pool: Any) -> list[BaseProcess]:
    """A ProcessPoolExecutor's worker processes, for stopping them when its work is abandoned: the executor has no
    public way to reach them, and its shutdown waits for the work they hold."""
    return list((getattr(pool, "_processes", None) or {}).values())


def stop_processes(processes: list[BaseProcess], timeout_s: float, kill_loses_nothing: bool = False) -> None:
    """Join with a shared deadline, then kill (children do not take SIGTERM): no child outlives this call.
    `kill_loses_nothing`: processes whose work is rebuilt from the plan (producers), whose kill is no news to a
    user closing a Loader: logged at INFO, not as a warning."""
    deadline = time.monotonic() + timeout_s  # not timeout_s / n each: 16 producers got 0.3 s, one still importing
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            log.log(logging.INFO if kill_loses_nothing else logging.WARNING, "%s (pid %s) did not stop in %.0f s; "
                    "killing it", process.name, process.pid, timeout_s)
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

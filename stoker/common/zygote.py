"""The zygote: the process every producer is forked from, so that a new producer costs a fork, not an interpreter.

A spawned producer is a new interpreter that imports numpy, OpenCV, simplejpeg and Pillow (and runs the main
script again) before its first part: a quarter of a second of a core, seconds when the autoscaler starts a dozen
on two cores. The zygote is a forkserver of stoker's own (multiprocessing's `ForkServer`, a private instance: a
user's forkserver, a DataLoader's for example, is never touched) with this module and the producer's preloaded: it
pays those imports once, at the first producer's start, and forks each producer from there in milliseconds.

What spawn gave a producer still holds. The zygote is a fresh interpreter (no copied threads or locks); it imports
the main script as a spawned child would (its command line, path and folder too), so CUDA is no more initialized
there than in a spawned producer: a guarded script's import starts nothing. It is started with SIGINT and SIGTERM
blocked, so every producer is born with them blocked, and shares the controller's resource tracker. The
parent-death chain: the zygote asks the kernel for SIGKILL at its parent's death, each producer for SIGKILL at the
zygote's, and a producer also watches the controller itself (`procs.ParentWatch`). The kernel's signal follows the
thread that forked, not the process, so the zygote is started from a thread of its own that lives as long as the
process (a Loader first iterated in a short-lived thread would otherwise lose its zygote, and every producer, with
that thread).

One zygote per process, kept while any engine of the process has producers (a Loader for training and one for
validation share it), restarted if it dies, and killed when the last one closes: it holds nothing a kill can lose.
"""

from __future__ import annotations

import io
import json
import os
import queue
import signal
import threading
from multiprocessing import context, forkserver, popen_forkserver, reduction, spawn, util
from multiprocessing import process as mp_process
from typing import Any, cast

from stoker.common.procs import (
    CHILD_IGNORES,
    exit_with_parent_pid,
    main_script_hidden_when_unreadable,
    name_process,
    signals_blocked_for_children,
)

# The controller's pid and how to import its main module, set only in the environment the zygote is started with:
# importing this module makes a process the zygote only there (a test or a type checker importing it is left alone).
_ZYGOTE_OF = "STOKER_ZYGOTE_OF"
_MAIN = "STOKER_ZYGOTE_MAIN"
# What a spawned child is given to import the main module as `__mp_main__` (Python 3.11's forkserver never
# preloads it: it looks for a key its own preparation data does not have, and applies no sys.path or folder).
_MAIN_KEYS = ("sys_argv", "sys_path", "dir", "orig_dir", "init_main_from_name", "init_main_from_path")
PRELOAD = [__name__, "stoker.pipeline.producer"]

_server: Any = forkserver.ForkServer()
_server.set_forkserver_preload(PRELOAD)
_lock = threading.Lock()
_users = 0
_requests: queue.Queue[queue.Queue[BaseException | None]] = queue.Queue()
_keeper: threading.Thread | None = None


class _Popen(popen_forkserver.Popen):
    """multiprocessing's forkserver Popen, asking stoker's zygote for the fork instead of the process-wide server
    (`_launch` as in the standard library, with `_server` for the module's)."""

    def _launch(self, process_obj: Any) -> None:
        _ensure_running()
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)
        self.sentinel, w = _server.connect_to_new_process(cast(Any, self)._fds)
        _parent_w = os.dup(w)  # the child's sentinel of its parent, as multiprocessing keeps it
        self.finalizer = util.Finalize(self, cast(Any, util).close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _ZygoteProcess(context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:
        return _Popen(process_obj)


class _ZygoteContext(context.ForkServerContext):
    Process = _ZygoteProcess


CONTEXT = _ZygoteContext()  # the producers' processes and queues


def acquire() -> None:
    """An engine of this process will start producers: the zygote is started (or its count of users raised)."""
    global _users
    with _lock:
        _ensure_running()
        _users += 1


def release() -> None:
    """An engine's producers are all stopped: the last one kills the zygote."""
    global _users
    with _lock:
        _users = max(0, _users - 1)
        if _users == 0:
            _stop()


def zygote_pid() -> int | None:
    """The running zygote's pid, None when none runs."""
    return _server._forkserver_pid


def main_script() -> str | None:
    """The script the zygote imports as it starts, as spawn names it."""
    return spawn.get_preparation_data("zygote").get("init_main_from_path")


def _ensure_running() -> None:
    """Started, or started again if it died, by the keeper thread; a failure to start is raised here."""
    global _keeper
    if _keeper is None:
        _keeper = threading.Thread(target=_keep, name="stoker zygote keeper", daemon=True)
        _keeper.start()
    answer: queue.Queue[BaseException | None] = queue.Queue(1)
    _requests.put(answer)
    error = answer.get()
    if error is not None:
        raise error


def _keep() -> None:
    while True:
        answer = _requests.get()
        try:
            _start_if_not_running()
            answer.put(None)
        except BaseException as error:  # handed to the caller, whose thread raises it
            answer.put(error)


def _start_if_not_running() -> None:
    """multiprocessing's `ensure_running` (which also restarts a dead server), with what only the zygote reads."""
    with signals_blocked_for_children(CHILD_IGNORES), main_script_hidden_when_unreadable():
        main = {key: value for key, value in spawn.get_preparation_data("zygote").items() if key in _MAIN_KEYS}
        os.environ[_ZYGOTE_OF] = str(os.getpid())
        os.environ[_MAIN] = json.dumps(main)
        try:
            _server.ensure_running()
        finally:
            os.environ.pop(_ZYGOTE_OF, None)
            os.environ.pop(_MAIN, None)


def _stop() -> None:
    """Killed, then reaped by multiprocessing's own stop (which closes its end of the server's pipes): a graceful
    stop would wait for every child forked from it to let go of the server."""
    pid = _server._forkserver_pid
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _server._stop()


def _become_zygote(controller: int, main: dict[str, Any]) -> None:
    """Named, tied to the controller's life, then the main module imported as a spawned child imports it (as
    `__mp_main__`, under the `__main__` guard); the producers forked from here find it imported and skip it."""
    name_process("stoker zygote")
    exit_with_parent_pid(controller)
    current = mp_process.current_process()
    current._inheriting = True  # type: ignore[attr-defined]  # what spawn sets: a script's unguarded start raises
    try:
        spawn.prepare(main)
    finally:
        del current._inheriting  # type: ignore[attr-defined]


if os.environ.get(_ZYGOTE_OF, "").isdigit():
    _become_zygote(int(os.environ.pop(_ZYGOTE_OF)), json.loads(os.environ.pop(_MAIN, "{}")))

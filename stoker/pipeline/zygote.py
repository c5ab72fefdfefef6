"""The zygote: the process every producer is forked from, so that a new producer costs a fork, not an interpreter.

A spawned producer is a new interpreter that imports numpy, OpenCV, simplejpeg and Pillow (and runs the main
script again) before its first part: half a second of a core, several seconds when the autoscaler starts a dozen
on two cores. The zygote is multiprocessing's forkserver with this module preloaded: it pays those imports once,
at the first producer's start, and forks each producer from there, in milliseconds. Everything spawn gave a
producer still holds: the zygote is a fresh interpreter (no copied threads or locks, CUDA never initialized: no
preloaded module imports torch), started with SIGINT and SIGTERM blocked so every producer is born with them
blocked, sharing the controller's resource tracker. The parent-death chain: the zygote asks the kernel for
SIGKILL at its parent's death, and each producer for SIGKILL at the zygote's; a producer also watches the
controller itself (`procs.ParentWatch`).

One zygote per process, kept while any engine of the process has producers (a Loader for training and one for
validation share it), and killed when the last one closes: it holds nothing a kill can lose.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from multiprocessing import forkserver, spawn
from multiprocessing import process as mp_process
from typing import Any, cast

from stoker.common.procs import (
    CHILD_IGNORES,
    PRODUCER_CONTEXT,
    exit_with_parent_pid,
    main_script_hidden_when_unreadable,
    name_process,
    signals_blocked_for_children,
)

log = logging.getLogger(__name__)

# The controller's pid and its main module, set only in the environment the zygote is started with: importing this
# module makes a process the zygote only there (a test or a type checker importing it is left alone).
_ZYGOTE_OF = "STOKER_ZYGOTE_OF"
_MAIN = "STOKER_ZYGOTE_MAIN"
# The forkserver imports these before its first fork: this module (which imports the main script, as spawn would
# in every producer: a user's dataset class may live there), then everything a producer imports. Not '__main__':
# Python 3.11's forkserver looks for a key its own preparation data does not have, and never preloads it; every
# producer then ran the main script again (the `stoker` command's: a tenth of a second).
PRELOAD = [__name__, "stoker.pipeline.producer"]

_lock = threading.Lock()
_users = 0


def acquire() -> None:
    """An engine of this process will start producers: the zygote is started (or its count of users raised)."""
    global _users
    with _lock:
        _users += 1
        if _users == 1:
            _start()


def release() -> None:
    """An engine's producers are all stopped: the last one kills the zygote."""
    global _users
    with _lock:
        _users = max(0, _users - 1)
        if _users == 0:
            _stop()


def _start() -> None:
    PRODUCER_CONTEXT.set_forkserver_preload(PRELOAD)
    try:
        with signals_blocked_for_children(CHILD_IGNORES), main_script_hidden_when_unreadable():
            os.environ[_ZYGOTE_OF] = str(os.getpid())
            os.environ[_MAIN] = json.dumps({key: value for key, value in spawn.get_preparation_data("zygote").items()
                                            if key in ("init_main_from_name", "init_main_from_path")})
            forkserver.ensure_running()
    finally:
        os.environ.pop(_ZYGOTE_OF, None)
        os.environ.pop(_MAIN, None)


def _stop() -> None:
    """Killed, then reaped by multiprocessing's own stop (which closes its end of the server's pipes): a graceful
    stop waits for every forked child to let go of the server, and a user's forkserver children may never."""
    server = _server()
    pid = server._forkserver_pid
    if pid is None:
        return
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
    server._stop()


def main_script() -> str | None:
    """The script the zygote imports as it starts, as spawn names it."""
    return spawn.get_preparation_data("zygote").get("init_main_from_path")


def zygote_pid() -> int | None:
    """The running zygote's pid (tests, `bench soak`)."""
    return _server()._forkserver_pid


def _server() -> Any:
    """The process-wide forkserver multiprocessing keeps: no public handle stops it or names its pid."""
    return cast(Any, forkserver)._forkserver


def _become_zygote(controller: int, main: dict[str, str]) -> None:
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

"""The zygotes: the processes producers and CPU consumers are forked from, so that a new one costs a fork (tens of
milliseconds), not an interpreter's imports (seconds on two cores when the autoscaler starts a dozen).

Each is a private forkserver of stoker's own (a user's, a DataLoader's, is never touched) with its children's modules
preloaded and the main script imported as a spawned child would; it is started with SIGINT and SIGTERM blocked, from
a thread that lives as long as the process (the kernel's parent-death signal follows the thread that forked). Why
consumers fork only on CPU devices under stoker's command line: docs/producers.md, "Zygotes"; the parent-death chain:
docs/faults.md."""

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
    stat_fields,
)

# The controller's pid, the zygote's title and how to import the controller's main module, set only in the
# environment a zygote is started with: importing this module makes a process a zygote only there (a test or a type
# checker importing it is left alone).
_ZYGOTE_OF = "STOKER_ZYGOTE_OF"
_TITLE = "STOKER_ZYGOTE_TITLE"
_MAIN = "STOKER_ZYGOTE_MAIN"
# What a spawned child is given to import the main module as `__mp_main__` (Python 3.11's forkserver never
# preloads it: it looks for a key its own preparation data does not have, and applies no sys.path or folder).
_MAIN_KEYS = ("sys_argv", "sys_path", "dir", "orig_dir", "init_main_from_name", "init_main_from_path")
# The variables above are the process's: two zygotes starting at once must not read each other's.
_environment = threading.Lock()
# Whether this process's main module is stoker's own command line, which starts nothing and touches neither CUDA
# nor torch's threads as it is imported: consumers are forked only then (`CONSUMERS`).
_main_is_stokers = False


class Lease:
    """One user's hold on a zygote (`Zygote.acquire`); `release` (idempotent) gives it back. `Lease()` holds
    nothing: a user that has not taken one yet."""

    def __init__(self, zygote: Zygote | None = None) -> None:
        self._zygote = zygote
        self._taking = threading.Lock()  # two threads releasing one lease give back one user

    @property
    def held(self) -> bool:
        return self._zygote is not None

    def release(self) -> None:
        with self._taking:
            zygote, self._zygote = self._zygote, None
        if zygote is not None:
            zygote._release()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Zygote:
    """One forkserver of stoker's own with `modules` preloaded, titled `title`; started at the first `acquire`,
    killed at the last `release`, started again if it died; `context` starts processes forked from it."""

    def __init__(self, title: str, role: str, modules: list[str], process_class: type) -> None:
        self.title = title
        self.role = role  # who is forked from it, as errors name them: "producers"
        self.preload = [__name__, *modules]  # this module first: it makes the new process a zygote
        self._server = _Server(self)
        self._server.set_forkserver_preload(self.preload)
        self._lock = threading.Lock()
        self._users = 0
        self._requests: queue.Queue[queue.Queue[BaseException | None]] = queue.Queue()
        self._keeper: threading.Thread | None = None
        self.context = _context_with(process_class)

    def acquire(self) -> Lease:
        """A user of this process will start children from it: started (or its count of users raised). The user
        gives it back with the lease's `release`, once its children are all stopped."""
        with self._lock:
            self._ensure_running()
            self._users += 1
        return Lease(self)

    def _release(self) -> None:
        """The last user's release kills the zygote."""
        with self._lock:
            if self._users <= 0:
                raise RuntimeError(f"{self.title}: released more often than acquired")
            self._users -= 1
            if self._users == 0:
                self._stop()

    def pid(self) -> int | None:
        """The zygote's pid, None when none was started or it was stopped (one that died keeps its pid until it is
        started again: `alive` says)."""
        return self._server.pid()

    def alive(self) -> bool:
        """Whether the zygote runs, read from /proc: reaping it here would leave multiprocessing's own check of it
        asking for a child that is gone."""
        pid = self.pid()
        fields = stat_fields(pid) if pid is not None else None
        return bool(fields and fields[0] not in ("Z", "X"))

    def ended_before_forking(self, error: BaseException) -> str:
        """What a start that failed because the zygote ended says; the zygote's own traceback, above, says why."""
        return (f"the zygote, the process {self.role} are forked from, ended before forking one "
                f"({type(error).__name__}): importing the main script ({main_script() or 'none'}) or stoker's "
                f"{self.role[:-1]} modules failed in it, as its traceback above says")

    def popen(self, process_obj: Any) -> _Popen:
        return _Popen(process_obj, self._server)  # its connection starts the zygote if it is not running

    def _ensure_running(self) -> None:
        """Started, or started again if it died, by the keeper thread; a failure to start is raised here."""
        if self._keeper is None:
            self._keeper = threading.Thread(target=self._keep, name=f"{self.title} keeper", daemon=True)
            self._keeper.start()
        answer: queue.Queue[BaseException | None] = queue.Queue(1)
        self._requests.put(answer)
        error = answer.get()
        if error is not None:
            raise error

    def _keep(self) -> None:
        while True:
            answer = self._requests.get()
            try:
                self._start_if_not_running()
                answer.put(None)
            except BaseException as error:  # handed to the caller, whose thread raises it
                answer.put(error)

    def _start_if_not_running(self) -> None:
        """multiprocessing's `ensure_running` (which also restarts a dead server), with what only the zygote
        reads."""
        with _environment, signals_blocked_for_children(CHILD_IGNORES), main_script_hidden_when_unreadable():
            main = {key: value for key, value in spawn.get_preparation_data("zygote").items() if key in _MAIN_KEYS}
            os.environ[_ZYGOTE_OF] = str(os.getpid())
            os.environ[_TITLE] = self.title
            os.environ[_MAIN] = json.dumps(main)
            try:
                self._server.start_here()
            finally:
                for name in (_ZYGOTE_OF, _TITLE, _MAIN):
                    os.environ.pop(name, None)

    def _stop(self) -> None:
        """Killed, then reaped by multiprocessing's own stop (which closes its end of the server's pipes): a
        graceful stop would wait for every child forked from it to let go of the server."""
        pid = self._server.pid()
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._server.stop()


class _Server(forkserver.ForkServer):
    """multiprocessing's ForkServer whose every start goes through its zygote's keeper thread, with what only the
    zygote reads: the one `connect_to_new_process` makes on its own too, when the zygote died since it was last
    looked at (started from the caller's thread, it would be a plain forkserver: untitled, without the controller's
    death, without the main script)."""

    def __init__(self, zygote: Zygote) -> None:
        super().__init__()
        self._zygote = zygote

    def ensure_running(self) -> None:
        self._zygote._ensure_running()

    def start_here(self) -> None:
        """The standard start (which also starts a dead server again), in the keeper's thread."""
        forkserver.ForkServer.ensure_running(self)

    def pid(self) -> int | None:
        return cast(Any, self)._forkserver_pid  # the standard library's own record, not in its type stubs

    def stop(self) -> None:
        cast(Any, self)._stop()


class _Popen(popen_forkserver.Popen):
    """multiprocessing's forkserver Popen, asking one of stoker's zygotes for the fork instead of the process-wide
    server (`_launch` as in the standard library, with the zygote's server for the module's)."""

    def __init__(self, process_obj: Any, server: Any) -> None:
        self._zygote_server = server
        super().__init__(process_obj)

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)
        self.sentinel, w = self._zygote_server.connect_to_new_process(cast(Any, self)._fds)
        _parent_w = os.dup(w)  # the child's sentinel of its parent, as multiprocessing keeps it
        self.finalizer = util.Finalize(self, cast(Any, util).close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


def _context_with(process_class: type) -> Any:
    class _Context(context.ForkServerContext):
        Process = process_class

    return _Context()


# The Process classes are pickled by name into each fork: defined here, where a zygote finds them imported.
class _ProducerProcess(context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:
        return PRODUCERS.popen(process_obj)


class _ConsumerProcess(context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:
        return CONSUMERS.popen(process_obj)


# Producers: numpy, OpenCV, simplejpeg and Pillow, no torch. CPU consumers: torch and the training code.
PRODUCERS = Zygote("stoker zygote", "producers", ["stoker.pipeline.producer"], _ProducerProcess)
CONSUMERS = Zygote("stoker zygote (consumers)", "consumers", ["stoker.training.consumer"], _ConsumerProcess)


def main_is_stokers() -> None:
    """Called by stoker's command line run as a program: consumers may be forked under it. Under a user's script
    they are spawned: its top-level code runs in the zygote, and CUDA initialized or torch's OpenMP threads started
    there (`torch.cuda.is_available()`, one matrix product) would leave no fork able to use them."""
    global _main_is_stokers
    _main_is_stokers = True


def consumers_may_fork(devices: list[str]) -> bool:
    """Whether the consumers on `devices` are forked from `CONSUMERS`: CPU devices under stoker's command line."""
    return _main_is_stokers and all(device == "cpu" for device in devices)


def main_script() -> str | None:
    """The script a zygote imports as it starts, as spawn names it."""
    return spawn.get_preparation_data("zygote").get("init_main_from_path")


def _become_zygote(controller: int, title: str, main: dict[str, Any]) -> None:
    """Named, tied to the controller's life, then the main module imported as a spawned child imports it (as
    `__mp_main__`, under the `__main__` guard); the children forked from here find it imported and skip it."""
    name_process(title)
    exit_with_parent_pid(controller)
    current = mp_process.current_process()
    current._inheriting = True  # type: ignore[attr-defined]  # what spawn sets: a script's unguarded start raises
    try:
        spawn.prepare(main)
    finally:
        del current._inheriting  # type: ignore[attr-defined]


if os.environ.get(_ZYGOTE_OF, "").isdigit():
    _become_zygote(int(os.environ.pop(_ZYGOTE_OF)), os.environ.pop(_TITLE, "stoker zygote"),
                   json.loads(os.environ.pop(_MAIN, "{}")))

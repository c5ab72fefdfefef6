"""The producer processes: start, feed, watch, replace, retire.

Each producer has its own task queue with at most `MAX_IN_FLIGHT` tasks, so the pool always knows which tasks a
producer holds: when one dies or hangs, exactly those are re-issued. A producer killed from outside (SIGKILL,
SIGTERM) gets its work re-issued as it was; one that crashed (a segfault, an abort) or hung on a file gets the
file it was decoding skipped and listed, so the same file cannot take down its replacement.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field, replace

from stoker.procs import CONTEXT, Mailbox, StokerRunError, describe_exit, start, stop_processes
from stoker.producer import STATUS_IDLE, ProducerSetup, Task, TaskDone, producer_main
from stoker.ring import SlotRing

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 2  # one being built, one waiting: a producer never idles between tasks
# A crash loop (every new producer dies at once) ends the run; losses spread over a long run never do.
MAX_LOSSES_WITHOUT_PROGRESS = 8
_EXTERNAL_SIGNALS = (-signal.SIGKILL, -signal.SIGTERM, -signal.SIGINT)


@dataclass
class Handle:
    producer: int
    process: object
    tasks: object
    in_flight: dict[int, Task] = field(default_factory=dict)
    retiring: bool = False
    busy_s: float = 0.0


@dataclass(frozen=True)
class Loss:
    """A producer that died or hung, what it was doing, and the tasks to build again."""

    message: str
    reissue: list[Task]


class ProducerPool:
    def __init__(self, setup: ProducerSetup, ring: SlotRing, mailbox: Mailbox, stop, capacity: int,
                 hang_timeout_s: float) -> None:
        self.setup = setup
        self.ring = ring
        self.mailbox = mailbox
        self.stop = stop
        self.capacity = capacity  # status rows in the ring: the most producers alive at once
        self.hang_timeout_s = hang_timeout_s
        self.handles: dict[int, Handle] = {}
        self.losses_since_progress = 0
        self.max_alive = 0

    @property
    def active(self) -> list[Handle]:
        return [h for h in self.handles.values() if not h.retiring]

    def grow(self) -> int:
        producer = min(set(range(self.capacity)) - set(self.handles))
        self.ring.status[producer] = (STATUS_IDLE, 0, time.monotonic_ns())
        tasks = CONTEXT.Queue(MAX_IN_FLIGHT + 1)
        outbox = self.mailbox.open()
        process = start(producer_main, (producer, self.setup, tasks, outbox, self.stop),
                        f"stoker producer {producer}")
        outbox.close()  # the producer holds its end now; ours would keep the pipe from reading as closed
        self.handles[producer] = Handle(producer, process, tasks)
        self.max_alive = max(self.max_alive, len(self.active))
        return producer

    def shrink(self, newest: bool = False) -> bool:
        """Retire the least busy producer (or the newest: a fork that did not pay); it finishes what it holds,
        then exits. Nothing is lost."""
        if len(self.active) <= 1:
            return False
        handle = self.active[-1] if newest else min(self.active, key=lambda h: len(h.in_flight))
        handle.retiring = True
        handle.tasks.put(None)
        return True

    def can_take(self) -> bool:
        return any(len(h.in_flight) < MAX_IN_FLIGHT for h in self.active)

    def assign(self, task: Task) -> None:
        handle = min(self.active, key=lambda h: len(h.in_flight))
        handle.in_flight[task.task_id] = task
        handle.tasks.put(task)

    def finished(self, done: TaskDone) -> Task | None:
        handle = self.handles.get(done.producer)
        if handle is None:
            return None  # a producer declared dead managed to report: its task was already re-issued
        handle.busy_s += done.busy_s
        self.losses_since_progress = 0
        return handle.in_flight.pop(done.task_id, None)

    def check(self) -> list[Loss]:
        """Reap retired producers; report dead or hung ones with the tasks they held."""
        losses = []
        now = time.monotonic_ns()
        for handle in list(self.handles.values()):
            process = handle.process
            if not process.is_alive() and handle.retiring and not handle.in_flight:
                process.join()
                del self.handles[handle.producer]
            elif not process.is_alive():
                losses.append(self._lose(handle, describe_exit(process), process.exitcode in _EXTERNAL_SIGNALS))
            elif self._hung(handle, now):
                process.kill()
                process.join(timeout=5)
                losses.append(self._lose(handle, f"hung for over {self.hang_timeout_s:.0f} s", False))
        return losses

    def _hung(self, handle: Handle, now: int) -> bool:
        task_id, _, beat = self.ring.status[handle.producer]
        return task_id != STATUS_IDLE and (now - beat) / 1e9 > self.hang_timeout_s

    def _lose(self, handle: Handle, how: str, external: bool) -> Loss:
        del self.handles[handle.producer]
        handle.process.join(timeout=1.0)  # reap it now: a dead producer must not linger as a zombie
        handle.tasks.cancel_join_thread()
        self.losses_since_progress += 1
        task_id, position, _ = self.ring.status[handle.producer].tolist()
        current = handle.in_flight.get(task_id)
        where = "while idle"
        reissue = list(handle.in_flight.values())
        if current is not None:
            sample = int(current.work.sample_ids[position])
            path = (self.setup.train if current.work.kind == "train" else self.setup.val).paths[sample]
            where = f"while decoding {path}"
            if not external:
                reason = f"producer {handle.producer} (pid {handle.process.pid}) {how} on this file"
                reissue = [replace(t, skip={**t.skip, sample: reason}) if t is current else t for t in reissue]
        message = f"producer {handle.producer} (pid {handle.process.pid}) {how} {where}"
        if self.losses_since_progress > MAX_LOSSES_WITHOUT_PROGRESS:
            raise StokerRunError(f"{message}; {self.losses_since_progress} producers lost in a row without a "
                                 "batch finished in between, giving up")
        return Loss(message, reissue)

    def take_utilization(self, elapsed_s: float) -> float:
        """Busy share of the producers since the last call (which starts a new window)."""
        busy = sum(h.busy_s for h in self.handles.values())
        for handle in self.handles.values():
            handle.busy_s = 0.0
        return busy / (elapsed_s * len(self.handles)) if self.handles and elapsed_s > 0 else 0.0

    def close(self, timeout_s: float = 5.0) -> None:
        """Idempotent: tell every producer to stop, join, terminate stragglers, release the queues."""
        handles, self.handles = list(self.handles.values()), {}
        for handle in handles:
            handle.tasks.cancel_join_thread()
        stop_processes([h.process for h in handles], timeout_s)
        for handle in handles:
            handle.tasks.close()

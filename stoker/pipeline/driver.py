"""The one way to drive the engine: start it, pump it, close a scaling window, stop it.

`stoker train`'s controller and `stoker.Loader` both drive an engine through this; what differs between them is
what they do with a batch once it is deliverable and where their step figures come from, not the engine's life.
The controller's consumers report on the same mailbox as the producers: `pump` routes the producers' messages to
the engine and hands the rest back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from stoker.common.procs import (
    CONTEXT,
    POLL_S,
    Mailbox,
    StokerRunError,
    check_memory_for_producers,
    start_resource_tracker,
)
from stoker.pipeline.autoscaler import StepStamp, Window
from stoker.pipeline.engine import Accounting, Build, Engine, ProducerCounts, check_ring_space
from stoker.pipeline.gauges import EventLog
from stoker.pipeline.scheduler import Scheduler
from stoker.pipeline.semaphores import name_semaphores_for_sweeping, sweep_dead_semaphores

SCALE_WINDOW_S = 1.0  # how often the pipeline is recorded and the autoscaler decides


def check_room(build: Build, counts: ProducerCounts, memory_setting: str = "producers") -> None:
    """That /dev/shm holds the ring and memory the first producers: user errors, raised before anything starts
    (the controller checks before the machines of a run meet)."""
    check_ring_space(build.num_slots, build.batch_size, build.image_size, counts.budget, build.val_image_size)
    check_memory_for_producers(counts.initial, memory_setting)


class EngineDriver:
    """`EngineDriver(build, counts)` makes the stop event and the mailbox (after `check_room`); `start` creates
    the ring and the producers."""

    def __init__(self, build: Build, counts: ProducerCounts) -> None:
        self.build = build
        self.counts = counts
        name_semaphores_for_sweeping()  # before the first one: what a kill -9 of this process leaves is swept
        sweep_dead_semaphores()
        start_resource_tracker()  # before the first semaphore or segment registers with it
        self.stop = CONTEXT.Event()
        self.mailbox = Mailbox()
        self._engine: Engine | None = None
        self.closed = False

    def start(self, accounting: Accounting, events: EventLog, scheduler: Scheduler | None = None) -> Engine:
        """The ring and the producers; they build what `scheduler` orders (or what a later `follow` gives)."""
        self._engine = Engine(self.build, self.counts, self.mailbox, self.stop, accounting, events)
        if scheduler is not None:
            self._engine.follow(scheduler)
        return self._engine

    @property
    def engine(self) -> Engine:
        assert self._engine is not None, "start() creates the engine"
        return self._engine

    @property
    def started(self) -> bool:
        return self._engine is not None

    def pump(self, timeout_s: float, dispatch: bool = True) -> list[Any]:
        """Up to `timeout_s` for messages: the producers' go to the engine, the others are returned; then lost
        producers are replaced and (with `dispatch`) new work handed out."""
        engine = self.engine
        own = [message for message in self.mailbox.receive(timeout_s) if not engine.handle(message)]
        engine.check_producers()
        if dispatch:
            engine.dispatch()
        return own

    def drain(self, timeout_s: float, handle: Callable[[Any], None] | None = None) -> None:
        """Before a new scheduler is followed: parts no producer holds yet are dropped, and those a producer holds
        finish (into slots nobody takes). Messages that are not the producers' go to `handle`."""
        engine = self.engine
        deadline = time.monotonic() + timeout_s
        engine.abandon()
        while engine.building:
            if time.monotonic() > deadline:
                raise StokerRunError(f"{engine.building} part(s) of batches were still being built after "
                                     f"{timeout_s:.0f} s")
            for message in self.pump(POLL_S, dispatch=False):
                if handle is not None:
                    handle(message)
        engine.abandon()  # the compactions of parts that finished meanwhile: their batches are dropped too

    def deliverable(self) -> Iterator[tuple[int, Any]]:
        return self.engine.deliverable()

    def close_window(self, elapsed_s: float, samples: int, steps: int, queue_fill: float, input_wait: float,
                     train_s: float, shares: dict[str, float] | None = None, decide: bool = True,
                     stamps: tuple[StepStamp, ...] = (), lockstep: bool = True) -> float:
        """The window that ends now: a `pipeline` event (the samples' rate, the ready queue, the producers and
        `shares` of the consumers' time, by default just the input wait), then the autoscaler's turn when `decide`
        and consumers trained in it or none has taken a batch yet (producers filling the ring while consumers
        start; a window without steps later is a GPU consumer's steps reported in groups, or a validation pass).
        Returns the producers' utilization over the window."""
        engine = self.engine
        utilization = engine.take_utilization(elapsed_s)
        shares = {"input_wait": input_wait} if shares is None else shares
        engine.events.write("pipeline", samples_per_s=round(samples / elapsed_s, 2), queue_fill=round(queue_fill, 4),
                            producers=engine.num_active, producer_utilization=round(utilization, 4),
                            **{name: round(share, 4) for name, share in shares.items()})
        if decide and (steps or not engine.taken):
            engine.autoscale(Window(stall=input_wait, queue_fill=queue_fill, utilization=utilization,
                                    producers=engine.num_active, samples=samples, steps=steps, train_s=train_s,
                                    stamps=stamps, lockstep=lockstep))
        return utilization

    def stop_producers(self) -> None:
        """The stop event, then the producers joined (or killed); the ring stays until `close`."""
        self.stop.set()
        if self._engine is not None:
            self._engine.stop_producers()

    def close(self) -> None:
        """Idempotent: producers stopped, the mailbox closed, then the ring unlinked."""
        if self.closed:
            return
        self.closed = True
        self.stop_producers()
        self.mailbox.close()
        if self._engine is not None:
            self._engine.close()

"""The one way to drive the engine, and its only face: start it, pump it, hand over and take back batches,
measure each scaling window, stop it.

`stoker train`'s controller and `stoker.Loader` both drive an engine through this; what differs between them is
what they do with a batch once it is deliverable and where their step figures come from, not the engine's life.
The controller's consumers report on the same mailbox as the producers: `pump` routes the producers' messages to
the engine and hands the rest back. Drivers report each step (`note_step`) and sample the ready queue
(`note_queue`); `tick` closes the window every SCALE_WINDOW_S.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from stoker.common.procs import (
    CONTEXT,
    POLL_S,
    Mailbox,
    StokerRunError,
    check_memory_for_producers,
    start_resource_tracker,
)
from stoker.pipeline.autoscaler import StepStamp, Window, host_share, time_shares
from stoker.pipeline.engine import Accounting, Engine, EngineSpec, check_ring_space
from stoker.pipeline.gauges import EventLog, ProducerGauges
from stoker.pipeline.messages import StepReport
from stoker.pipeline.ring import RingSpec, SlotRing
from stoker.pipeline.scheduler import Scheduler
from stoker.pipeline.semaphores import name_semaphores_for_sweeping, sweep_dead_semaphores

SCALE_WINDOW_S = 1.0  # how often the pipeline is recorded and the autoscaler decides


def check_room(spec: EngineSpec, memory_setting: str = "producers") -> None:
    """That /dev/shm holds the ring and memory the first producers: user errors, raised before anything starts
    (the controller checks before the machines of a run meet)."""
    build = spec.build
    check_ring_space(build.num_slots, build.batch_size, build.image_size, spec.counts.budget, build.val_image_size,
                     build.sample_counts)
    check_memory_for_producers(spec.counts.initial, memory_setting)


@dataclass(frozen=True)
class Measure:
    """How a driver's steps are judged: by `consumers` processes that report each step's time split (compute,
    input wait, averaging, host) and, with `lockstep`, average every step; or (`consumers` None) by one loop in
    the user's process, whose only figure is its wait."""

    consumers: int | None = None
    lockstep: bool = True


@dataclass
class WindowTotals:
    """What the consumers and the ready queue did in the open window."""

    started: float
    wait_s: float = 0.0
    compute_s: float = 0.0
    averaging_s: float = 0.0
    host_s: float = 0.0
    steps: int = 0
    samples: int = 0
    queue_fill: float = 0.0
    queue_samples: int = 0
    stamps: list[StepStamp] = field(default_factory=list)

    def add(self, report: StepReport) -> None:
        busy_s = report.wait_s + report.compute_s + report.averaging_s + report.host_s
        self.stamps.append(StepStamp(report.ended_s, report.count, busy_s, report.wait_s, report.rank))
        self.wait_s += report.wait_s
        self.compute_s += report.compute_s
        self.averaging_s += report.averaging_s
        self.host_s += report.host_s
        self.steps += 1
        self.samples += report.count


class EngineDriver:
    """`EngineDriver(spec, measure)` makes the stop event and the mailbox (after `check_room`); `start` creates
    the ring and the producers."""

    def __init__(self, spec: EngineSpec, measure: Measure) -> None:
        self.spec = spec
        self.measure = measure
        name_semaphores_for_sweeping()  # before the first one: what a kill -9 of this process leaves is swept
        sweep_dead_semaphores()
        start_resource_tracker()  # before the first semaphore or segment registers with it
        self.stop = CONTEXT.Event()
        self.mailbox = Mailbox()
        self._engine: Engine | None = None
        self.window: WindowTotals | None = None  # open from the first batch on
        self.last_queue_fill = 0.0  # the mean of the last closed window
        self.closed = False

    def start(self, accounting: Accounting, events: EventLog, scheduler: Scheduler | None = None) -> EngineDriver:
        """The ring and the producers; they build what `scheduler` orders (or what a later `follow` gives)."""
        self._engine = Engine(self.spec.build, self.spec.counts, self.mailbox, self.stop, accounting, events)
        if scheduler is not None:
            self._engine.follow(scheduler)
        return self

    @property
    def engine(self) -> Engine:
        assert self._engine is not None, "start() creates the engine"
        return self._engine

    @property
    def started(self) -> bool:
        return self._engine is not None

    # ---- batches ------------------------------------------------------------------------------------------------

    def pump(self, timeout_s: float, dispatch: bool = True) -> list[Any]:
        """Up to `timeout_s` for messages: the producers' go to the engine, the others are returned; then lost
        producers are replaced and (with `dispatch`) new work handed out."""
        engine = self.engine
        own = [message for message in self.mailbox.receive(timeout_s) if not engine.handle(message)]
        engine.check_producers()
        if dispatch:
            engine.dispatch()
        return own

    def drain(self, handle: Callable[[Any], None] | None = None) -> None:
        """Before a new scheduler is followed: parts no producer holds yet are dropped, and those a producer holds
        finish (into slots nobody takes), within 3 x producer_timeout_s. Messages that are not the producers' go
        to `handle`."""
        engine = self.engine
        timeout_s = 3 * self.spec.build.producer_timeout_s
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

    def dispatch(self) -> None:
        self.engine.dispatch()

    def follow(self, scheduler: Scheduler) -> None:
        self.engine.follow(scheduler)

    def deliverable(self) -> Iterator[tuple[int, Any]]:
        return self.engine.deliverable()

    def release(self, slot: int) -> None:
        self.engine.release(slot)

    @property
    def ring(self) -> SlotRing:
        return self.engine.ring

    @property
    def ring_spec(self) -> RingSpec:
        return self.engine.ring.spec

    # ---- the producers' figures ---------------------------------------------------------------------------------

    @property
    def num_active(self) -> int:
        return self.engine.num_active

    def producer_limit(self) -> int:
        return self.engine.producer_limit()

    def producer_utilization(self) -> float:
        return self.engine.gauges.producer_utilization()

    def verdict_fields(self) -> dict[str, Any]:
        return self.engine.verdict_fields()

    def producer_fields(self) -> dict[str, Any]:
        """The summary's producer counts (all zero when the run stopped before the engine started), and how fast
        auto answered a plain need."""
        engine = self._engine
        return engine.gauges.summary_fields(engine.max_alive) if engine is not None else ProducerGauges.no_fields()

    # ---- the scaling window -------------------------------------------------------------------------------------

    def open_window(self, now: float) -> None:
        self.window = WindowTotals(now)

    def shift_window(self, by_s: float) -> None:
        """Leave `by_s` seconds out of the open window (time the loop spent elsewhere)."""
        if self.window is not None:
            self.window.started += by_s

    def note_queue(self) -> None:
        """Sample the ready queue's fill into the open window."""
        assert self.window is not None, "open_window() first"
        self.window.queue_samples += 1
        self.window.queue_fill += self.engine.queue_fill()

    def note_step(self, report: StepReport) -> None:
        assert self.window is not None, "open_window() first"
        self.window.add(report)

    def tick(self, now: float, decide: bool = True) -> bool:
        """Close the window when SCALE_WINDOW_S have passed since it opened, and open the next at `now`; True when
        it closed. `decide`: the autoscaler may change the count after it."""
        window = self.window
        assert window is not None, "open_window() first"
        elapsed_s = now - window.started
        if elapsed_s < SCALE_WINDOW_S:
            return False
        self._close_window(window, elapsed_s, decide)
        self.window = WindowTotals(now)
        return True

    def _judge(self, window: WindowTotals, elapsed_s: float) -> tuple[Window, dict[str, float]]:
        """The window's measurement for the autoscaler, and the shares of the consumers' time it logs."""
        n = self.measure.consumers
        if n is None:  # one loop: its waits over the window (the fill sampled at each wait, over its steps)
            queue_fill = window.queue_fill / max(1, window.steps)
            wait = min(1.0, window.wait_s / elapsed_s)
            return Window(stall=wait, queue_fill=queue_fill, utilization=0.0, producers=0, samples=window.samples,
                          steps=window.steps, train_s=elapsed_s), {"input_wait": wait}
        parts = (window.compute_s, window.wait_s, window.averaging_s, max(1e-9, elapsed_s * n))
        compute, wait, averaging = time_shares(*parts, host_s=window.host_s)
        host = host_share(*parts, window.host_s)
        # A rate of all consumers: their mean time in steps, as train_s.
        stamps = tuple(StepStamp(s.ended_s, s.samples, s.train_s / n, s.wait_s / n, s.consumer) for s in window.stamps)
        return Window(stall=wait, queue_fill=window.queue_fill / max(1, window.queue_samples), utilization=0.0,
                      producers=0, samples=window.samples, steps=window.steps,
                      train_s=(window.wait_s + window.host_s + window.compute_s + window.averaging_s) / n,
                      stamps=stamps, lockstep=self.measure.lockstep), {
            "compute": compute, "input_wait": wait, "averaging": averaging, "host": host}

    def _close_window(self, window: WindowTotals, elapsed_s: float, decide: bool) -> None:
        """The window that ends now: a `pipeline` event (the samples' rate, the ready queue, the producers and the
        shares of the consumers' time), then the autoscaler's turn when `decide` and consumers trained in it or
        none has taken a batch yet (producers filling the ring while consumers start; a window without steps
        later is a GPU consumer's steps reported in groups, or a validation pass)."""
        engine = self.engine
        measured, shares = self._judge(window, elapsed_s)
        self.last_queue_fill = measured.queue_fill
        utilization = engine.take_utilization(elapsed_s)
        engine.events.write("pipeline", samples_per_s=round(window.samples / elapsed_s, 2),
                            queue_fill=round(measured.queue_fill, 4), producers=engine.num_active,
                            producer_utilization=round(utilization, 4),
                            **{name: round(share, 4) for name, share in shares.items()})
        if decide and (window.steps or not engine.taken):
            engine.autoscale(replace(measured, utilization=utilization, producers=engine.num_active))

    # ---- the end ------------------------------------------------------------------------------------------------

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


def producer_fields(driver: EngineDriver | None) -> dict[str, Any]:
    """The summary's producer counts of a driver that may not exist yet (a Loader before its first iter())."""
    return driver.producer_fields() if driver is not None else ProducerGauges.no_fields()

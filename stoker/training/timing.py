"""Where a consumer's time goes, measured where the work happens: waiting for input, computing, averaging.

On the CPU a call's work is done when it returns and the host clock times it. On a GPU the host only enqueues, and a
host clock around an NCCL call would charge the collective to whatever synchronizes next: a step's phases are events
on the compute stream, read every few steps without a synchronization, and the device's idle gap is split into input
wait (the consumer blocked for its batch) and host time (the rest), since only input wait says more producers would
help. The host runs at most `max_ahead` steps ahead, on blocking events. Details: docs/gpus.md."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stoker.training.streams import DeviceOps

# A clock's own default; the consumer and `bench gpu` pass `--steps-ahead`. With 2 the host has one device step to
# copy the next batch into pinned memory and launch it; 3 gives it two, and delays what the host learns (losses,
# timings) by one step more.
MAX_AHEAD = 2


@dataclass
class StepMarks:
    idle_from: Any | None  # the previous step's end (None: something else ran in between, or the first step)
    start: Any
    host_wait_s: float
    computed: Any = None
    averaged: Any = None  # the end of the averaging (the compute's end when the step did not average)
    end: Any = None


@dataclass(frozen=True)
class StepTimes:
    wait_s: float
    compute_s: float
    averaging_s: float
    host_s: float = 0.0  # on a GPU: the device idled for the host, not for input


class StepClock:
    def __init__(self, ops: DeviceOps, max_ahead: int = MAX_AHEAD) -> None:
        self.ops = ops
        self.max_ahead = max_ahead
        self.previous_end: Any | None = None
        self.current: StepMarks | None = None
        self.recent_ends: deque[Any] = deque(maxlen=max_ahead)

    def begin(self, host_wait_s: float) -> None:
        """The host has the step's batch. On the CPU the step starts now (taking the batch out of its slot is
        the consumer's work); on a GPU it starts at `fed`, once the device is at most `max_ahead` steps behind."""
        self._hold_back()
        start = None if self.ops.asynchronous else self._mark()
        self.current = StepMarks(self.previous_end, start, host_wait_s)

    def fed(self) -> None:
        """The batch's copy is enqueued and the compute stream waits for it: on a GPU the step starts here, so the
        time the device idles for the host's copy and the transfer is idle time (host time, or input wait), not
        compute."""
        assert self.current is not None, "fed between begin() and end()"
        if self.current.start is None:
            self.current.start = self._mark()

    def computed(self) -> None:
        assert self.current is not None, "computed between begin() and end()"
        self.current.computed = self._mark()

    def end(self, averaged: bool, after_averaging: Callable[[], object] | None = None) -> StepMarks:
        """A step that did not average ends where its compute did: it spent exactly 0 s averaging.
        `after_averaging`: the step's own work that needs the average (the EMA update of the averaged model), run
        here and timed as compute: it is not the replicas' exchange, and with one consumer there is none."""
        marks, self.current = self.current, None
        assert marks is not None, "end() follows begin()"
        marks.averaged = self._mark() if averaged else marks.computed
        if after_averaging is not None:
            after_averaging()
        marks.end = self.previous_end = marks.averaged if after_averaging is None else self._mark()
        self.recent_ends.append(marks.end)
        return marks

    def _hold_back(self) -> None:
        """Sleep until the step `max_ahead` steps back has ended on the device."""
        if len(self.recent_ends) == self.max_ahead and self.ops.asynchronous:
            oldest = self.recent_ends[0]
            if not self.ops.done(oldest):
                self.ops.synchronize(oldest)

    def pause(self) -> None:
        """Work that is not a training step comes next (validation, a checkpoint): no idle gap spans it."""
        self.previous_end = None

    def ready(self, marks: StepMarks) -> bool:
        """Whether the device has done the step (never blocks)."""
        return self.ops.done(marks.end)

    def seconds(self, marks: StepMarks) -> StepTimes:
        """The step's phases in seconds; waits (sleeping) until the device has done the step."""
        ops = self.ops
        if not ops.done(marks.end):
            ops.synchronize(marks.end)
        compute_s = ops.elapsed_s(marks.start, marks.computed)
        if marks.end is not marks.averaged:  # work after the averaging (`end`'s after_averaging)
            compute_s += ops.elapsed_s(marks.averaged, marks.end)
        averaging_s = ops.elapsed_s(marks.computed, marks.averaged)
        if not ops.asynchronous:
            return StepTimes(marks.host_wait_s, compute_s, averaging_s)
        gap_s = max(0.0, ops.elapsed_s(marks.idle_from, marks.start)) if marks.idle_from is not None else 0.0
        wait_s = min(gap_s, marks.host_wait_s)
        return StepTimes(wait_s, compute_s, averaging_s, host_s=gap_s - wait_s)

    def _mark(self) -> Any:
        event = self.ops.new_event()
        self.ops.record(event, self.ops.compute_stream())
        return event

"""Where a consumer's time goes, measured where the work happens: waiting for input, computing, averaging.

On the CPU a call has finished its work when it returns, and the host clock times it. On a GPU the host only
enqueues: `perf_counter` around an NCCL all_reduce measures the enqueueing (about 0) and charges the collective to
whatever synchronizes next. So a step's phases are marked with events on the compute stream, and turned into
seconds once the device has reached them (the consumer reads them every few steps, never forcing a synchronization
per step). On a GPU the input wait is the device's idle gap between the end of the previous step and the start of
this one: the host waiting for a batch while the device still works through queued steps is no stall.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stoker.pipeline.streams import DeviceOps


@dataclass
class StepMarks:
    idle_from: Any | None  # the previous step's end (None: something else ran in between, or the first step)
    start: Any
    host_wait_s: float
    computed: Any = None
    end: Any = None


@dataclass(frozen=True)
class StepTimes:
    wait_s: float
    compute_s: float
    averaging_s: float


class StepClock:
    def __init__(self, ops: DeviceOps) -> None:
        self.ops = ops
        self.previous_end: Any | None = None
        self.current: StepMarks | None = None

    def begin(self, host_wait_s: float) -> None:
        """The host has the step's batch. On the CPU the step starts now (taking the batch out of its slot is
        the consumer's work); on a GPU it starts at `fed`."""
        start = None if self.ops.asynchronous else self._mark()
        self.current = StepMarks(self.previous_end, start, host_wait_s)

    def fed(self) -> None:
        """The batch's copy is enqueued and the compute stream waits for it: on a GPU the step starts here, so the
        time the device idles for the host's copy and the transfer counts as input wait, not compute."""
        assert self.current is not None, "fed between begin() and end()"
        if self.current.start is None:
            self.current.start = self._mark()

    def computed(self) -> None:
        assert self.current is not None, "computed between begin() and end()"
        self.current.computed = self._mark()

    def end(self, averaged: bool) -> StepMarks:
        """A step that did not average ends where its compute did: it spent exactly 0 s averaging."""
        marks, self.current = self.current, None
        assert marks is not None, "end() follows begin()"
        marks.end = self.previous_end = self._mark() if averaged else marks.computed
        return marks

    def pause(self) -> None:
        """Work that is not a training step comes next (validation, a checkpoint): no idle gap spans it."""
        self.previous_end = None

    def ready(self, marks: StepMarks) -> bool:
        return self.ops.done(marks.end)

    def seconds(self, marks: StepMarks) -> StepTimes:
        """The step's phases in seconds; waits until the device has done the step."""
        ops = self.ops
        ops.synchronize(marks.end)
        if not ops.asynchronous:
            wait_s = marks.host_wait_s
        else:
            wait_s = ops.elapsed_s(marks.idle_from, marks.start) if marks.idle_from is not None else 0.0
        return StepTimes(wait_s, ops.elapsed_s(marks.start, marks.computed), ops.elapsed_s(marks.computed, marks.end))

    def _mark(self) -> Any:
        event = self.ops.new_event()
        self.ops.record(event, self.ops.compute_stream())
        return event

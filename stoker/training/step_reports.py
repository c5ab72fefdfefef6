"""A consumer's reports of its steps to the controller, in order, without making the device wait.

On a GPU the host runs ahead of the device: a step's loss and timings exist only once the device has done it. The
reports go in groups (`REPORT_EVERY_ASYNC`), each for the steps the device has done, or all at once when the
consumer would wait for input anyway; on the CPU each step is reported as it ends. The first step is reported at
once: the controller times the run from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stoker.pipeline.messages import Batch, StepReport
from stoker.training import accel
from stoker.training.timing import StepClock, StepMarks

# On a device that runs behind the host, steps are reported in groups: one synchronization reads them all.
REPORT_EVERY_ASYNC = 16


@dataclass
class StepInFlight:
    """A step the device may still be working on, until it is reported."""

    batch: Batch
    ids: np.ndarray
    loss: torch.Tensor | None  # on the host once `marks.end` has completed; None: this rank had no samples
    marks: StepMarks
    digest: str | None
    # Stamped as the host ends it, not when it is reported (in groups on a GPU, where the device ends it at most
    # --steps-ahead steps later): the autoscaler must not count a step that ran before a fork for the fork.
    ended_s: float = 0.0


class StepReports:
    """The steps not yet reported, sent as `StepReport`s to `outbox` as consumer `local_rank`."""

    def __init__(self, outbox, clock: StepClock, device: torch.device, local_rank: int, asynchronous: bool) -> None:
        self.outbox = outbox
        self.clock = clock
        self.device = device
        self.local_rank = local_rank
        self.steady_every = REPORT_EVERY_ASYNC if asynchronous else 1
        self.every = 1  # the first step is reported at once: the controller times the run from it
        self.pending: list[StepInFlight] = []

    def add(self, step: StepInFlight, generation: int) -> None:
        self.pending.append(step)
        if len(self.pending) >= self.every:
            # The first step is reported at once (the controller times the run from it); later ones only once
            # the device has done them: waiting here would leave the device idle while the host catches up.
            self.send(generation, wait=self.every == 1)

    def drop(self) -> None:
        """The steps of a group that broke: void."""
        self.pending = []

    def send(self, generation: int, wait: bool = True) -> None:
        """Report the steps done since the last report, in order: with `wait` all of them, after one (sleeping)
        synchronization, which the consumer does only when it would wait anyway; without, those the device has
        done."""
        count = len(self.pending) if wait else self._steps_done()
        if not count:
            return
        done, self.pending = self.pending[:count], self.pending[count:]
        self.every = self.steady_every
        memory = accel.memory_stats(self.device)
        for step in done:
            times = self.clock.seconds(step.marks)
            batch = step.batch
            self.outbox.send(StepReport(self.local_rank, batch.epoch, batch.step, batch.global_step,
                                        len(step.ids), step.loss.item() if step.loss is not None else 0.0,
                                        times.wait_s, times.compute_s, times.averaging_s, step.ids, step.digest,
                                        memory, host_s=times.host_s, ended_s=step.ended_s,
                                        epoch_steps=batch.epoch_steps, generation=generation))

    def _steps_done(self) -> int:
        """How many of the pending steps, from the oldest, the device has done."""
        count = 0
        while count < len(self.pending) and self.clock.ready(self.pending[count].marks):
            count += 1
        return count

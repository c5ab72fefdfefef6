"""The learning rate at each global step: a linear warmup, then cosine, step or constant.

Large global batches (8 GPUs) need the warmup: Goyal et al. 2017 ("Accurate, Large Minibatch SGD") scale the
learning rate with the global batch and ramp up to it linearly over the first epochs, step by step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Schedule = Literal["cosine", "step", "constant"]
STEP_MILESTONES = (0.5, 0.75)  # shares of the steps after warmup where `step` divides the rate by 10
STEP_GAMMA = 0.1


@dataclass(frozen=True)
class LearningRate:
    peak: float
    schedule: Schedule
    total_steps: int
    warmup_steps: int = 0

    def at(self, step: float) -> float:
        """The rate of the 0-based global `step` (fractional after the consumers changed mid-run): (step + 1) /
        warmup_steps of the peak during warmup (the first step already moves), then the schedule over the steps
        that remain."""
        if step < self.warmup_steps:
            return self.peak * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        if self.schedule == "cosine":
            return self.peak * (0.5 * (1 + math.cos(math.pi * progress)))
        if self.schedule == "step":
            return self.peak * STEP_GAMMA ** sum(progress >= milestone for milestone in STEP_MILESTONES)
        return self.peak

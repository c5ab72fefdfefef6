"""The values some settings take, where both the settings (`config.py`) and the producer side read them: this
module imports nothing, so a producer's start does not pay for pydantic."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

Augment = Literal["standard", "noflip", "none", "trivial", "randaug"]
AUGMENTS: tuple[str, ...] = get_args(Augment)

BUILTIN_IMAGE_SIZE = 32  # the built-in dataset's side
DEFAULT_IMAGE_SIZE = 224  # a folder or shards of one's own

# `--image-size-ramp`'s rounding: FFCV's ImageNet recipe (`get_resolution`) rounds the ramp to multiples of 32.
RAMP_STEP = 32
_RAMP_FORM = "MIN:MAX@START-END, e.g. 160:192@2-8"


@dataclass(frozen=True)
class SizeRamp:
    """Progressive resizing as FFCV's ImageNet recipe does it: `low` px up to epoch `start`, `high` px from epoch
    `end` on, linear in between rounded to a multiple of RAMP_STEP (half to even, as numpy's round), kept within
    low..high so that a slot sized for `high` holds every epoch's batch. Epochs count from 0, as FFCV's."""

    low: int
    high: int
    start: int
    end: int

    @classmethod
    def parse(cls, text: str) -> SizeRamp:
        match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*@\s*(\d+)\s*-\s*(\d+)\s*", text)
        if match is None:
            raise ValueError(f"expected {_RAMP_FORM} (sizes in px, epochs counted from 0)")
        low, high, start, end = (int(group) for group in match.groups())
        if low > high:
            raise ValueError(f"MIN {low} is above MAX {high} (expected {_RAMP_FORM})")
        if end < start:
            raise ValueError(f"END epoch {end} is before START epoch {start} (expected {_RAMP_FORM})")
        return cls(low, high, start, end)

    def size_at(self, epoch: int) -> int:
        if epoch <= self.start:
            return self.low
        if epoch >= self.end:
            return self.high
        between = self.low + (self.high - self.low) * (epoch - self.start) / (self.end - self.start)
        return min(self.high, max(self.low, round(between / RAMP_STEP) * RAMP_STEP))

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every side the ramp trains at, smallest first."""
        return tuple(sorted({self.size_at(epoch) for epoch in range(self.start, self.end + 1)}))

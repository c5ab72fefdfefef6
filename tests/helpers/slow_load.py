"""A user's dataset that takes seconds to load in a producer (as one importing torch and its own modules does on a
contended core), then builds every item at once."""

from __future__ import annotations

import os
import time

import numpy as np


class SlowToLoad:
    def __init__(self, load_s: float, size: int = 16) -> None:
        self.load_s, self.size = load_s, size

    def __setstate__(self, state: dict) -> None:
        time.sleep(state["load_s"])
        self.__dict__.update(state)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        return np.full((16, 16, 3), index, dtype=np.uint8), index % 2


class FirstLoadNeverEnds(SlowToLoad):
    """The first producer to unpickle it is stuck for good (it claims `marker`, writing its pid there); the others
    load at once. With `marker` of None, every producer is stuck."""

    def __init__(self, marker: str | None, size: int = 16) -> None:
        super().__init__(load_s=0.0, size=size)
        self.marker = marker

    def __setstate__(self, state: dict) -> None:
        marker = state["marker"]
        if marker is None or _claim(marker):
            time.sleep(3600)
        self.__dict__.update(state)


def _claim(path: str) -> bool:
    try:
        with open(path, "x") as handle:  # first come, first stuck (read empty for an instant: not yet claimed)
            handle.write(str(os.getpid()))
    except FileExistsError:
        return False
    return True

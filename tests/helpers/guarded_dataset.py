"""A user's script whose dataset class is defined under its main guard: it pickles here, but a spawned producer
imports the script without running the guard and cannot find the class."""

from __future__ import annotations

import numpy as np

import stoker

if __name__ == "__main__":
    class Guarded:
        def __len__(self) -> int:
            return 16

        def __getitem__(self, index: int):
            return np.zeros((8, 8, 3), np.uint8), 0

    with stoker.Loader(Guarded(), batch_size=4, producers=1, device="cpu") as loader:
        for _ in loader:
            pass

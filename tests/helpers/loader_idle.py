"""A user's loop that takes a few batches from stoker.Loader, says so, then trains "forever" (until a signal)."""

from __future__ import annotations

import sys
import time

import stoker


def main() -> None:
    loader = stoker.Loader(sys.argv[1], batch_size=8, image_size=32, producers=2, device="cpu")
    for step, _ in enumerate(loader):
        if step == 2:
            print("training", flush=True)
        time.sleep(0.05 if step < 2 else 3600)


if __name__ == "__main__":
    main()

"""Pixels: decoding one image into its place in a batch, and the augmentations applied to it there."""

from __future__ import annotations

from typing import Any

# Which decoder made a run's pixels, raised whenever the same bytes, box and draws decode to other pixels; a
# checkpoint or a Loader state records it. 1: any scale libjpeg-turbo has; 2: its SIMD scales only (1/8, 2/8,
# 4/8, 8/8), so a box that 3/8 or 5/8-7/8 decoded before is decoded from a larger scale.
PIXELS_VERSION = 2


def pixels_change(recorded: Any) -> str | None:
    """What a resume from a state that recorded pixels version `recorded` (None: saved before versions were
    recorded, version 1) must be told, or None where this stoker decodes the same pixels."""
    before = 1 if recorded is None else recorded
    if before == PIXELS_VERSION:
        return None
    return (f"saved by a stoker whose decoder gave other pixels (pixels version {before!r}, now {PIXELS_VERSION}): "
            "the resumed run trains the same samples in the same order with the same draws, but its JPEGs may decode "
            "a few levels from the uninterrupted run's pixels, so it is not bitwise that run")

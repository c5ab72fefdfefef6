"""Sizes as people write them: 1GB, 500M, 4096 (decimal units, as disks are sold)."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(name: str, text: str) -> int:
    """'1GB' -> 10**9, '500M' -> 5 * 10**8, '4096' -> 4096; anything else is a ValueError naming `name`."""
    match = _SIZE.match(text)
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()]) if match is not None else 0
    if size < 1:  # '0.5' is no byte
        raise ValueError(f"{name}={text!r}: expected a positive size such as 1GB, 500MB or 1048576")
    return size

"""Files written whole or not at all: a reader (another process, a later run) sees the old file or the new one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def replace_with(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # the pid: processes sharing a folder write too
    temporary.write_bytes(data)
    os.replace(temporary, path)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    replace_with(path, (json.dumps(payload, indent=2, default=str) + "\n").encode())  # machines share the folder


def write_durably(path: Path, data: bytes) -> None:
    """Write and fsync: on the disk before anything that names it (a pointer, a rename) is written."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def replace_durably(path: Path, data: bytes) -> None:
    """`replace_with`, the new file fsynced before the rename and the folder after it: after a power cut the
    path holds the old file or the whole new one, never an empty or cut one."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write_durably(temporary, data)
    os.replace(temporary, path)
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)

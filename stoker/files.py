"""Files written whole or not at all: a reader (another process, a later run) sees the old file or the new one."""

from __future__ import annotations

import os
from pathlib import Path


def replace_with(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # the pid: processes sharing a folder write too
    temporary.write_bytes(data)
    os.replace(temporary, path)

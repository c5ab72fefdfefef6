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

"""A run folder holds one run: a new run refuses a folder that holds one, and `--resume` needs a checkpoint in it.

Checked in the controller before any process starts, so a user error is an exit code 2 and nothing to clean up.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from stoker.common import checkpoint
from stoker.common.config import RUN_CONFIG_FILE

# What a run leaves in its folder (the first is written when it starts, before any step).
RUN_MARKERS = (RUN_CONFIG_FILE, "metrics.jsonl", "summary.json", "checkpoints")


class RunDirError(ValueError):
    """The run folder cannot be used as asked; the message says what to do instead."""


def check_new_run_dir(run_dir: Path) -> None:
    """A new run writes metrics.jsonl afresh and numbers its checkpoints from 0: in a folder that holds a run it
    would truncate that run's metrics, and the old run's checkpoints (higher steps) would outrank its own."""
    found = [name for name in RUN_MARKERS if (run_dir / name).exists()]
    if found:
        raise RunDirError(f"out={str(run_dir)!r} already holds a run ({', '.join(found)}); continue it with "
                          f"--resume {run_dir}, or give a new --out folder (or remove this one)")


def newest_checkpoint(run_dir: Path) -> tuple[Path, dict]:
    """The checkpoint `--resume` continues from, or a `RunDirError` that says there is none to continue from."""
    try:
        return checkpoint.newest_valid(run_dir)
    except checkpoint.CheckpointError as error:
        raise RunDirError(f"{error}: nothing to resume from (the run stopped before its first checkpoint, or "
                          f"every checkpoint was refused, see the warnings above); start it again with "
                          f"--out {run_dir} after removing the folder, or with a new --out folder") from None


def default_run_dir() -> Path:
    return Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")

"""Where a run stands and where its checkpoints lie: the names the producer side needs of checkpoints, without
torch (the scheduler resumes from a `Position`; a producer's start must not pay for torch's import)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MODEL_FILE = "model.pt"
META_FILE = "meta.json"
META_CHECKSUM = "meta_sha256"  # of meta.json's other keys, canonically serialized
PREFIX = "step_"
TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class Position:
    """Where training resumes: the next train step to run, the global step count so far, and the samples of the
    epoch before that step (None in checkpoints written before the consumers could change mid-run: `step` steps of
    the run's own size)."""

    epoch: int
    step: int
    global_step: int
    offset: int | None = None


def rank_file(rank: int) -> str:
    return f"rank_{rank}.pt"


def step_of(folder: Path) -> int:
    return int(folder.name.rsplit("_", 1)[1])


def checkpoint_dir(run_dir: Path, global_step: int, temporary: bool = False) -> Path:
    name = f"{PREFIX}{global_step:08d}"
    return run_dir / "checkpoints" / (TMP_PREFIX + name if temporary else name)

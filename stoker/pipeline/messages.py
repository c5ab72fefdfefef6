"""What the controller and the consumers send each other: work on the ready queue, reports on the outbox."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from stoker.common.procs import ChildError
from stoker.pipeline.plan import Kind

if TYPE_CHECKING:
    from stoker.common.positions import Position


# Controller -> consumer, in the order they must be handled.
@dataclass(frozen=True)
class Batch:
    kind: Kind
    epoch: int
    step: int
    global_step: int
    slot: int | None  # None: this rank has no samples in this step but still joins the collective
    step_samples: int
    schedule_step: float = 0.0  # where the step stands on the learning-rate schedule (`EpochPlan.schedule_step`)
    lr_scale: float = 1.0  # the learning rate over the schedule's: the consumers over the run's first count
    epoch_steps: int = 0  # steps of this epoch (they change when the consumers do)


@dataclass(frozen=True)
class ValEnd:
    epoch: int


@dataclass(frozen=True)
class Save:
    folder: Path
    global_step: int
    position: Position  # where a resume from this checkpoint continues


@dataclass(frozen=True)
class Finish:
    model_path: Path


# Consumer -> controller.
@dataclass(frozen=True)
class SlotFree:
    slot: int
    generation: int = 0  # the group the consumer was in: a slot of a group that broke was already taken back


@dataclass(frozen=True)
class StepReport:
    rank: int
    epoch: int
    step: int
    global_step: int
    count: int
    loss: float
    wait_s: float
    compute_s: float
    averaging_s: float
    sample_ids: np.ndarray
    digest: str | None
    memory: dict[str, int] = field(default_factory=dict)  # GPU memory peaks so far (nothing on the CPU)
    host_s: float = 0.0  # on a GPU: the device idled for the host (Python, copies), not for input (timing.py)
    ended_s: float = 0.0  # time.monotonic() when the host ended the step: the autoscaler judges windows by it
    epoch_steps: int = 0  # steps of this epoch in the plan the step belonged to (0: not known)
    generation: int = 0  # the consumers' group the step was trained in (`Regroup`)


@dataclass(frozen=True)
class ValReport:
    epoch: int
    loss: float
    accuracy: float
    count: int
    top5: float | None = None
    confusion: list[list[int]] | None = None  # [true class][predicted class]
    ema: dict[str, float] | None = None  # the EMA model's loss, accuracy and top5 (with --ema)


@dataclass(frozen=True)
class Saved:
    rank: int
    global_step: int
    files: dict[str, str]  # file name -> SHA-256
    replicas_agree: bool = True  # saved right after an averaging: every replica's weights are the averaged model


@dataclass(frozen=True)
class Finished:
    rank: int
    digest: str
    first_wait_s: float
    memory: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class StartupPhase:
    """A consumer began a phase of its start-up (`stoker.training.startup`); STARTED ends it."""

    rank: int
    phase: str


@dataclass(frozen=True)
class ConsumerFailed:
    rank: int
    error: ChildError

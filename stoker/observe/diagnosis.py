"""Where the time goes, in one line: input-bound, sync-bound or compute-bound, with the numbers and what to try."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

INPUT_BOUND = 0.10  # consumers waiting for batches more than this share of their time
HOST_BOUND = 0.10  # GPUs idle for the host (Python, copies), not for input, more than this share of the time
SYNC_BOUND = 0.15  # averaging more than this share of the step
SYNC_GOAL = 0.05  # the averaging share a suggested --sync-every aims for
BUSY_PRODUCERS = 0.80  # producers busy more than this share of their time are the limit
SLOW_READS = 0.5  # producers spending more than this share of their busy time reading files wait on storage


@dataclass(frozen=True)
class TimeSplit:
    """Shares of the consumers' wall time (averaged over consumers) and the producers' state."""

    compute: float
    input_wait: float
    averaging: float
    producers: int
    producer_budget: int
    producer_utilization: float
    sync_every: int
    overlapped: bool = False
    producer_ceiling: int | None = None  # --max-producers (or auto's default); None: the budget is the ceiling
    host: float = 0.0  # on GPUs: the device idle while the consumer was not waiting for a batch
    producer_read_share: float | None = None  # of the producers' busy time, reading files; None: not measured
    producer_slot_bound: float | None = None  # share of their time producers idled while a batch waited for a slot


@dataclass(frozen=True)
class Spelling:
    """How the user names the settings the input advice points at: the trainer's flags, or a Loader's arguments
    (None: the Loader has no such setting)."""

    producers_auto: str = "--producers auto"
    producers: str = "--producers"
    max_producers: str = "--max-producers"
    slots: str | None = "--slots-per-consumer"
    image_size: str = "--image-size"


FLAGS = Spelling()
LOADER_ARGUMENTS = Spelling("producers='auto'", "producers=", "max_producers=", None, "image_size=")


@dataclass(frozen=True)
class Verdict:
    kind: Literal["input-bound", "host-bound", "sync-bound", "compute-bound", "starting"]
    text: str

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def diagnose(split: TimeSplit, spelling: Spelling = FLAGS) -> Verdict:
    if split.host >= HOST_BOUND and split.host > split.input_wait and split.host >= split.averaging:
        return Verdict("host-bound", f"host-bound: the device waits for Python {split.host:.0%} of the time "
                                     f"(input waits {split.input_wait:.0%}); try --compile, a larger batch, "
                                     "or CUDA graphs")
    if split.input_wait >= INPUT_BOUND and split.input_wait >= split.averaging:
        return Verdict("input-bound", f"input-bound: consumers wait {split.input_wait:.0%} of the time; "
                                      f"{_producer_advice(split, spelling)}")
    if split.averaging >= SYNC_BOUND:
        overlap = "" if split.overlapped else " or --overlap-averaging true"
        return Verdict("sync-bound", f"sync-bound: averaging takes {split.averaging:.0%} of the time; try "
                                     f"--sync-every {suggest_sync_every(split.averaging, split.sync_every)}{overlap}")
    return Verdict("compute-bound", f"compute-bound: devices busy {split.compute:.0%} of the time, input waits "
                                    f"{split.input_wait:.0%}, averaging {split.averaging:.0%}")


def _producer_advice(split: TimeSplit, names: Spelling) -> str:
    """What limits input, from the producers' own figures: producers idle while batches waited for a free slot
    lack work (more cores would idle too); busy ones wait on storage only when reading files is most of their busy
    time (a cache-warm folder reads in microseconds and its producers are busy decoding). Producers idle for another
    reason (the run's first and last batches, work handed out late) are judged by what they did when busy."""
    idle = 1 - split.producer_utilization
    slot_bound = split.producer_slot_bound
    if idle > 1 - BUSY_PRODUCERS and (slot_bound is None or slot_bound >= idle / 2):
        held = "" if slot_bound is None else f" ({slot_bound:.0%} of their time while a batch waited for a slot)"
        remedy = (f"raise {names.slots}" if names.slots
                  else "a Loader's ring holds a batch per producer and 2 more, which no setting changes")
        return (f"producers idle {idle:.0%} of the time while consumers wait{held}: they lack work, not cores or "
                f"storage (the batches in flight are the limit); {remedy}")
    busy = f"busy {split.producer_utilization:.0%}"
    if idle > 1 - BUSY_PRODUCERS:
        busy += f" (idle {idle:.0%}, not for want of a slot)"
    reading = split.producer_read_share
    if reading is not None and reading >= SLOW_READS:
        at_most = split.producers >= (split.producer_ceiling or split.producer_budget)
        more = (f"raise {names.producers}, or {names.max_producers} under auto" if at_most
                else f"{names.producers_auto} adds them")
        return (f"producers {busy}, {reading:.0%} of it reading files: reading is slow (storage or network); more "
                f"producers overlap the reads ({more}), or copy the data to a local disk")
    if idle > 1 - BUSY_PRODUCERS:
        return f"producers {busy}: neither slots nor storage held them back, so more producers or cores would idle too"
    if split.producers >= split.producer_budget and (split.producer_ceiling or 0) > split.producer_budget:
        # The autoscaler holds the count below the ceiling: one more producer was tried and did not pay.
        return (f"producers held at {split.producer_budget} ({busy}; the ceiling is {split.producer_ceiling}) "
                "because one more did not raise the rate: the cores are the limit, not the producer count; lower "
                f"{names.image_size}, or give the run more cores")
    if split.producers >= split.producer_budget:
        return (f"producers at budget ({split.producers}/{split.producer_budget}, {busy}): give them more cores "
                f"({names.max_producers}) or lower {names.image_size}")
    return (f"{split.producers} producers {busy}, below the budget of {split.producer_budget}: "
            f"{names.producers_auto} adds more, or raise {names.producers}")


def suggest_sync_every(averaging: float, sync_every: int) -> int:
    """The smallest power of two H that brings the averaging share to SYNC_GOAL, assuming its cost scales by 1/H."""
    per_average = averaging / max(1e-9, 1 - averaging)  # averaging time relative to the rest of the step
    needed = per_average * sync_every / (SYNC_GOAL / (1 - SYNC_GOAL))
    return max(sync_every * 2, 2 ** math.ceil(math.log2(max(1.0, needed))))


def divergence(loss: float, global_step: int, rank: int, lr: float) -> str | None:
    """The run's error when a step's training loss is not a finite number (NaN or infinite): training cannot
    recover from it, and a run that went on would end "completed" with a useless model."""
    if math.isfinite(loss):
        return None
    return (f"the training loss became {loss} at step {global_step} (consumer {rank}): the run diverged; try a lower "
            f"--lr (this run: {lr:g}); the last checkpoint, written before it, stands")

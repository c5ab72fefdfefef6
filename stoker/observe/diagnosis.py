"""Where the time goes, in one line: input-bound, sync-bound or compute-bound, with the numbers and what to try."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from stoker.common.config import MAX_SLOTS_PER_CONSUMER, MIN_IMAGE_SIZE
from stoker.common.procs import MAX_PRODUCERS

INPUT_BOUND = 0.10  # consumers waiting for batches more than this share of their time
HOST_BOUND = 0.10  # GPUs idle for the host (Python, copies), not for input, more than this share of the time
SYNC_BOUND = 0.15  # averaging more than this share of the step
SYNC_GOAL = 0.05  # the averaging share a suggested --sync-every aims for
BUSY_PRODUCERS = 0.80  # producers busy more than this share of their time are the limit
SLOW_READS = 0.5  # producers spending more than this share of their busy time reading files wait on storage
# Images/s per device the feed is sized against: MLPerf's ResNet-50 on 8 x H200 trained at about 7,940 per GPU.
REFERENCE_RATE = 7900


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
    auto: bool = True  # the count is auto's (it moves between the minimum and the ceiling); False: a fixed count
    producer_room: int | None = None  # the parts the ring holds in flight: producers past it have nothing to build
    compiled: bool = False  # the model is torch.compile'd (--compile): not advised again
    # What the run already uses and could take, so that no advice repeats it or names a setting it cannot have:
    slots: int | None = None  # --slots-per-consumer (None: a Loader, whose ring follows its producer count)
    initial: int | None = None  # the count auto started at (--initial-producers)
    cores: int | None = None  # the machine's: a fixed count at one a core gains no CPU by being more
    overlap_allowed: bool = True  # whether the run's other settings allow --overlap-averaging true
    image_size: int | None = None  # the training resolution, which the advice may ask to lower
    feed_ms_per_image: float | None = None  # the producers' CPU milliseconds per training image (None: not measured)


@dataclass(frozen=True)
class Spelling:
    """How the user names the settings the input advice points at: the trainer's flags, or a Loader's arguments
    (None: the Loader has no such setting)."""

    producers_auto: str = "--producers auto"
    producers: str = "--producers"
    max_producers: str = "--max-producers"
    slots: str | None = "--slots-per-consumer"
    image_size: str = "--image-size"
    initial_producers: str | None = "--initial-producers"


FLAGS = Spelling()
LOADER_ARGUMENTS = Spelling("producers='auto'", "producers=", "max_producers=", None, "image_size=", None)


@dataclass(frozen=True)
class Verdict:
    kind: Literal["input-bound", "host-bound", "sync-bound", "compute-bound", "starting"]
    text: str

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def diagnose(split: TimeSplit, spelling: Spelling = FLAGS) -> Verdict:
    if split.host >= HOST_BOUND and split.host > split.input_wait and split.host >= split.averaging:
        tries = "a larger batch or CUDA graphs (--compile is on)" if split.compiled else \
            "--compile, a larger batch, or CUDA graphs"
        return Verdict("host-bound", f"host-bound: the device waits for Python {split.host:.0%} of the time "
                                     f"(input waits {split.input_wait:.0%}); try {tries}")
    if split.input_wait >= INPUT_BOUND and split.input_wait >= split.averaging:
        return Verdict("input-bound", f"input-bound: consumers wait {split.input_wait:.0%} of the time; "
                                      f"{_producer_advice(split, spelling)}{_feed_cost(split)}")
    if split.averaging >= SYNC_BOUND:
        overlap = "" if split.overlapped or not split.overlap_allowed else " or --overlap-averaging true"
        return Verdict("sync-bound", f"sync-bound: averaging takes {split.averaging:.0%} of the time; try "
                                     f"--sync-every {suggest_sync_every(split.averaging, split.sync_every)}{overlap}")
    return Verdict("compute-bound", f"compute-bound: devices busy {split.compute:.0%} of the time, input waits "
                                    f"{split.input_wait:.0%}, averaging {split.averaging:.0%}")


def _producer_advice(split: TimeSplit, names: Spelling) -> str:
    """What limits input, from the producers' own figures, and the setting that would change it (never one the
    run already uses: auto is not advised to a run on auto, nor --max-producers to a fixed count). Producers idle
    while batches waited for a free slot lack work (more cores would idle too); busy ones wait on storage only when
    reading files is most of their busy time (a cache-warm folder reads in microseconds and its producers are busy
    decoding). Producers idle with slots free and reads fast had no batch to build when consumers wanted one: the
    batches built ahead are the limit there too."""
    idle = 1 - split.producer_utilization
    slot_bound = split.producer_slot_bound
    if idle > 1 - BUSY_PRODUCERS and (slot_bound is None or slot_bound >= idle / 2):
        held = "" if slot_bound is None else f" ({slot_bound:.0%} of their time while a batch waited for a slot)"
        return (f"producers idle {idle:.0%} of the time while consumers wait{held}: they lack work, not cores or "
                f"storage (the batches in flight are the limit); {_more_slots(split, names)}")
    busy = f"busy {split.producer_utilization:.0%}"
    if idle > 1 - BUSY_PRODUCERS:
        busy += f" (idle {idle:.0%}, not for want of a slot)"
    reading = split.producer_read_share
    if reading is not None and reading >= SLOW_READS:
        return (f"producers {busy}, {reading:.0%} of it reading files: reading is slow (storage or network); "
                f"more producers overlap the reads ({_more_producers(split, names)}), or copy the data to a local disk")
    if idle > 1 - BUSY_PRODUCERS:
        reads = "" if reading is None else f", {reading:.0%} of it reading files"
        return (f"producers {busy}{reads}: they had no batch to build when consumers wanted one, so more "
                f"producers or cores would idle too; {_more_slots(split, names)} to build more batches ahead")
    at_limit = split.auto and split.producers >= split.producer_budget
    if at_limit and (split.producer_ceiling or 0) > split.producer_budget:
        # The autoscaler holds the count below the ceiling: one more producer was tried and did not pay.
        return (f"producers held at {split.producer_budget} ({busy}; the ceiling is {split.producer_ceiling}) "
                f"because one more did not raise the rate: the cores are the limit, not the producer count; "
                f"{_fewer_pixels_or_cores(split, names)}")
    if split.cores and split.producers >= split.cores:
        # Busy decoding, one a core or more: more producers (or a higher ceiling) would share the same cores.
        return (f"{_count_now(split, busy)}, {split.cores} cores: the cores are the limit, not the producer "
                f"count; {_fewer_pixels_or_cores(split, names)}")
    smaller = f" or lower {names.image_size}" if _can_shrink(split) else ""
    return f"{_count_now(split, busy)}: give them more cores ({_more_producers(split, names)}){smaller}"


def _feed_cost(split: TimeSplit) -> str:
    """What the feed costs, in the figure a node is sized by: cores per device at REFERENCE_RATE."""
    if not split.feed_ms_per_image:
        return ""
    cores = cores_per_device(split.feed_ms_per_image, REFERENCE_RATE)
    return (f" (the feed takes {split.feed_ms_per_image:.2f} ms of CPU per image: {cores:.1f} cores per device at "
            f"{REFERENCE_RATE:,} images/s)")


def cores_per_device(ms_per_image: float, images_per_s: float) -> float:
    """Cores one device needs to be fed `images_per_s` at `ms_per_image` of CPU each."""
    return ms_per_image * images_per_s / 1000


def feed_cores(ms_per_image: dict[str, float] | None, samples_per_s: float, devices: int) -> dict[str, float] | None:
    """The summary's cores per device: at the run's own rate per device and at REFERENCE_RATE."""
    if not ms_per_image or devices < 1:
        return None
    total = ms_per_image["total"]
    return {"at_run_rate": round(cores_per_device(total, samples_per_s / devices), 3),
            "at_reference_rate": round(cores_per_device(total, REFERENCE_RATE), 3), "reference_rate": REFERENCE_RATE}


def _can_shrink(split: TimeSplit) -> bool:
    return split.image_size is None or split.image_size > MIN_IMAGE_SIZE


def _fewer_pixels_or_cores(split: TimeSplit, names: Spelling) -> str:
    if _can_shrink(split):
        return f"lower {names.image_size}, or give the run more cores"
    return f"give the run more cores ({names.image_size} is at its least, {MIN_IMAGE_SIZE})"


def _count_now(split: TimeSplit, busy: str) -> str:
    if not split.auto:
        return f"producers at the fixed count ({split.producers}, {busy})"
    ceiling = split.producer_ceiling or split.producer_budget
    if split.producers >= ceiling:
        return f"producers at auto's ceiling ({split.producers}/{ceiling}, {busy})"
    return f"{split.producers} producers {busy}, below auto's limit of {split.producer_budget}"


def _more_producers(split: TimeSplit, names: Spelling) -> str:
    """The setting that gives this run more producers, given how it counts them; where every part the ring holds in
    flight already has its producer, the one that gives them more parts (measured: 64 producers on a ring of 32
    parts no faster than 32, whose verdict had asked for more producers)."""
    if split.producer_room is not None and split.producers >= split.producer_room:
        return (f"each of the {split.producer_room} parts the ring holds in flight has its producer already, so "
                f"{_more_slots(split, names)} for more")
    if not split.auto:
        return _raise(names.producers, split.producers, "the count")
    ceiling = split.producer_ceiling or split.producer_budget
    if split.producers >= ceiling:
        return _raise(names.max_producers, ceiling, "auto's ceiling", then=": auto forks while that pays")
    if split.producer_budget < ceiling and split.producers >= split.producer_budget:
        return (f"auto held them at {split.producer_budget}, where one more did not raise the rate; a fixed "
                f"{_given(names.producers, split.producer_budget + 1)} overrules it")
    # Started at the limit and retired below it: a higher start would be retired again.
    initial = names.initial_producers
    start = (f"start it higher with {_given(initial, split.producer_budget)}"
             if initial and (split.initial or 0) < split.producer_budget
             else f"fix the count with {_given(names.producers, split.producer_budget)}")
    return f"auto had reached {split.producers} of {split.producer_budget} by the end; {start}"


def _raise(name: str, value: int, what: str, then: str = "") -> str:
    """Advice to raise a producer count, where the setting allows a higher one."""
    if value >= MAX_PRODUCERS:
        return f"{what} is at the most a run may have ({MAX_PRODUCERS})"
    return f"raise {name.rstrip('=')} above {value}{then}"


def _given(name: str, value: int) -> str:
    """A setting with a value, as its user writes it: `--flag 3` or `keyword=3`."""
    return f"{name}{value}" if name.endswith("=") else f"{name} {value}"


def _more_slots(split: TimeSplit, names: Spelling) -> str:
    if names.slots and (split.slots or 0) >= MAX_SLOTS_PER_CONSUMER:
        return (f"{names.slots} is at its most ({MAX_SLOTS_PER_CONSUMER}): raise --batch-size (a slot holds a "
                "batch, built in parts of at least 4 samples)")
    if names.slots:
        return f"raise {names.slots}"
    if split.auto:
        return _raise(names.max_producers, split.producer_ceiling or split.producer_budget, "auto's ceiling",
                      then=" (a Loader's ring holds a slot for each producer it may run, and 2 more)")
    return _raise(names.producers, split.producers, "the count",
                  then=" (a Loader's ring holds a slot for each producer it runs, and 2 more)")


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

"""`stoker.Loader`: stoker's producers feeding a training loop of one's own (DDP, Lightning, accelerate).

One Loader per rank, in the user's training process. It drives the same engine as `stoker train` (the ring, the
producer pool, the scheduler's order of work, the autoscaler): batch k of epoch e on rank r is a pure function of
(seed, e, k, r), whichever producer builds it and however many there are, so every rank gets its own disjoint part
of each epoch, the same bytes with 1 or 16 producers, and a resume from `state_dict()` continues exactly. Rank
and world size are read at the first `iter()`, never in the constructor: Lightning builds its loaders before the
process group exists. The producers start at the first `iter()` and live until `close()` (or the process) ends.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stoker.common.config import (
    BUILTIN_IMAGE_SIZE,
    DEFAULT_IMAGE_SIZE,
    Augment,
    DataSettings,
    DeviceSettings,
    FeedSettings,
    RunSettings,
    check_data_path,
    check_section,
    names_where,
    setting_names,
)
from stoker.common.devices import available_cores
from stoker.common.main_guard import check_main_guard
from stoker.common.memory import available_memory
from stoker.common.positions import Position
from stoker.common.procs import POLL_S, StokerRunError
from stoker.common.urls import data_location
from stoker.data.formats.builtin_data import builtin_dataset
from stoker.data.formats.folders import Skipped
from stoker.data.formats.parquet import DEFAULT_COLUMNS, Columns
from stoker.data.formats.user_dataset import DatasetSource, check_dataset, unpack_item
from stoker.data.index import PackedIndex
from stoker.data.sources import load_source, local_copies, log_refused
from stoker.data.transports.object_store import LocalCopies
from stoker.observe.diagnosis import LOADER_ARGUMENTS, TimeSplit, diagnose
from stoker.observe.metrics import MetricsLog, RunStats
from stoker.pipeline.autoscaler import static_budget
from stoker.pipeline.driver import SCALE_WINDOW_S, EngineDriver, check_room
from stoker.pipeline.engine import Build, Engine, ProducerCounts, producer_fields
from stoker.pipeline.messages import Batch, StepReport
from stoker.pipeline.parts import parts_per_batch
from stoker.pipeline.plan import EpochPlan
from stoker.pipeline.pool import MAX_IN_FLIGHT, parts_held
from stoker.pipeline.scheduler import Scheduler
from stoker.training.feed import DeviceLoader
from stoker.training.streams import ops_for

log = logging.getLogger(__name__)

MIN_SLOTS = 4  # the trainer's slots_per_consumer
# Whole batches each producer may hold. The Loader reads completions and hands out work only inside next(): while the
# user's loop trains or waits in DDP's all_reduce, a producer holding one batch (the engine's MAX_IN_FLIGHT parts)
# runs dry; DataLoader's workers keep 2 batches each queued whatever the loop does.
QUEUED_BATCHES = 2
OPEN_ENDED = 1 << 40  # the scheduler's last epoch: the ring, not the epoch, bounds what is built ahead
STATE_VERSION = 1
# The last epoch a loader takes: far past any run, below OPEN_ENDED (an epoch past it had no batch and its iter()
# waited for ever), and epoch x steps stays an int64 global step for up to 2^32 steps an epoch.
MAX_EPOCH = (1 << 30) - 1


def check_position(epoch: Any, state: dict[str, Any] | None = None, samples: int = 0) -> int:
    """`epoch` as an int from 0 to MAX_EPOCH; and, for a loaded `state` whose offset is not its step's in its own
    plan (saved after a resume at another world size), an offset its step can have reached with a sample left:
    each step before it trained one sample at least. A ValueError naming what was given otherwise."""
    what = "load_state_dict: the state's epoch is" if state is not None else "set_epoch:"
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or not 0 <= epoch <= MAX_EPOCH:
        raise ValueError(f"{what} {epoch!r}; expected an integer epoch from 0 to {MAX_EPOCH}")
    offset = state.get("offset") if state is not None else None
    if state is not None and offset is not None and not state["step"] <= offset < samples:
        raise ValueError(f"load_state_dict: the state's offset {offset} does not fit its step {state['step']}: "
                         f"expected an offset from {state['step']} to {samples - 1} (each step before it trained a "
                         f"sample at least, and one of the epoch's {samples} is left); it would resume no batch")
    return int(epoch)


@dataclass(frozen=True)
class RankInfo:
    """Where this process stands in the job, read at the first `iter()`."""

    rank: int
    world_size: int
    local_world_size: int
    device: torch.device | None  # None: uint8 batches on the host


def read_rank() -> tuple[int, int]:
    """(rank, world size) from torch.distributed when its group exists, else RANK / WORLD_SIZE, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def resolve_device(device: str | None) -> torch.device | None:
    """The rank's own device, never simply cuda:0 (see `rank_gpu` for 'cuda')."""
    if device is None:
        return None
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device("cuda", rank_gpu()) if device == "cuda" else torch.device(device)
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r} is {resolved}, but {torch.cuda.device_count()} CUDA device(s) are "
                         "visible (LOCAL_RANK and CUDA_VISIBLE_DEVICES say which this rank gets)")
    return resolved


def rank_gpu() -> int:
    """'cuda' for this rank: the current device once CUDA is initialized (the user's `torch.cuda.set_device`),
    the only one where a rank sees one GPU (SLURM's --gpus-per-task=1, a per-rank CUDA_VISIBLE_DEVICES), else
    cuda:LOCAL_RANK (torchrun on a machine whose GPUs every rank sees)."""
    if torch.cuda.is_initialized():
        return torch.cuda.current_device()
    local = os.environ.get("LOCAL_RANK")
    if torch.cuda.device_count() == 1 or local is None:
        return 0
    return int(local)


class EpochSampler:
    """`loader.sampler`: what Lightning and DistributedSampler users call `set_epoch` on."""

    def __init__(self, loader: Loader) -> None:
        self._loader = weakref.proxy(loader)

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)


class _Events:
    """The engine's events: kept (the latest ones, for `summary()`), written to `metrics_file` when given, and
    producer changes logged as the trainer's live view shows them."""

    def __init__(self, metrics_file: Path | None) -> None:
        self.recent: deque[dict[str, Any]] = deque(maxlen=1000)
        self.log = MetricsLog(metrics_file) if metrics_file is not None else None

    def write(self, event: str, **fields: Any) -> None:
        self.recent.append({"event": event, **fields})
        if self.log is not None:
            self.log.write(event, **fields)
        if event == "producers" and fields.get("reason") != "start":
            log.info("producers: %d (%s)", fields["count"], fields["reason"])

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


class _LookaheadBooks:
    """The exactly-once books as the engine sees them (`engine.Accounting`). The scheduler runs on past the epoch
    being iterated, so producers build the next epoch's first batches while this one ends; what is scheduled for a
    later epoch is held here and enters the books only when the loop starts that epoch (a loop that stops after
    its last epoch, or jumps with set_epoch, has not missed the batches built ahead for it)."""

    def __init__(self, stats: RunStats) -> None:
        self.stats = stats
        self.skipped = stats.skipped
        self.epoch = 0  # the epoch being iterated
        self._held: dict[int, list[tuple[str, Any]]] = {}

    def expect(self, epoch: int, sample_ids: np.ndarray) -> None:
        self._book(epoch, "expect", sample_ids)

    def record_skipped(self, epoch: int | None, skipped: dict[int, Skipped]) -> None:
        self._book(epoch, "record_skipped", skipped)

    def _book(self, epoch: int | None, entry: str, value: Any) -> None:
        if epoch is not None and epoch > self.epoch:
            self._held.setdefault(epoch, []).append((entry, value))
        else:
            getattr(self.stats, entry)(epoch, value)

    def enter(self, epoch: int, built_ahead: bool, from_start: bool) -> None:
        """The loop starts `epoch`: what was scheduled for it ahead counts now (`built_ahead`), or is dropped with
        the batches built ahead (the engine follows a new scheduler). An epoch begun again from its first batch
        (after a `break`, or a peek with `next(iter(loader))`) is booked afresh: the abandoned pass's batches are
        not duplicates of the pass that counts."""
        self.epoch = epoch
        held = self._held.pop(epoch, []) if built_ahead else []
        if not built_ahead:
            self._held = {}
            if from_start:
                self.stats.forget_epoch(epoch)
        for entry, value in held:
            getattr(self.stats, entry)(epoch, value)


@dataclass
class _Window:
    """What the loop did since the last autoscaling decision."""

    started: float
    wait_s: float = 0.0
    samples: int = 0
    steps: int = 0
    fill: float = 0.0


@dataclass(frozen=True)
class _Pool:
    """Samples of this rank's batches pulled from the ring and not yet handed out. A step none of whose own files
    was usable takes its one sample from the next batch, so `through` (the last batch pulled) may be ahead of the
    step handed out next; `lent` of batch `through`'s samples went to earlier steps."""

    images: torch.Tensor
    labels: torch.Tensor
    ids: np.ndarray
    through: int
    lent: int = 0

    def split(self, count: int) -> tuple[tuple[torch.Tensor, torch.Tensor, np.ndarray], _Pool]:
        rest = _Pool(self.images[count:], self.labels[count:], self.ids[count:], self.through, self.lent + count)
        return (self.images[:count], self.labels[:count], self.ids[:count]), rest


class Loader:
    """Batches of (images, labels) for one rank: on `device` as normalized float NCHW (channels_last), or with
    `device=None` as uint8 NCHW on the host (pinned when CUDA is there). `data`: what `stoker train --data` takes
    (an ImageFolder root, WebDataset-layout shards; None for the built-in set), or a map-style dataset whose items
    are (HWC uint8 image of `image_size`, integer label)."""

    def __init__(self, data: str | Path | Any | None, batch_size: int, image_size: int | None = None,
                 augment: Augment = "standard", seed: int = 0, device: str | torch.device | None = "auto",
                 drop_last: bool = False, **settings: Any) -> None:
        """`settings`: any of LOADER_SETTINGS, named and checked as `stoker train`'s flags of the same name (the
        same sections validate them), and `metrics_file`: where the engine's events go as JSON lines."""
        own = {"metrics_file": settings.pop("metrics_file", None)}
        sections = _check_settings(data, dict(batch_size=batch_size, image_size=image_size, augment=augment,
                                              seed=seed, **settings))
        feed, data_settings = sections[FeedSettings], sections[DataSettings]
        _check_own(drop_last=drop_last, **own)
        self.batch_size = feed.batch_size
        self.augment: Augment = data_settings.augment
        self.seed = sections[RunSettings].seed
        self.producers = feed.producers
        self.min_producers = feed.min_producers
        self.max_producers = feed.max_producers
        self.device_setting = _check_device(device)
        self.drop_last = drop_last
        self.channels_last = sections[DeviceSettings].channels_last
        self.producer_timeout_s = feed.producer_timeout_s
        self.max_bad_fraction = data_settings.max_bad_fraction
        self.metrics_file = Path(own["metrics_file"]) if own["metrics_file"] is not None else None
        copies = local_copies(data_settings.cache_dir, data_settings.cache_size)
        columns = Columns(data_settings.image_column, data_settings.label_column)
        self.source, self.image_size, self.classes, self.refused = _open_data(data, data_settings.image_size, copies,
                                                                               columns)
        self.sampler = EpochSampler(self)
        self.epoch = 0
        self._position = Position(0, 0, 0)  # the next batch to hand out
        self._resume: Position | None = None  # from load_state_dict, used by the next iter() of that epoch
        self._resume_lent: tuple[int, int] | None = None  # (batch, samples of it handed out before the save)
        # From load_state_dict: (epoch, step, samples of the epoch before that step), which the plan is made again
        # from when the state was saved at another world size (or by a loader that itself was).
        self._resumed_at: tuple[int, int, int] | None = None
        self._pool: _Pool | None = None
        self._last_out: tuple[torch.Tensor, torch.Tensor, np.ndarray] | None = None  # a sample handed out
        self.repeated_samples = 0  # handed out twice to keep a batch from being empty (`summary()`)
        self.info: RankInfo | None = None
        self._engine: Engine | None = None
        self._finalizer: weakref.finalize | None = None
        self.batch_ids = np.zeros(0, dtype=np.int64)  # dataset positions of the last batch handed out
        self.paths: Sequence[str] = self.source.paths  # what names position i: a file, SHARD.tar:KEY, Dataset[i]
        self.stats = RunStats(1, len(self.source.paths), 0)  # this rank's books: steps, time split, exactly once
        for item in self.refused:
            self.stats.skipped.setdefault(item.path, item.reason)
        self._iterating = False
        self._built_ahead: Position | None = None  # where the engine's scheduler goes on, once an epoch ends whole
        self._generation = 0  # of the live iterator: an older one refuses to go on
        self._window: _Window | None = None
        self._step_end: float | None = None  # monotonic, when the last batch was handed out
        self._wait_s: float = 0.0  # of the step being served: its waits (a borrowing step waits for two)
        self._compute_s: float | None = None  # and the loop's time before it, read at its first wait
        self.closed = False

    # ---- what DataLoader users call ------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        self.epoch = check_position(epoch)

    def __len__(self) -> int:
        """Batches per epoch on every rank: the same on each, whatever files turn out unusable (the epoch a state of
        another world size resumed counts its batches before the resume as this world's plan numbers them)."""
        world = self.info.world_size if self.info is not None else read_rank()[1]
        return self._resume_plan(world).steps_in(self.epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.closed:
            raise RuntimeError("this stoker.Loader is closed")
        if self._engine is None:  # before any producer starts: each would run the unguarded script again
            check_main_guard(sys._getframe(1), "iterating a stoker.Loader")
        self._start()
        return self._batches()

    @property
    def batch_paths(self) -> list[str]:
        """The files (or shard members, or dataset items) of the last batch handed out, in its order."""
        return [self.paths[int(i)] for i in self.batch_ids]

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch is (epoch, step), what it is a function of, and the files skipped so far."""
        pool = self._pool if self._pool is not None and self._pool.through >= self._position.step else None
        world = self.info.world_size if self.info is not None else read_rank()[1]
        epoch, step = self._position.epoch, self._position.step
        offset = self._resume_plan(world).offset(epoch, step)  # recorded where it is not `step` whole steps
        moved = {"offset": offset} if offset != self._plan(world).offset(epoch, step) else {}
        return {"version": STATE_VERSION, "epoch": epoch, "step": step, **moved,
                "lent": [pool.through, pool.lent] if pool is not None else None,
                "seed": self.seed, "batch_size": self.batch_size, "drop_last": self.drop_last,
                "world_size": self.info.world_size if self.info is not None else read_rank()[1],
                "num_samples": len(self.source.paths),
                "skipped": [{"path": p, "reason": r} for p, r in self.stats.skipped.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved batch: the next `iter()` of the saved epoch starts there (exact resume)."""
        self._check_state(state)
        self.epoch = check_position(state["epoch"], state, len(self.source.paths))
        self._resume = self._position = Position(self.epoch, int(state["step"]), 0)
        saved_world = int(state.get("world_size", read_rank()[1] if self.info is None else self.info.world_size))
        offset = state.get("offset")
        offset = self._plan(saved_world).offset(self.epoch, self._resume.step) if offset is None else int(offset)
        self._resumed_at = (self.epoch, self._resume.step, offset)
        if self.info is not None:
            self.plan = self._resume_plan(self.info.world_size)
        lent = state.get("lent")
        self._resume_lent = (int(lent[0]), int(lent[1])) if lent is not None else None
        self._built_ahead = None
        for item in state.get("skipped", []):
            self.stats.skipped.setdefault(item["path"], item["reason"])

    def summary(self) -> dict[str, Any]:
        """Input stall share, producers over time, skipped files, exactly-once accounting, the trainer's verdict."""
        stats = self.stats
        engine = self._engine
        stall = stats.stall_fractions()[0]
        producers = engine.verdict_fields() if engine else {"producers": 0, "producer_budget": 0,
                                                             "producer_utilization": 0.0}
        split = TimeSplit(compute=stats.compute_fractions()[0], input_wait=stall, averaging=0.0, sync_every=1,
                          overlapped=False, image_size=self.image_size, **producers)
        return {"rank": self.info.rank if self.info else None,
                "world_size": self.info.world_size if self.info else None,
                "batches": stats.consumers[0].steps, "samples": stats.consumers[0].samples,
                "repeated_samples": self.repeated_samples,
                "input_stall_fraction": stall, **producer_fields(engine),
                "skipped_files": [{"path": p, "reason": r} for p, r in stats.skipped.items()],
                **stats.accounting(), "epoch_accounting": stats.epoch_accounting(),
                "verdict": diagnose(split, LOADER_ARGUMENTS).as_json() if stats.consumers[0].steps else
                {"bottleneck": "starting", "advice": "no batch handed out yet"}}

    def close(self) -> None:
        """Idempotent: producers stopped and joined, the ring unlinked."""
        self.closed = True
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- starting -----------------------------------------------------------------------------------------------

    def _plan(self, world: int) -> EpochPlan:
        return EpochPlan(len(self.source.paths), 0, self.batch_size, world, self.seed, self.drop_last)

    def _resume_plan(self, world: int) -> EpochPlan:
        """The plan for `world` ranks, made again from where a loaded state stood when that is not where this
        world's own plan would be (another world size saved it): the rest of its epoch, every sample once."""
        plan = self._plan(world)
        return plan if self._resumed_at is None else plan.continuing(*self._resumed_at)

    def _start(self) -> None:
        """At the first iter(): rank, world size and device, then the ring and the producers."""
        if self._engine is not None:
            return
        rank, world = read_rank()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        self.info = RankInfo(rank, world, local_world, resolve_device(self.device_setting))
        self.plan = self._resume_plan(world)
        if self.plan.steps_per_epoch == 0:
            raise ValueError(f"batch_size={self.batch_size} x {world} ranks is more than the {len(self.source.paths)}"
                             " samples, with drop_last=True: no batch at all")
        cores = max(1, available_cores() // max(1, local_world))  # this rank's share of the machine
        trains_on = ["cuda" if self._on_gpu() else "cpu"]
        memory = available_memory()
        counts = ProducerCounts.from_settings(self.producers, self.min_producers, None, self.max_producers,
                                              static_budget(trains_on, cores), cores, None,
                                              memory // max(1, local_world) if memory is not None else None)
        self.num_slots = max(MIN_SLOTS, counts.budget + 2)  # a producer each, and the one being read
        # The engine's finest split (its ceiling's): a producer holds QUEUED_BATCHES batches' worth at most (or, of
        # streamed samples, NETWORK_IN_FLIGHT parts where that is more: their reads wait a round trip together).
        parts = parts_per_batch(self.batch_size, self.num_slots, counts.budget, MAX_IN_FLIGHT)
        augment: Augment = "none" if isinstance(self.source, DatasetSource) else self.augment
        held = max(QUEUED_BATCHES * parts, parts_held(self.source))
        build = Build(self.source, None, augment, self.seed, self.batch_size, self.image_size, self.num_slots,
                      self.producer_timeout_s, self.max_bad_fraction, max_in_flight=held)
        check_room(build, counts)
        self.driver = EngineDriver(build, counts)
        self.events = _Events(self.metrics_file)
        self.stats.steps_per_epoch, self.stats.first_rank = self.plan.steps_per_epoch, rank
        self._books = _LookaheadBooks(self.stats)
        try:
            self._engine = self.driver.start(self._books, self.events)
        except BaseException:
            _shut_down(self.driver, self.events, os.getpid())
            raise
        # With the loader, at garbage collection, or at the interpreter's exit; never after a fork's copy of it.
        self._finalizer = weakref.finalize(self, _shut_down, self.driver, self.events, os.getpid())
        self._pin = torch.cuda.is_available()
        self._first_batch = True
        try:
            self.feed = DeviceLoader(self._engine.ring, self.info.device, self.channels_last,
                                     ops_for(self.info.device)) if self.info.device is not None else None
        except BaseException:  # a device that fails now: no producers left waiting, and the next iter() retries
            self._finalizer()
            self._engine = self._finalizer = None
            raise

    def _on_gpu(self) -> bool:
        device = self.info.device if self.info is not None else None
        return (device is not None and device.type == "cuda") or (device is None and torch.cuda.is_available())

    def _check_state(self, state: dict[str, Any]) -> None:
        for key in ("epoch", "step", "seed", "batch_size", "num_samples"):
            if key not in state:
                raise ValueError(f"load_state_dict: the state has no {key!r} (expected a Loader.state_dict())")
        mine = {"seed": self.seed, "batch_size": self.batch_size, "num_samples": len(self.source.paths),
                "drop_last": self.drop_last}
        for key, value in mine.items():
            if key in state and state[key] != value:
                raise ValueError(f"load_state_dict: the state was saved with {key}={state[key]!r}, this loader has "
                                 f"{key}={value!r}; batches would differ, resume with the same settings")
        world = read_rank()[1] if self.info is None else self.info.world_size
        saved_world = state.get("world_size", world)
        if isinstance(saved_world, bool) or not isinstance(saved_world, (int, np.integer)) or not \
                1 <= saved_world <= 1 << 20:
            raise ValueError(f"load_state_dict: the state's world_size is {saved_world!r}; expected an integer from "
                             "1 to 2^20")
        if saved_world != world and state.get("lent") is not None:
            raise ValueError(f"load_state_dict: the state was saved with world_size={saved_world} while a batch whose "
                             f"files were unusable borrowed from the next (lent); this job has {world} ranks: resume "
                             f"it with {saved_world}")
        offset, samples = state.get("offset"), len(self.source.paths)
        if offset is not None and (isinstance(offset, bool) or not isinstance(offset, (int, np.integer))
                                   or not 0 <= offset <= samples):
            raise ValueError(f"load_state_dict: the state's offset is {offset!r}; expected an integer from 0 to "
                             f"{samples} (the samples of its epoch before its step)")
        steps = self._plan(int(saved_world)).steps_per_epoch
        if offset is not None and isinstance(state["step"], int) and offset != self._plan(int(saved_world)).offset(
                0, state["step"]):
            steps = samples + 1  # saved by a loader that resumed at another world size: its steps are its own
        for key, below in (("epoch", None), ("step", steps)):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0 or (
                    below is not None and value >= below):
                bound = f"from 0 to {below - 1} (this loader has {below} batches per epoch)" if below else ">= 0"
                raise ValueError(f"load_state_dict: the state's {key} is {value!r}; expected an integer {bound}")
        lent = state.get("lent")
        if lent is not None and not (isinstance(lent, (list, tuple)) and len(lent) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) for v in lent) and state["step"] <= lent[0] < steps
                and 0 <= lent[1] <= self.batch_size):
            raise ValueError(f"load_state_dict: the state's lent is {lent!r}; expected None or [batch, samples] "
                             f"with batch from the state's step to {steps - 1} and samples from 0 to "
                             f"{self.batch_size}")

    # ---- an epoch -----------------------------------------------------------------------------------------------

    def _begin_epoch(self, epoch: int, first_step: int) -> None:
        """Go on with the batches built ahead when the loop asks for where the last epoch left off (the next
        epoch, as DataLoader users loop); otherwise a scheduler from `first_step` of `epoch`, and what an abandoned
        iteration or the look-ahead had built is dropped."""
        engine = self._require_engine()
        self._iterating = False
        steps = self.plan.steps_per_epoch
        start = Position(epoch, first_step, epoch * steps + first_step)
        built_ahead, self._built_ahead = self._built_ahead == start, None
        if not built_ahead:
            self._drain()
            assert self.info is not None
            engine.follow(Scheduler(self.plan, OPEN_ENDED, start, self.num_slots, False, 0, Path("."),
                                    self.info.rank, 1))
            self._ready: deque[Batch] = deque()
        self._books.enter(epoch, built_ahead, first_step == 0)
        self._pool, self._last_out = None, None
        self._position = start
        self._generation += 1
        self._carry_window()
        self._last_return: float | None = None
        engine.dispatch()

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The epoch is the one set when the first batch is asked for, not when iter() was called: Lightning
        takes its iterator first and calls sampler.set_epoch after."""
        epoch = self.epoch
        resume, self._resume = self._resume, None
        resumed = resume is not None and resume.epoch == epoch
        first_step = resume.step if resume is not None and resumed else 0
        if not resumed:  # the loan a saved state recorded belongs to the saved epoch's next step, not to this one
            self._resume_lent = None
        self._begin_epoch(epoch, first_step)
        generation = self._generation
        self._iterating = True
        try:
            steps = self.plan.steps_in(epoch)
            if first_step >= steps:  # a state of another world size that leaves this epoch no whole step (drop_last)
                self._position, self.epoch = Position(epoch + 1, 0, 0), epoch + 1
                return
            for step in range(first_step, steps):
                if generation != self._generation:
                    raise RuntimeError("this iterator was left for a newer iter() of the same stoker.Loader, which "
                                       "began its epoch again: a Loader feeds one iteration at a time (as a "
                                       "DataLoader with persistent workers); take batches from the newest iterator")
                images, labels, ids = self._serve(epoch, step, steps)
                self.batch_ids = ids
                self._record(epoch, step, ids)
                self._position = Position(epoch, step + 1, 0)
                if step + 1 == steps:
                    # Handed out the epoch's last batch: a loop that stops on len() (Lightning) never asks for the
                    # end, and a checkpoint taken now must resume at the next epoch. The next iter() is that epoch
                    # unless set_epoch says otherwise.
                    self._position = Position(epoch + 1, 0, 0)
                    self._pool = None  # nothing of this epoch is lent to the next
                    self.epoch = epoch + 1
                    self._built_ahead = Position(epoch + 1, 0, (epoch + 1) * self.plan.steps_per_epoch)
                self._last_return = time.perf_counter()
                yield images, labels
        finally:
            self._iterating = False

    def _serve(self, epoch: int, step: int, steps: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """This rank's batch `step`, never empty: a step none of whose files was usable (or a short last step with
        no sample for this rank) takes one sample from the next batch, whose rest is the next step's. Every
        sample is still handed out once, and every rank hands out len() batches. Only where no later batch has a
        sample left does a step repeat one already handed out this epoch (counted in `repeated_samples`)."""
        pool = self._pool
        if pool is None and self._resume_lent is not None:
            (through, lent), self._resume_lent = self._resume_lent, None
            pool = self._pull_lent(step, through, lent)
        elif pool is None or pool.through < step:
            pool = self._pull(step)
        borrowed = False
        while not len(pool.ids) and pool.through + 1 < steps:
            pool, borrowed = self._pull(pool.through + 1), True
        self._pool = pool  # pulled through `pool.through`, even when nothing of it is left to hand out
        if not len(pool.ids):
            return self._repeat_last(epoch, step)
        out, self._pool = pool.split(1 if borrowed else len(pool.ids))
        # A copy: a view would keep the whole batch alive, and the loop's in-place changes would reach the repeat.
        self._last_out = (out[0][-1:].clone(), out[1][-1:].clone(), out[2][-1:].copy())
        return out

    def _pull(self, step: int, drop: int = 0) -> _Pool:
        """This rank's batch `step` out of the ring, less its first `drop` samples (handed out before a save)."""
        batch = self._next_batch()
        assert batch.step == step, (batch, step)
        images, labels, ids = self._take(batch)
        return _Pool(images[drop:], labels[drop:], ids[drop:], step, drop)

    def _pull_lent(self, step: int, through: int, lent: int) -> _Pool:
        """After a resume whose save fell while batch `through` had lent `lent` samples to earlier steps: the
        batches up to it (empty, or their samples would not have been lent), less what was handed out, as the
        saved run held it."""
        for empty in range(step, through):
            self._pull(empty)
        return self._pull(through, lent)

    def _repeat_last(self, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        if self._last_out is None:
            raise StokerRunError(f"rank {self.info.rank if self.info else 0}: no file of epoch {epoch} up to its "
                                 f"last step was usable on this rank: there is no sample to hand out")
        self.repeated_samples += 1
        log.warning("epoch %d step %d: no file left that this rank could use; repeating sample %d (trained twice "
                    "this epoch, counted in summary()['repeated_samples']) so that no batch is empty", epoch, step,
                    int(self._last_out[2][0]))
        return self._last_out

    def _next_batch(self) -> Batch:
        """Wait for this rank's next batch, pumping the engine; the wait is what autoscaling reads."""
        entered = time.perf_counter()
        self._pump(0.0)
        while not self._ready:
            self._pump(POLL_S)
        batch = self._ready.popleft()
        self._account_wait(time.perf_counter() - entered, entered)
        return batch

    def _pump(self, timeout_s: float) -> None:
        """Producers' reports in, dead producers replaced, new work out, finished batches collected in order."""
        self._require_engine()
        self.driver.pump(timeout_s)  # a Loader's mailbox holds only the producers' messages
        for _, message in self.driver.deliverable():
            if isinstance(message, Batch):
                self._ready.append(message)
            # The scheduler's end-of-epoch Save is the trainer's business: a loader has nothing to save.

    def _take(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """Out of the slot into tensors of their own (a batch stays valid after the next one), slot handed back."""
        engine = self._require_engine()
        if self.feed is not None:
            images, labels, ids = self.feed.take(batch.slot, engine.release)
        else:
            images, labels, ids = self._host_copy(batch.slot)
        engine.dispatch()  # the freed slot is refilled while the user trains
        return images, labels, ids

    def _host_copy(self, slot: int | None) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        engine = self._require_engine()
        ring = engine.ring
        if slot is None:  # this rank has no sample in a short last step
            empty = torch.empty((0, 3, self.image_size, self.image_size), dtype=torch.uint8)
            return empty, torch.empty(0, dtype=torch.int64), np.zeros(0, dtype=np.int64)
        count = int(ring.counts[slot])
        images = torch.empty((count, self.image_size, self.image_size, 3), dtype=torch.uint8, pin_memory=self._pin)
        np.copyto(images.numpy(), ring.images[slot, :count])
        labels = torch.from_numpy(ring.labels[slot, :count].copy())
        ids = ring.ids[slot, :count].copy()
        engine.release(slot)
        return images.permute(0, 3, 1, 2), labels, ids  # NCHW, channels_last in memory

    def _drain(self) -> None:
        """Let the batches still being built (an iteration left before its end) finish: their slots are reused."""
        self._require_engine()
        self.driver.drain(3 * self.producer_timeout_s)

    def _require_engine(self) -> Engine:
        if self._engine is None or self.closed:
            raise RuntimeError("this stoker.Loader is closed" if self.closed else "iter() starts the loader")
        return self._engine

    # ---- measuring ----------------------------------------------------------------------------------------------

    def _carry_window(self) -> None:
        """A new iteration goes on with the open window, less the time the loop spent between the two (validation,
        a checkpoint; and the last batch's compute, which cannot be told apart from them): windows closed only
        inside an epoch never closed in epochs shorter than one, and the autoscaler then saw nothing at all."""
        if self._window is not None and self._step_end is not None:
            now = time.monotonic()
            self._window.started += now - self._step_end
            self._step_end = now  # an iter() that takes no batch: the next one shifts by its own gap only

    def _account_wait(self, wait_s: float, entered: float) -> None:
        if self._first_batch or self._window is None:  # waiting for the very first batch is start-up, as in the
            self._first_batch, wait_s = False, 0.0  # trainer
            self._window = _Window(time.monotonic())
        self._wait_s += wait_s  # a step that takes a sample from the next batch waits for two
        if self._compute_s is None:
            self._compute_s = entered - self._last_return if self._last_return is not None else 0.0
        self._window.wait_s += wait_s
        self._window.fill += self._require_engine().queue_fill()

    def _record(self, epoch: int, step: int, ids: np.ndarray) -> None:
        """The step's books (exactly once, time split), then, every SCALE_WINDOW_S, the autoscaler's turn."""
        now = self._step_end = time.monotonic()
        global_step = epoch * self.plan.steps_per_epoch + step
        self.stats.record_step(StepReport(0, epoch, step, global_step, len(ids), 0.0, self._wait_s,
                                          self._compute_s or 0.0, 0.0, ids, None,
                                          epoch_steps=self.plan.steps_in(epoch)), now)
        self._wait_s, self._compute_s = 0.0, None  # the next step's, over every batch it pulls
        window = self._window
        assert window is not None, "opened by the step's wait"
        window.samples += len(ids)
        window.steps += 1
        elapsed = now - window.started
        if elapsed >= SCALE_WINDOW_S:
            self._close_window(window, elapsed)
            self._window = _Window(now)

    def _close_window(self, window: _Window, elapsed_s: float) -> None:
        self.driver.close_window(elapsed_s, window.samples, window.steps, window.fill / max(1, window.steps),
                                 min(1.0, window.wait_s / elapsed_s), train_s=elapsed_s)


def _shut_down(driver: EngineDriver, events: _Events, owner_pid: int) -> None:
    """Stop event, producers joined (or killed), then the ring unlinked; in the process that started them only."""
    if os.getpid() != owner_pid:
        return
    driver.close()
    events.close()


def _open_data(data: str | Path | Any | None, image_size: int | None, copies: LocalCopies | None = None,
               columns: Columns = DEFAULT_COLUMNS) -> tuple[Any, int, tuple[str, ...], tuple[Skipped, ...]]:
    """The samples, the image size, the class names, and what the index refused."""
    if isinstance(data, PackedIndex):  # an index made for the purpose: eval's classes in a model's order, predict's
        return data, image_size or DEFAULT_IMAGE_SIZE, tuple(data.classes), tuple(data.skipped)
    if data is not None and not isinstance(data, (str, Path)):
        check_dataset(data)
        size = image_size or _first_item_size(data)
        return DatasetSource(data, size), size, (), ()
    root = data_location(data) if data is not None else builtin_dataset()[0]
    index = load_source(root, copies=copies, columns=columns)
    log_refused(index.skipped)
    size = image_size or (BUILTIN_IMAGE_SIZE if data is None else DEFAULT_IMAGE_SIZE)
    return index, size, tuple(index.classes), tuple(index.skipped)


def _first_item_size(dataset: Any) -> int:
    """Without image_size: the side of the first item's image (square HWC)."""
    image, _ = unpack_item(dataset[0], 0)
    shape = tuple(getattr(image, "shape", np.asarray(image).shape))
    if len(shape) != 3 or shape[0] != shape[1] or shape[2] != 3:
        raise ValueError(f"dataset[0]: the image has shape {shape}; expected a square HWC image (S, S, 3), or pass "
                         "image_size")
    return int(shape[0])


# The keywords a Loader takes beyond its own arguments: the settings that declare `loader=True`.
LOADER_SETTINGS = names_where("loader")


def _check_settings(data: Any, values: dict[str, Any]) -> dict[type, Any]:
    """Every setting before anything starts, by the sections `stoker train` checks them with: the same error for
    the same value. `values`: the arguments named as train's settings, and the keywords."""
    signature = inspect.signature(Loader.__init__).parameters
    unknown = sorted(set(values) - LOADER_SETTINGS - (set(signature) - {"self", "settings"}))
    if unknown:
        raise TypeError(f"stoker.Loader got unexpected setting(s) {', '.join(unknown)}; it takes "
                        f"{', '.join(sorted(LOADER_SETTINGS))} and metrics_file")
    if isinstance(data, (str, Path)):
        check_data_path("data", data_location(data))
    return {section: check_section(section, {name: value for name, value in values.items()
                                             if name in setting_names(section)})
            for section in (FeedSettings, DataSettings, DeviceSettings, RunSettings)}


def _check_own(drop_last: Any, metrics_file: Any) -> None:
    """The Loader's own arguments, which no command of stoker's shares."""
    if not isinstance(drop_last, bool):
        raise ValueError(f"drop_last={drop_last!r}: expected True or False")
    if metrics_file is not None and not (isinstance(metrics_file, (str, Path)) and Path(metrics_file).parent.is_dir()):
        raise ValueError(f"metrics_file={metrics_file!r}: expected None or a file in an existing folder")


def _check_device(device: str | torch.device | None) -> str | None:
    """The device setting as a string, checked against this machine: a GPU that is not there, or a device type
    the feed cannot serve (mps, meta), is an error here, not at the first iter() with the producers started."""
    if isinstance(device, torch.device):
        device = str(device)
    if device is None or device in ("auto", "cpu"):
        return device
    expected = "expected None, 'auto', 'cpu', 'cuda' or 'cuda:N'"
    try:
        parsed = torch.device(device) if isinstance(device, str) else None
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: {expected}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: no CUDA device is visible here (torch {torch.__version__}); use "
                         "'cpu', or 'auto' (a GPU where there is one)")
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: {torch.cuda.device_count()} CUDA device(s) are visible; {expected} "
                         "with N below that")
    return device

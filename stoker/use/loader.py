"""`stoker.Loader`: stoker's producers feeding a training loop of one's own (DDP, Lightning, accelerate).

One Loader per rank, in the user's training process. It drives the same engine as `stoker train` (the ring, the
producer pool, the scheduler's order of work, the autoscaler): batch k of epoch e on rank r is a pure function of
(seed, e, k, r), whichever producer builds it and however many there are, so every rank gets its own disjoint part
of each epoch, the same bytes with 1 or 16 producers, and a resume from `state_dict()` continues exactly. Rank
and world size are read at the first `iter()`, never in the constructor: Lightning builds its loaders before the
process group exists. The producers start at the first `iter()` and live until `close()` (or the process) ends.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import numpy as np
import torch

from stoker.common import zygote
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
    default_of,
    names_where,
    setting_names,
)
from stoker.common.main_guard import check_main_guard, may_start_children
from stoker.common.positions import Position
from stoker.common.procs import POLL_S
from stoker.common.urls import data_location
from stoker.data.formats.builtin_data import builtin_dataset
from stoker.data.formats.folders import Skipped
from stoker.data.formats.parquet import DEFAULT_COLUMNS, Columns
from stoker.data.formats.user_dataset import DatasetSource, check_dataset, unpack_item
from stoker.data.index import PackedIndex
from stoker.data.pixels import pixels_change
from stoker.data.sources import load_source, local_copies, log_refused
from stoker.data.transports.object_store import LocalCopies
from stoker.observe.diagnosis import LOADER_ARGUMENTS, TimeSplit, diagnose
from stoker.observe.metrics import MetricsLog, RunStats
from stoker.pipeline.driver import EngineDriver, Measure, check_room, producer_fields
from stoker.pipeline.engine import EngineSpec, HostShare, Samples
from stoker.pipeline.messages import Batch, StepReport
from stoker.pipeline.scheduler import Scheduler
from stoker.training.streams import ops_for
from stoker.training.to_device import DeviceLoader
from stoker.use.lent_batches import LentBatches
from stoker.use.rank_gpu import rank_gpu
from stoker.use.resume_position import MAX_EPOCH, ResumePosition

log = logging.getLogger(__name__)

OPEN_ENDED = 1 << 40  # the scheduler's last epoch: the ring, not the epoch, bounds what is built ahead


def check_epoch(epoch: Any) -> int:
    """`set_epoch`'s epoch as an int from 0 to MAX_EPOCH; a ValueError naming what was given otherwise."""
    if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or not 0 <= epoch <= MAX_EPOCH:
        raise ValueError(f"set_epoch: {epoch!r}; expected an integer epoch from 0 to {MAX_EPOCH}")
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
    """The rank's own device, never simply cuda:0 (see `rank_gpu.rank_gpu` for 'cuda')."""
    if device is None:
        return None
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device("cuda", rank_gpu()) if device == "cuda" else torch.device(device)
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r} is {resolved}, but {torch.cuda.device_count()} CUDA device(s) are "
                         "visible (LOCAL_RANK and CUDA_VISIBLE_DEVICES say which this rank gets)")
    return resolved


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


class Loader:
    """Batches of (images, labels) for one rank: on `device` as normalized float NCHW (channels_last), or with
    `device=None` as uint8 NCHW on the host (pinned when CUDA is there). `data`: what `stoker train --data` takes
    (an ImageFolder root, WebDataset-layout shards; None for the built-in set), or a map-style dataset whose items
    are (HWC uint8 image of `image_size`, integer label)."""

    def __init__(self, data: str | Path | Any | None, batch_size: int, image_size: int | None = None,
                 augment: Augment = "standard", seed: int = 0, device: str | torch.device | None = "auto",
                 drop_last: bool = False, *, producers: int | Literal["auto"] = default_of("producers"),
                 min_producers: int = default_of("min_producers"), max_producers: int | None = None,
                 producer_timeout_s: float = default_of("producer_timeout_s"),
                 max_bad_fraction: float = default_of("max_bad_fraction"),
                 channels_last: bool = default_of("channels_last"), image_column: str | None = None,
                 label_column: str | None = None, cache_dir: str | Path | None = None, cache_size: str | None = None,
                 image_size_ramp: str | None = None, metrics_file: str | Path | None = None) -> None:
        """Every argument but `data`, `device` and `metrics_file` is `stoker train`'s setting of the same name, with
        its default, checked by the same section (the same value gets the same message). `device`: None, 'auto',
        'cpu', 'cuda' or 'cuda:N'. `metrics_file`: where the engine's events go as JSON lines."""
        # The arguments that are settings, by name: LOADER_SETTINGS are the fields that declare `loader=True`.
        sections = _check_settings(data, {name: value for name, value in locals().items() if name in LOADER_SETTINGS})
        _check_metrics_file(metrics_file)
        self._keep_settings(sections, _check_device(device), metrics_file)
        self._open(data, sections[DataSettings])  # every user error is raised before a process starts
        # The producers' zygote starts now: it imports their modules while the script builds its model, and the
        # first iter() only forks.
        lease = _early_zygote(data, sys._getframe(1))
        self._zygote_hold = weakref.finalize(self, _release_in, lease, os.getpid())

    def _open(self, data: str | Path | Any | None, data_settings: DataSettings) -> None:
        """The samples, and this loader's books and place in them."""
        copies = local_copies(data_settings.cache_dir, data_settings.cache_bytes)
        columns = Columns(data_settings.image_column, data_settings.label_column)
        largest = data_settings.resolved_image_size if data_settings.size_ramp else data_settings.image_size
        self.source, self.image_size, self.classes, self.refused = _open_data(data, largest, copies, columns)
        if data_settings.size_ramp is not None and isinstance(self.source, DatasetSource):
            raise ValueError(f"image_size_ramp={data_settings.image_size_ramp!r}: a map-style dataset's items keep "
                             "their own size; the ramp resizes decoded files (a folder, shards or Parquet)")
        self.paths: Sequence[str] = self.source.paths  # what names position i: a file, SHARD.tar:KEY, Dataset[i]
        self.sampler = EpochSampler(self)
        self.epoch = 0
        self.position = ResumePosition(len(self.paths), self.batch_size, self.seed, self.drop_last)
        self._lent = LentBatches()
        self.info: RankInfo | None = None
        self._engine: EngineDriver | None = None  # the engine's face, from the first iter()
        self._finalizer: weakref.finalize | None = None
        self.batch_ids = np.zeros(0, dtype=np.int64)  # dataset positions of the last batch handed out
        self.stats = RunStats(1, len(self.paths), 0)  # this rank's books: steps, time split, exactly once
        for item in self.refused:
            self.stats.skipped.setdefault(item.path, item.reason)
        self._iterating = False
        self._built_ahead: Position | None = None  # where the engine's scheduler goes on, once an epoch ends whole
        self._generation = 0  # of the live iterator: an older one refuses to go on
        self._step_end: float | None = None  # monotonic, when the last batch was handed out
        self._wait_s: float = 0.0  # of the step being served: its waits (a borrowing step waits for two)
        self._compute_s: float | None = None  # and the loop's time before it, read at its first wait
        self.closed = False

    def _keep_settings(self, sections: dict[type, Any], device: str | None, metrics_file: str | Path | None) -> None:
        """The checked settings, as the sections read them ("8" is 8)."""
        feed, data_settings = sections[FeedSettings], sections[DataSettings]
        self.batch_size = feed.batch_size
        self.augment: Augment = data_settings.augment
        self.seed = sections[RunSettings].seed
        self.producers = feed.producers
        self.min_producers = feed.min_producers
        self.max_producers = feed.max_producers
        self.device_setting = device
        self.drop_last = feed.drop_last
        self.channels_last = sections[DeviceSettings].channels_last
        self.sections = feed, data_settings  # the engine is built from them at the first iter()
        self.metrics_file = Path(metrics_file) if metrics_file is not None else None

    # ---- what DataLoader users call ------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        self.epoch = check_epoch(epoch)

    def __len__(self) -> int:
        """Batches per epoch on every rank: the same on each, whatever files turn out unusable (the epoch a state of
        another world size resumed counts its batches before the resume as this world's plan numbers them)."""
        return self.position.resume_plan(self._world()).steps_in(self.epoch)

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

    @property
    def repeated_samples(self) -> int:
        """Samples handed out twice to keep a batch from being empty."""
        return self._lent.repeated_samples

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch is (epoch, step), what it is a function of, and the files skipped so far."""
        return {**self.position.state(self._world()), "lent": self._lent.saved(self.position.next.step),
                "skipped": [{"path": p, "reason": r} for p, r in self.stats.skipped.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved batch: the next `iter()` of the saved epoch starts there (exact resume)."""
        self.position.check(state, self._world())
        if (change := pixels_change(state.get("pixels"))) is not None:
            log.warning("load_state_dict: the state was %s", change)
        self.epoch = self.position.load(state, self._world())
        if self.info is not None:
            self.plan = self.position.resume_plan(self.info.world_size)
        lent = state.get("lent")
        self._lent.restored = (int(lent[0]), int(lent[1])) if lent is not None else None
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
        self._zygote_hold()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- starting -----------------------------------------------------------------------------------------------

    def _world(self) -> int:
        """The world size: read at the first iter(), before it from torch.distributed or the environment."""
        return self.info.world_size if self.info is not None else read_rank()[1]

    def _start(self) -> None:
        """At the first iter(): rank, world size and device, then the ring and the producers."""
        if self._engine is not None:
            return
        rank, world = read_rank()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        self.info = RankInfo(rank, world, local_world, resolve_device(self.device_setting))
        self.plan = self.position.resume_plan(world)
        if self.plan.steps_per_epoch == 0:
            raise ValueError(f"batch_size={self.batch_size} x {world} ranks is more than the {len(self.source.paths)}"
                             " samples, with drop_last=True: no batch at all")
        host = HostShare.measure(["cuda" if self._on_gpu() else "cpu"], local_world)  # this rank's share
        spec = EngineSpec.from_sections(*self.sections, self.seed, Samples(self.source, image_size=self.image_size),
                                        host)  # the ring sized from the producers' ceiling
        self.num_slots = spec.build.num_slots
        check_room(spec)
        self.driver = EngineDriver(spec, Measure())  # one loop: its waits are what the autoscaler reads
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
        self._lent.begin_epoch()
        self.position.next = start
        self._generation += 1
        self._carry_window()
        self._last_return: float | None = None
        engine.dispatch()

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The epoch is the one set when the first batch is asked for, not when iter() was called: Lightning
        takes its iterator first and calls sampler.set_epoch after."""
        epoch = self.epoch
        resumed = self.position.take_resume(epoch)
        if resumed is None:  # the loan a saved state recorded belongs to the saved epoch's next step, not to this one
            self._lent.restored = None
        first_step = resumed or 0
        self._begin_epoch(epoch, first_step)
        generation = self._generation
        self._iterating = True
        try:
            steps = self.plan.steps_in(epoch)
            if first_step >= steps:  # a state of another world size that leaves this epoch no whole step (drop_last)
                self.position.next, self.epoch = Position(epoch + 1, 0, 0), epoch + 1
                return
            for step in range(first_step, steps):
                if generation != self._generation:
                    raise RuntimeError("this iterator was left for a newer iter() of the same stoker.Loader, which "
                                       "began its epoch again: a Loader feeds one iteration at a time (as a "
                                       "DataLoader with persistent workers); take batches from the newest iterator")
                images, labels, ids = self._lent.serve(epoch, step, steps, self._take_step,
                                                       self.info.rank if self.info else 0)
                self.batch_ids = ids
                self._record(epoch, step, ids)
                self.position.next = Position(epoch, step + 1, 0)
                if step + 1 == steps:
                    # Handed out the epoch's last batch: a loop that stops on len() (Lightning) never asks for the
                    # end, and a checkpoint taken now must resume at the next epoch. The next iter() is that epoch
                    # unless set_epoch says otherwise.
                    self.position.next = Position(epoch + 1, 0, 0)
                    self._lent.end_epoch()
                    self.epoch = epoch + 1
                    self._built_ahead = Position(epoch + 1, 0, (epoch + 1) * self.plan.steps_per_epoch)
                self._last_return = time.perf_counter()
                yield images, labels
        finally:
            self._iterating = False

    def _take_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """This rank's batch `step` out of the ring, as tensors of its own."""
        batch = self._next_batch()
        assert batch.step == step, (batch, step)
        return self._take(batch)

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
            images, labels, ids = self.feed.take(batch.slot, engine.release, epoch=batch.epoch)
        else:
            images, labels, ids = self._host_copy(batch.slot, batch.epoch)
        engine.dispatch()  # the freed slot is refilled while the user trains
        return images, labels, ids

    def _host_copy(self, slot: int | None, epoch: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        engine = self._require_engine()
        ring = engine.ring
        side = ring.spec.side("train", epoch)  # the epoch's, with image_size_ramp
        if slot is None:  # this rank has no sample in a short last step
            empty = torch.empty((0, 3, side, side), dtype=torch.uint8)
            return empty, torch.empty(0, dtype=torch.int64), np.zeros(0, dtype=np.int64)
        count = int(ring.counts[slot])
        images = torch.empty((count, side, side, 3), dtype=torch.uint8, pin_memory=self._pin)
        np.copyto(images.numpy(), ring.images_of("train", epoch)[slot, :count])
        labels = torch.from_numpy(ring.labels[slot, :count].copy())
        ids = ring.ids[slot, :count].copy()
        engine.release(slot)
        return images.permute(0, 3, 1, 2), labels, ids  # NCHW, channels_last in memory

    def _drain(self) -> None:
        """Let the batches still being built (an iteration left before its end) finish: their slots are reused."""
        self._require_engine()
        self.driver.drain()

    def _require_engine(self) -> EngineDriver:
        if self._engine is None or self.closed:
            raise RuntimeError("this stoker.Loader is closed" if self.closed else "iter() starts the loader")
        return self._engine

    # ---- measuring ----------------------------------------------------------------------------------------------

    def _carry_window(self) -> None:
        """A new iteration goes on with the open window, less the time the loop spent between the two (validation,
        a checkpoint; and the last batch's compute, which cannot be told apart from them): windows closed only
        inside an epoch never closed in epochs shorter than one, and the autoscaler then saw nothing at all."""
        if self._engine is not None and self._step_end is not None:
            now = time.monotonic()
            self.driver.shift_window(now - self._step_end)
            self._step_end = now  # an iter() that takes no batch: the next one shifts by its own gap only

    def _account_wait(self, wait_s: float, entered: float) -> None:
        if self._first_batch or self.driver.window is None:  # waiting for the very first batch is start-up, as in
            self._first_batch, wait_s = False, 0.0  # the trainer
            self.driver.open_window(time.monotonic())
        self._wait_s += wait_s  # a step that takes a sample from the next batch waits for two
        if self._compute_s is None:
            self._compute_s = entered - self._last_return if self._last_return is not None else 0.0
        self._require_engine()
        self.driver.note_queue()  # the step's wait is in its report (`_record`)

    def _record(self, epoch: int, step: int, ids: np.ndarray) -> None:
        """The step's books (exactly once, time split), then, every SCALE_WINDOW_S, the autoscaler's turn."""
        now = self._step_end = time.monotonic()
        global_step = epoch * self.plan.steps_per_epoch + step
        report = StepReport(0, epoch, step, global_step, len(ids), 0.0, self._wait_s, self._compute_s or 0.0, 0.0,
                            ids, None, epoch_steps=self.plan.steps_in(epoch))
        self.stats.record_step(report, now)
        self._wait_s, self._compute_s = 0.0, None  # the next step's, over every batch it pulls
        self.driver.note_step(report)
        self.driver.tick(now)


def _shut_down(driver: EngineDriver, events: _Events, owner_pid: int) -> None:
    """Stop event, producers joined (or killed), then the ring unlinked; in the process that started them only."""
    if os.getpid() != owner_pid:
        return
    driver.close()
    events.close()


def _early_zygote(data: str | Path | Any | None, caller: FrameType | None) -> zygote.Lease:
    """A hold on the zygote this loader's producers will be forked from, started now; none where the first iter()
    will refuse to start processes (`check_main_guard`)."""
    if not may_start_children(caller):
        return zygote.Lease()
    own = data is None or isinstance(data, (str, Path, PackedIndex))  # else a user's dataset (`_open_data`)
    return zygote.for_producers(user_dataset=not own).acquire()


def _release_in(lease: zygote.Lease, owner_pid: int) -> None:
    """Gives the hold back in the process that took it only: a fork's copy of the loader holds nothing."""
    if os.getpid() == owner_pid:
        lease.release()


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


# The Loader's arguments that are `stoker train`'s settings: the fields that declare `loader=True`.
LOADER_SETTINGS = names_where("loader")


def _check_settings(data: Any, values: dict[str, Any]) -> dict[type, Any]:
    """Every setting before anything starts, by the sections `stoker train` checks them with: the same error for
    the same value. `values`: the Loader's arguments that are settings."""
    if isinstance(data, (str, Path)):
        check_data_path("data", data_location(data))
    return {section: check_section(section, {name: value for name, value in values.items()
                                             if name in setting_names(section)})
            for section in (FeedSettings, DataSettings, DeviceSettings, RunSettings)}


def _check_metrics_file(metrics_file: Any) -> None:
    """The Loader's own argument, which no command of stoker's shares."""
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

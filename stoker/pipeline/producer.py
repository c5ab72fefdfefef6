"""Producer process: reads, decodes and augments the batches it is given, straight into shared-memory slots.

A producer decides nothing: the controller says which samples go into which slot; the augmentation of each sample
is a pure function of (seed, epoch, sample id). It keeps no state across batches, so any producer can rebuild any
batch, and a bad image costs one sample, never the producer.
"""

from __future__ import annotations

import functools
import os
import queue
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import astuple, dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from stoker.common import faults
from stoker.common.procs import POLL_S, ChildError, ParentWatch, exit_with_parent, name_process
from stoker.data.formats.folders import Skipped
from stoker.data.formats.user_dataset import DatasetSource
from stoker.data.index import PackedIndex, read_file
from stoker.data.pixels.imaging import Augment, StageClock, UnusableImage, load_into, make_decode_warnings_errors
from stoker.data.transports import object_store
from stoker.pipeline.plan import BatchPlan, sample_rng
from stoker.pipeline.ring import RingSpec, SlotRing


class SampleSource(Protocol):
    """One split: `paths[i]` names sample i in messages, `labels[i]` is its class, `read(i)` its bytes."""

    @property
    def paths(self) -> Sequence[str]: ...  # read-only: a frozen Source and PackedIndex's names both qualify

    @property
    def labels(self) -> np.ndarray: ...

    def read(self, sample_id: int) -> bytes: ...


@dataclass(frozen=True)
class Source:
    """Files and their labels held in memory (tests, benchmarks); runs use `index.PackedIndex`."""

    paths: tuple[str, ...]
    labels: np.ndarray

    def read(self, sample_id: int) -> bytes:
        return read_file(self.paths[sample_id])


@dataclass(frozen=True)
class ProducerSetup:
    ring: RingSpec
    train: SampleSource
    val: SampleSource | None
    augment: Augment
    seed: int
    transport_only: bool = False  # `stoker bench pipeline --transport`: write a ready-made image, decode nothing


@dataclass(frozen=True)
class Part:
    """Build part of a batch: samples `first` to `stop` of `batch_plan` into the same rows of `slot`, compacted over
    unusable files from row `first` on (several producers fill one slot at once, each its own rows). A part with
    `compact` builds nothing: it moves each part's rows down so the slot holds its samples contiguously."""

    part_id: int
    batch_plan: BatchPlan
    slot: int
    skip: dict[int, str] = field(default_factory=dict)  # sample id -> why: a previous producer died on it
    first: int = 0
    stop: int | None = None  # None: to the end of the batch
    compact: tuple[tuple[int, int], ...] = ()  # (first row, count) of every part, in plan order

    @property
    def end(self) -> int:
        return len(self.batch_plan.sample_ids) if self.stop is None else self.stop

    @property
    def part_key(self) -> tuple:
        return (*self.batch_plan.key, self.first)


@dataclass(frozen=True)
class PartDone:
    producer: int
    part_id: int
    count: int
    skipped: dict[int, Skipped]  # sample id -> the file and why it could not be used
    busy_s: float
    read_s: float = 0.0  # of busy_s, the time spent reading files: storage, not the CPU (the verdict tells them apart)
    cost: FeedCost | None = None  # the CPU the part took, by stage (None: a compaction, or nothing decoded)


@dataclass(frozen=True)
class ProducerFailed:
    producer: int
    error: ChildError


STATUS_IDLE = -1
PRODUCER_NICENESS = 5


def producer_main(producer: int, setup: ProducerSetup, parts, outbox, stop) -> None:
    """Process entry point: build batches until told to stop, retired (a None part) or orphaned."""
    name_process(f"stoker producer {producer}")
    exit_with_parent()
    make_decode_warnings_errors()
    # Under CPU contention the consumers go first: a late consumer holds up a device and, through the
    # averaging collective, every other one; a late producer only eats into the batches queued ahead.
    nice_producer(os.getpid())
    ring = SlotRing.attach(setup.ring)
    try:
        _serve(producer, setup, ring, parts, outbox, stop)
    except BaseException as error:  # carried to the controller as a value, never lost
        outbox.send(ProducerFailed(producer, ChildError.capture(f"producer {producer}", "building batches", error)))
    finally:
        object_store.stop_reading()
        ring.close()


def nice_producer(pid: int) -> None:
    """At PRODUCER_NICENESS, never nicer twice: the pool sets it as soon as the process exists, so that a producer's
    imports (half a second of a core each; a jump starts several) do not take the cores from the consumers and the
    controller either; the producer sets it again in case that came too late."""
    try:
        if os.getpriority(os.PRIO_PROCESS, pid) < PRODUCER_NICENESS:
            os.setpriority(os.PRIO_PROCESS, pid, PRODUCER_NICENESS)
    except OSError:  # the process is already gone: its loss is seen by the pool's check
        pass


def _serve(producer: int, setup: ProducerSetup, ring: SlotRing, parts, outbox, stop) -> None:
    watch = ParentWatch()
    status = ring.status[producer]
    for source in (setup.train, setup.val):
        if isinstance(source, DatasetSource):
            source.load()  # idle meanwhile: a start-up, not a hang on the first item
    previous: Part | None = None
    held: deque[Part | None] = deque()  # parts taken from the queue ahead of time, their reads already started
    while not stop.is_set() and not watch.parent_gone():
        status[:] = (STATUS_IDLE, 0, time.monotonic_ns())
        if not held:
            try:
                held.append(parts.get(timeout=POLL_S))
            except queue.Empty:
                continue
            _read_ahead(held[0], setup)
        _take_ahead(parts, held, setup)
        part = held.popleft()
        if part is None:
            return
        started = time.perf_counter()
        if previous is not None and faults.wants("producer-batch", "repeat-batch", f"part={part.part_id};"):
            part = replace(part, batch_plan=previous.batch_plan, first=previous.first, stop=previous.stop)
        previous = part
        skipped: dict[int, Skipped] = {}
        reads, stages, cpu = ReadClock(), StageClock(), time.process_time()
        if part.compact:
            count = compact_slot(part, ring, status)
        else:
            try:
                count, skipped = build_batch(part, setup, ring, status, reads, stop, stages)
            except StopRequested:  # the part is left: its slot is unlinked or rebuilt, nothing waits for it
                return
        cost = None if part.compact or setup.transport_only else FeedCost(
            count, reads.cpu, stages.draw, stages.decode, stages.resize, stages.augment, time.process_time() - cpu)
        faults.maybe_inject("producer-result", f"part={part.part_id};", outbox)
        outbox.send(PartDone(producer, part.part_id, count, skipped, time.perf_counter() - started, reads.seconds,
                             cost))


@dataclass
class ReadClock:
    """Seconds spent reading files (opening and reading their bytes), apart from decoding them, and the CPU
    seconds of it."""

    seconds: float = 0.0
    cpu: float = 0.0

    def read(self, source: SampleSource, sample_id: int) -> bytes:
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            return source.read(sample_id)
        finally:
            self.seconds += time.perf_counter() - started
            self.cpu += time.thread_time() - cpu


@dataclass(frozen=True)
class FeedCost:
    """CPU seconds a producer spent on `images` images, by stage: reading files, making each sample's generator,
    decoding, crop and resize into the ring's slot, augmenting; `total` is the process's CPU time over the part (the
    OS's count): the stages and the rest (the bookkeeping, the clocks themselves, other threads)."""

    images: int = 0
    read: float = 0.0
    draw: float = 0.0
    decode: float = 0.0
    resize: float = 0.0
    augment: float = 0.0
    total: float = 0.0

    def __add__(self, other: FeedCost) -> FeedCost:
        return FeedCost(*(a + b for a, b in zip(astuple(self), astuple(other))))


class StopRequested(Exception):
    """The stop event was set while a part was being built."""


def _take_ahead(parts, held: deque[Part | None], setup: ProducerSetup) -> None:
    """Take the parts already queued for this producer (at most its in-flight share) and start their reads together:
    where reads wait on a network, the next part's round trip passes while this one decodes."""
    while held[-1] is not None:
        try:
            held.append(parts.get_nowait())
        except queue.Empty:
            return
        _read_ahead(held[-1], setup)


def _read_ahead(part: Part | None, setup: ProducerSetup) -> None:
    if part is None or part.compact:
        return
    source = setup.train if part.batch_plan.kind == "train" else setup.val
    if isinstance(source, PackedIndex) and not setup.transport_only:
        source.read_ahead([int(i) for i in part.batch_plan.sample_ids[part.first:part.end] if int(i) not in part.skip])


def build_batch(part: Part, setup: ProducerSetup, ring: SlotRing, status: np.ndarray, reads: ReadClock | None = None,
                stop: Any = None, stages: StageClock | None = None) -> tuple[int, dict[int, Skipped]]:
    """Write the part's samples into its rows of the slot, compacting over unusable files; returns (count, skipped
    by id). A part that is the whole batch also sets the slot's count; for parts the engine does (`parts.py`)."""
    batch_plan = part.batch_plan
    if setup.transport_only:
        return _copy_ready_made(part, ring), {}
    source = setup.train if batch_plan.kind == "train" else setup.val
    assert source is not None, "validation work is scheduled only when there is a validation split"
    augment = setup.augment if batch_plan.kind == "train" else "none"
    images = ring.images_of(batch_plan.kind, batch_plan.epoch)[part.slot]  # at its epoch's side (`--image-size-ramp`)
    labels, ids = ring.labels[part.slot], ring.ids[part.slot]
    loaded = ring.loaded_of(batch_plan.kind)
    reads = reads or ReadClock()
    count = part.first
    skipped: dict[int, Skipped] = {}
    for position in range(part.first, part.end):
        # Between samples, not between parts only: a part of 256 large JPEGs is seconds of decoding, and a close
        # that waited for it killed the producer at its deadline.
        if stop is not None and stop.is_set():
            raise StopRequested
        sample_id = int(batch_plan.sample_ids[position])
        status[:] = (part.part_id, position, time.monotonic_ns())
        if sample_id in part.skip:
            skipped[sample_id] = Skipped(source.paths[sample_id], part.skip[sample_id])
            continue
        if faults.armed():
            faults.maybe_inject("producer", source.paths[sample_id])
        # Drawing a generator costs more than decoding a small PNG: only augmentations that draw get one.
        drawing = time.thread_time()
        rng = sample_rng(setup.seed, batch_plan.kind, batch_plan.epoch, sample_id) if augment != "none" else None
        if stages is not None:
            stages.draw += time.thread_time() - drawing
        try:
            if isinstance(source, DatasetSource):  # the user's own __getitem__, seeded per sample
                labels[count] = source.fill(sample_id, images[count], setup.seed, batch_plan.epoch)
            else:
                data = reads.read(source, sample_id)
                load_into(data, images[count], augment, rng, stages, checked_before=loaded[sample_id] == len(data))
                loaded[sample_id] = len(data)
                labels[count] = source.labels[sample_id]
        except UnusableImage as error:
            skipped[sample_id] = Skipped(source.paths[sample_id], str(error))
            continue
        ids[count] = sample_id
        count += 1
    if _whole_batch(part):
        ring.counts[part.slot] = count
    return count - part.first, skipped


def _whole_batch(part: Part) -> bool:
    return part.first == 0 and part.end == len(part.batch_plan.sample_ids)


def compact_slot(part: Part, ring: SlotRing, status: np.ndarray) -> int:
    """Move every part's rows down behind the previous part's, in plan order; returns the slot's count. Rows only
    move down and each part's rows are read before any later part's are written, so one pass suffices."""
    status[:] = (part.part_id, part.compact[0][0], time.monotonic_ns())
    row = 0
    images = ring.images_of(part.batch_plan.kind, part.batch_plan.epoch)[part.slot]
    for first, count in part.compact:
        if first != row:
            for array in (images, ring.labels[part.slot], ring.ids[part.slot]):
                array[row:row + count] = array[first:first + count]  # numpy copies overlapping ranges safely
        row += count
    ring.counts[part.slot] = row
    return row


def _copy_ready_made(part: Part, ring: SlotRing) -> int:
    """Fill the slot from an image made once per process: what is left to time is slots and queues. Every sample
    is written from one small source, as the decoder writes each sample from the image it just made; a whole
    ready-made batch as the source would add a 9.6 MB read from memory per batch that no real producer does
    (measured: the producer's part of a batch took 0.56 ms that way, 0.30 ms this way)."""
    images = ring.images_of(part.batch_plan.kind, part.batch_plan.epoch)[part.slot]
    rows = slice(part.first, part.end)
    np.copyto(images[rows], _ready_made(images.shape[1:]))
    ring.labels[part.slot, rows] = 0
    ring.ids[part.slot, rows] = part.batch_plan.sample_ids[rows]
    if _whole_batch(part):
        ring.counts[part.slot] = part.end
    return part.end - part.first


@functools.cache
def _ready_made(shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)

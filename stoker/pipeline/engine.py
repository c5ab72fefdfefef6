"""The engine: the slot ring, the producer pool, the scheduler's order of work and the autoscaler, driven as one.

Two drivers run it, through `driver.EngineDriver` (its only face), and nothing else has a copy of any part: the
controller (`stoker train`: N consumer processes and averaging) and `stoker.Loader` (one rank of a user's own
training loop, in the user's process); both describe it with `EngineSpec.from_sections`. The driver chooses the
scheduler (what to build and in which order), hands over what `deliverable()` yields, gives slots back with
`release()`, passes the producers' messages to `handle()`, calls `check_producers()` on every pass and `autoscale()`
when a scaling window closes; the engine routes parts to producers, re-issues the work of lost ones, and keeps the
exactly-once books through `Accounting`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from stoker.common.choices import SizeRamp
from stoker.common.config import DataSettings, FeedSettings
from stoker.common.devices import available_cores
from stoker.common.memory import available_memory
from stoker.common.procs import PRODUCER_MEMORY, Mailbox, StokerRunError
from stoker.data.formats.folders import Skipped
from stoker.data.formats.user_dataset import DatasetSource
from stoker.data.index import PackedIndex
from stoker.data.transports.object_store import CopyFiller
from stoker.pipeline.autoscaler import (
    JUMP_MAX,
    MEMORY_SHARE,
    OVERSUBSCRIBE,
    READ_BOUND,
    STARTUP_WINDOWS,
    Autoscaler,
    Window,
    default_ceiling,
    start_count,
    static_budget,
)
from stoker.pipeline.gauges import EventLog, ProducerGauges
from stoker.pipeline.parts import Assembler, most_parts_in_flight, parts_per_batch
from stoker.pipeline.pool import MAX_IN_FLIGHT, ProducerPool, parts_held
from stoker.pipeline.producer import Part, PartDone, ProducerFailed, ProducerSetup, SampleSource
from stoker.pipeline.ring import RingSpec, SlotRing, check_shm_space, sweep_dead_segments
from stoker.pipeline.scheduler import Scheduler

log = logging.getLogger(__name__)

MIN_SLOTS = 4  # a ring sized from the producers' ceiling: at least the trainer's slots_per_consumer
# Whole batches each producer may hold where the ring is sized from the ceiling (a Loader's). A Loader reads
# completions and hands out work only inside next(): while the user's loop trains or waits in DDP's all_reduce, a
# producer holding one batch (MAX_IN_FLIGHT parts) runs dry; DataLoader's workers keep 2 batches each queued.
QUEUED_BATCHES = 2


class Accounting(Protocol):
    """The exactly-once books (`observe.metrics.RunStats` is one): what was scheduled, and what was skipped."""

    skipped: dict[str, str]

    def expect(self, epoch: int, sample_ids: np.ndarray) -> None: ...

    def record_skipped(self, epoch: int | None, skipped: dict[int, Skipped]) -> None: ...


@dataclass(frozen=True)
class HostShare:
    """What of this machine one engine's producers may use: its cores, the producers the cores that training
    leaves free run (`static_budget`), and its memory in bytes (None: unbounded)."""

    cores: int
    fits: int
    memory: int | None

    @classmethod
    def measure(cls, trains_on: list[str], sharers: int = 1) -> HostShare:
        """This machine's share for one of `sharers` engines (a Loader per rank) whose consumers train on the
        devices `trains_on` ("cpu", "cuda:0", ...)."""
        cores = max(1, available_cores() // max(1, sharers))
        fits = static_budget(trains_on, cores)
        memory = available_memory()
        return cls(cores, fits, memory // max(1, sharers) if memory is not None else None)


@dataclass(frozen=True)
class ProducerCounts:
    """How many producers: at the start; the most alive at once (the ring has a status row for each); what fits
    the cores the training processes leave free; the least auto keeps; whether the autoscaler moves the count."""

    initial: int
    budget: int
    fits: int
    minimum: int
    auto: bool
    cores: int = 0
    default_start: bool = False  # auto started where `start_count` says, not where the user did

    @classmethod
    def from_sections(cls, feed: FeedSettings, host: HostShare, ring_parts: int | None = None) -> ProducerCounts:
        """`ring_parts`: the parts the ring holds in flight, which bound auto's default ceiling (None where the ring
        is sized from the ceiling), as `default_ceiling` takes them with the host's memory."""
        if feed.producers != "auto":
            return cls(feed.producers, feed.producers, host.fits, feed.min_producers, auto=False, cores=host.cores)
        budget = feed.max_producers or default_ceiling(max(host.fits, feed.min_producers), host.cores, ring_parts,
                                                       host.memory, PRODUCER_MEMORY)
        start = feed.initial_producers or start_count(feed.min_producers, host.cores)
        return cls(min(start, budget), budget, host.fits, feed.min_producers, auto=True, cores=host.cores,
                   default_start=feed.initial_producers is None)

    def autoscaler(self) -> Autoscaler | None:
        if not self.auto:
            return None
        return Autoscaler(self.minimum, min(self.fits, self.budget), self.budget, STARTUP_WINDOWS, self.cores,
                          self.initial if self.default_start else None)


READ_SETTLED = 0.35  # under this share of their busy time reading, producers that waited on reads no longer do


def check_ring_space(num_slots: int, batch_size: int, image_size: int, num_status: int,
                     val_image_size: int | None = None, samples: tuple[int, int] = (0, 0)) -> None:
    """Before any process starts: a /dev/shm that cannot hold the ring is a user error, not a bus error."""
    spec = RingSpec("check", num_slots, batch_size, image_size, num_status, val_image_size,
                    train_samples=samples[0], val_samples=samples[1])
    check_shm_space(spec.nbytes)


@dataclass(frozen=True)
class Build:
    """What the engine builds: the samples, how they are augmented and into what ring, and how a producer's
    trouble is judged."""

    train: SampleSource
    val: SampleSource | None
    augment: Any
    seed: int
    batch_size: int
    image_size: int
    num_slots: int
    producer_timeout_s: float
    max_bad_fraction: float
    val_image_size: int | None = None
    max_in_flight: int = MAX_IN_FLIGHT  # parts a producer may hold
    ramp: SizeRamp | None = None  # training's side by epoch (`--image-size-ramp`), `image_size` its largest

    @property
    def total_files(self) -> int:
        return sum(self.sample_counts)

    @property
    def sample_counts(self) -> tuple[int, int]:
        """The training and validation sources' sizes."""
        return len(self.train.paths), len(self.val.paths) if self.val is not None else 0


@dataclass(frozen=True)
class EngineSpec:
    """What an engine builds and how many producers build it: `EngineSpec.from_sections` is how both drivers
    (the trainer's controller and a Loader) make one from their validated sections."""

    build: Build
    counts: ProducerCounts

    @classmethod
    def from_sections(cls, feed: FeedSettings, data: DataSettings, seed: int, samples: Samples, host: HostShare,
                      slots: int | None = None, batch_size: int | None = None) -> EngineSpec:
        """`slots`: the ring's (None: one per producer of the ceiling and two more, at least MIN_SLOTS, and each
        producer holds QUEUED_BATCHES batches' worth); `batch_size`: the samples a slot holds (default
        `feed.batch_size`)."""
        ring_parts = most_parts_in_flight(feed.batch_size, slots) if slots is not None else None
        counts = ProducerCounts.from_sections(feed, host, ring_parts)
        num_slots = slots if slots is not None else max(MIN_SLOTS, counts.budget + 2)
        held = parts_held(samples.train)
        if slots is None:  # the ceiling's split: a producer holds QUEUED_BATCHES batches' worth at most (or more)
            held = max(QUEUED_BATCHES * parts_per_batch(feed.batch_size, num_slots, counts.budget, MAX_IN_FLIGHT),
                       held)
        # A map-style dataset's items are the images as they are: resized, never cropped or flipped.
        augment = "none" if isinstance(samples.train, DatasetSource) else data.augment
        image_size = samples.image_size or data.resolved_image_size
        ramp = data.size_ramp
        build = Build(samples.train, samples.val, augment, seed, batch_size or feed.batch_size, image_size,
                      num_slots, producer_timeout_s=feed.producer_timeout_s, max_bad_fraction=data.max_bad_fraction,
                      val_image_size=data.val_image_size or image_size, max_in_flight=held, ramp=ramp)
        return cls(build, counts)

    def holding(self, batch_size: int) -> EngineSpec:
        """The same engine with slots of `batch_size` samples."""
        return replace(self, build=replace(self.build, batch_size=batch_size))


@dataclass(frozen=True)
class Samples:
    """What an engine reads: training samples, validation's (None: none), and the side they are built at (None:
    the data settings')."""

    train: SampleSource
    val: SampleSource | None = None
    image_size: int | None = None


class Engine:
    """Creates the ring and starts `counts.initial` producers, each holding at most `build.max_in_flight` parts.
    Batches are split into parts for `MAX_IN_FLIGHT` places per producer (`_parts_for`, `parts.py`); a deeper queue
    lets a producer hold more of them, as far as the ring's free slots allow. The producers' figures are kept in
    `gauges` (`gauges.py`); the engine routes work."""

    def __init__(self, build: Build, counts: ProducerCounts, mailbox: Mailbox, stop: Any, accounting: Accounting,
                 events: EventLog) -> None:
        self.build = build
        self.num_slots = build.num_slots
        self.budget = budget = counts.budget
        self.cores = counts.cores
        self.room = most_parts_in_flight(build.batch_size, build.num_slots)  # producers past it have no part to build
        self._reads_waiting: bool | None = None  # `_judge_reads`; None: no window measured yet
        self.autoscaler = counts.autoscaler()
        self.accounting = accounting
        self.events = events
        self.gauges = ProducerGauges(budget, events)
        self.scheduler: Scheduler | None = None
        self.parts: dict[int, Part] = {}  # part id -> the part it builds, given to a producer and not yet done
        self.pending_parts: deque[Part] = deque()  # parts of issued batches waiting for a free producer
        self.part_ids = iter(range(1 << 62))
        self.delivered: list[int] = []  # batches handed over and not yet taken, per rank (sized by `follow`)
        self.pool: ProducerPool | None = None
        self.taken = False  # a consumer has taken a batch: consumers are no longer all starting
        self.copying: CopyFiller | None = None
        self.closed = False
        sweep_dead_segments()
        self.ring = SlotRing.create(build.num_slots, build.batch_size, build.image_size, budget, build.val_image_size,
                                    build.ramp, build.sample_counts)
        self.assembler = Assembler(self.ring, self._parts_for(counts.initial))
        try:
            # The indexes pickle as the folder of their packed entry: every producer maps the same read-only files.
            setup = ProducerSetup(self.ring.spec, build.train, build.val, build.augment, build.seed)
            self.pool = ProducerPool(setup, self.ring, mailbox, stop, budget,
                                     producer_timeout_s=build.producer_timeout_s, max_in_flight=build.max_in_flight)
            for _ in range(counts.initial):
                self.pool.grow()
            self.copying = start_copying(build.train, build.val)
        except BaseException:
            self.close()
            raise
        self.gauges.producers_initial = counts.initial
        self.gauges.record_producers("start", self.num_active)

    def follow(self, scheduler: Scheduler) -> None:
        """Build what `scheduler` orders from now on, in a ring whose slots are all free again: batches of an
        earlier scheduler that were built and not taken are dropped (none may still be in flight)."""
        assert not self.parts and not self.pending_parts, "a new scheduler while batches of the last are being built"
        self.scheduler = scheduler
        self.assembler = Assembler(self.ring, self.assembler.parts)
        self.delivered = [0] * scheduler.num_ranks

    def abandon(self) -> None:
        """The consumers changed: parts not yet given to a producer are dropped. Those a producer holds still finish
        (into slots nobody takes); `follow` comes once none is left (`building`)."""
        self.pending_parts.clear()

    @property
    def building(self) -> int:
        """Parts a producer holds and has not reported built."""
        return len(self.parts)

    # ---- routing ------------------------------------------------------------------------------------------------

    def dispatch(self) -> None:
        """Give producers the next parts of batches, as far as slots and their queues allow: the parts of one
        batch go to as many producers as are free (`parts.py`)."""
        assert self.pool is not None and self.scheduler is not None
        idle_for_a_slot = 0.0
        while self.pool.can_take():
            if not self.pending_parts:
                issued = self.scheduler.issue_one()
                if issued is None:
                    idle_for_a_slot = self._idle_for_a_slot()
                    break
                if issued.batch_plan.kind == "train":
                    self.accounting.expect(issued.batch_plan.epoch, issued.batch_plan.sample_ids)
                self.pending_parts.extend(self.assembler.split(issued))
            self._assign(self.pending_parts.popleft())
        self.gauges.note_slot_bound(idle_for_a_slot)

    def _idle_for_a_slot(self) -> float:
        """After the scheduler found nothing to issue: the share of producers idle while a consumer has no batch
        waiting for it and its next one waits for a free slot (while every consumer has a batch ready, full slots
        are the ring doing its job)."""
        assert self.pool is not None and self.scheduler is not None
        if not self.delivered or min(self.delivered) > 0 or not self.scheduler.waits_for_slot():
            return 0.0
        return self.pool.idle_share()

    def _assign(self, part: Part) -> None:
        assert self.pool is not None
        part = replace(part, part_id=next(self.part_ids))
        self.parts[part.part_id] = part
        self.pool.assign(part)

    def deliverable(self) -> Iterator[tuple[int, Any]]:
        """(rank, message) pairs to hand over now, in each rank's order."""
        assert self.scheduler is not None
        for rank, message in self.scheduler.deliverable():
            if getattr(message, "slot", None) is not None:
                self.delivered[rank] += 1
            yield rank, message

    def release(self, slot: int) -> None:
        """The batch in `slot` has been taken: it may be rebuilt."""
        assert self.scheduler is not None
        rank = self.scheduler.release(slot)
        self.taken = True
        self.delivered[rank] -= 1

    def queue_fill(self) -> float:
        """Batches handed over and not yet taken, as a share of the ring."""
        return sum(self.delivered) / max(1, self.num_slots)

    def handle(self, message: Any) -> bool:
        """A producer's message; False when it is not one (the driver's own)."""
        if isinstance(message, PartDone):
            self._part_done(message)
            return True
        if isinstance(message, ProducerFailed):
            raise StokerRunError(f"{message.error}\n{message.error.trace}")
        return False

    def _part_done(self, done: PartDone) -> None:
        assert self.pool is not None and self.scheduler is not None
        part = self.pool.finished(done)
        if part is None:
            return
        if done.cost is not None and part.batch_plan.kind == "train":
            self.gauges.feed_cost += done.cost
        del self.parts[done.part_id]
        if done.skipped:
            epoch = part.batch_plan.epoch if part.batch_plan.kind == "train" else None
            new = [item for item in done.skipped.values() if item.path not in self.accounting.skipped]
            self.accounting.record_skipped(epoch, done.skipped)
            self.pool.remember_unusable(part.batch_plan.kind, {s: item.reason for s, item in done.skipped.items()})
            for item in new:  # once a run: later epochs skip the file without decoding it (`pool.unusable`)
                log.warning("skipped %s: %s", item.path, item.reason)
                self.events.write("skipped", path=item.path, reason=item.reason)
            self._check_bad_fraction()
        issued, compaction = self.assembler.done(part, done.count)
        if compaction is not None:
            self.pending_parts.appendleft(compaction)  # its slot is next in line: before any new part
        if issued is not None:
            self.scheduler.complete(issued)

    def _check_bad_fraction(self) -> None:
        bad, total, most = len(self.accounting.skipped), self.build.total_files, self.build.max_bad_fraction
        if bad > most * total:
            raise StokerRunError(f"{bad} of {total} files are unusable so far, more than "
                                 f"max_bad_fraction={most}; each is named in the log, and in "
                                 "skipped_files (the run's summary.json, a Loader's summary())")

    def check_producers(self) -> None:
        """Replace dead or hung producers and re-issue exactly the parts they held."""
        assert self.pool is not None
        for loss in self.pool.check():
            log.warning("%s; starting a replacement and re-issuing the %d part(s) it held", loss.message,
                        len(loss.reissue))
            self.events.write("producer_lost", message=loss.message, reissued=len(loss.reissue),
                              reissued_samples=[t.end - t.first for t in loss.reissue if not t.compact])
            self.pool.grow()
            for part in loss.reissue:
                if self.parts.pop(part.part_id, None) is not None:
                    self.pending_parts.extendleft(reversed(self.assembler.again(part)))

    # ---- scaling ------------------------------------------------------------------------------------------------

    def take_utilization(self, elapsed_s: float) -> float:
        """Producers' busy share over the window that ends now (a part counts in the window it ends in)."""
        assert self.pool is not None
        return self.gauges.take_window(elapsed_s, *self.pool.take_utilization(elapsed_s))

    def autoscale(self, window: Window) -> None:
        """Let the autoscaler decide on the window's measurement (completed here with what only the engine knows:
        its clock, the producers still starting, the share of their time spent reading), and carry it out. Called
        for windows in which consumers trained, and for those before any consumer took a batch."""
        assert self.pool is not None
        gauges = self.gauges
        if window.steps:
            gauges.training_began()
        if self.autoscaler is None:
            return
        ended_s = time.monotonic() if window.ended_s is None else window.ended_s
        window = replace(window, ended_s=ended_s, starting=self.pool.starting(), read_share=gauges.window_read_share,
                         working_since=self.pool.all_working_since(), taken=self.taken)
        decision = self.autoscaler.decide(window)
        gauges.note_decision(window, decision.change, ended_s)
        self.events.write("autoscale", change=decision.change, reason=decision.reason,
                          t_decided=gauges.since_start(ended_s), **decision.measurement)
        if decision.change > 0:
            spawning = time.monotonic()
            started = sum(self.pool.grow() is not None for _ in range(self._memory_allows(decision.change)))
            decision.measurement["spawn_s"] = round(time.monotonic() - spawning, 3)
            self.autoscaler.forked(started, time.monotonic())
            if not started:
                self.events.write("autoscale", change=0, reason="no free producer row yet (one is retiring): "
                                                                 "asking again next window")
                return
        for _ in range(-decision.change):
            self.pool.shrink(newest=decision.retire_newest)
        waited = self._reads_wait()
        self._judge_reads()
        if decision.change or self._reads_wait() != waited:
            self.assembler.parts = self._parts_for(self.num_active)
        if decision.change:
            gauges.record_producers(decision.reason, self.num_active, decision.measurement)

    @staticmethod
    def _memory_allows(forks: int) -> int:
        """As many of `forks` as MEMORY_SHARE of the memory available now holds (a start-up fork may be many)."""
        available = available_memory()
        return forks if available is None else min(forks, int(MEMORY_SHARE * available) // PRODUCER_MEMORY)

    def _parts_for(self, producers: int) -> int:
        """Parts per batch for `producers` running or, under auto where the producers wait on their reads and while
        the ring has parts to give them all `MAX_IN_FLIGHT`, for the count its next jump may reach within what the
        cores run at OVERSUBSCRIBE a core: a jump past the cores comes only then, and its new producers find parts of
        the batches already issued. Where the producers decode, the finer split only cost messages and starved them
        (`parts.py`): 2 producers on batches of 32 in 8 parts, 2 parts each, ran 0.80 of 2 fixed ones on a short run."""
        spare = MAX_IN_FLIGHT * producers < self.room
        ahead = self.autoscaler is not None and spare and self._reads_wait()
        reach = min(self.budget, JUMP_MAX * producers, max(producers, OVERSUBSCRIBE * max(1, self.cores)))
        return parts_per_batch(self.build.batch_size, self.num_slots, reach if ahead else producers, MAX_IN_FLIGHT)

    def _reads_wait(self) -> bool:
        """Whether the producers wait on storage: as last judged from a window (`_judge_reads`), or before any,
        where the samples are streamed over a network."""
        if self._reads_waiting is None:
            return bool(getattr(self.build.train, "streamed", False))
        return self._reads_waiting

    def _judge_reads(self) -> None:
        """From the last window in which the producers worked: they wait on their reads past READ_BOUND of their busy
        time, and no longer under READ_SETTLED (a share near the bound would re-split the batches every window). A
        window without work (the ring full, producers starting) leaves the judgement as it was."""
        _, _, read_s, busy_s = self.gauges.last_window
        if busy_s <= 0:
            return
        share = read_s / busy_s
        if share >= READ_BOUND:
            self._reads_waiting = True
        elif share < READ_SETTLED:
            self._reads_waiting = False

    @property
    def num_active(self) -> int:
        return len(self.pool.active) if self.pool is not None else 0

    @property
    def max_alive(self) -> int:
        return self.pool.max_alive if self.pool is not None else 0

    def producer_limit(self) -> int:
        """The count the producers are held to now: fixed, the ceiling, or the most that paid."""
        return self.autoscaler.limit if self.autoscaler is not None else self.budget

    def verdict_fields(self) -> dict[str, Any]:
        """The producers' side of the verdict (`observe.diagnosis.TimeSplit`), the same for both drivers."""
        return {**self.gauges.verdict_fields(self.producer_limit()), "auto": self.autoscaler is not None,
                "producer_room": self.assembler.parts * self.num_slots, "cores": self.cores,
                "initial": self.gauges.producers_initial}

    # ---- the end ------------------------------------------------------------------------------------------------

    def stop_producers(self) -> None:
        """Idempotent: the driver sets the stop event first; join, terminate stragglers."""
        if self.pool is not None:
            self.pool.close()

    def close(self) -> None:
        """Idempotent: producers first, then the ring (only its creator unlinks it)."""
        if self.closed:
            return
        self.closed = True
        if self.copying is not None:
            self.copying.close()
        self.stop_producers()
        self.ring.close()


def start_copying(*sources: SampleSource | None) -> CopyFiller | None:
    """Copy the remote shards of these sources into `--cache-dir` while the run goes on, when there is one."""
    indexes = [s for s in sources if isinstance(s, PackedIndex) and s.copies is not None]
    shards = list(dict.fromkeys(shard for index in indexes for shard in index.remote_shards()))
    copies = indexes[0].copies if indexes else None
    return CopyFiller(copies, shards) if copies is not None and shards else None

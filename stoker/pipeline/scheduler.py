"""The order of work: which batch each consumer gets next, which slot it is built in, and when it is handed over.

Each consumer has a stream of rows: a train step, or a whole validation pass. Batches may be built out of order by
several producers; the scheduler hands each consumer its batches strictly in stream order. Every rank stops at the
same row (`cut`), so no consumer is left waiting in a collective its peers never reach.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoker.common.checkpoint import Position, checkpoint_dir
from stoker.pipeline.messages import Batch, Save, ValEnd
from stoker.pipeline.plan import BatchPlan, EpochPlan


@dataclass(frozen=True)
class Entry:
    row: int
    global_step: int
    work: BatchPlan | None = None  # a batch to build, or
    message: Any = None  # a message that needs no slot (ValEnd, Save)
    resume_at: Position | None = None  # set on the last item of a row: where training continues after it


@dataclass(frozen=True)
class Placement:
    """A batch to build: for `rank`, at `seq` in its stream, into `slot`."""

    rank: int
    seq: int
    work: BatchPlan
    slot: int
    global_step: int


class Scheduler:
    """Schedules this machine's consumers: local rank r is global rank `first_rank + r` in the plan."""

    def __init__(self, plan: EpochPlan, epochs: int, start: Position, num_slots: int, has_val: bool,
                 checkpoint_every: int, run_dir: Path, first_rank: int = 0, num_ranks: int | None = None) -> None:
        self.plan = plan
        self.num_ranks = plan.num_consumers if num_ranks is None else num_ranks
        self.per_rank_slots = num_slots // self.num_ranks
        self.free_slots = deque(range(num_slots))
        self._streams = [self._stream(first_rank + rank, epochs, start, has_val, checkpoint_every, run_dir)
                         for rank in range(self.num_ranks)]
        self._items: list[dict[int, Entry]] = [{} for _ in range(self.num_ranks)]  # issued, not yet delivered
        self._last_row_issued = [-1] * self.num_ranks
        self._peeked: list[Entry | None] = [None] * self.num_ranks
        self._next_seq = [0] * self.num_ranks
        self._outstanding = [0] * self.num_ranks  # issued, holding a slot
        self._ready: list[dict[int, Any]] = [{} for _ in range(self.num_ranks)]
        self._next_delivery = [0] * self.num_ranks
        self._limit_row: int | None = None
        self._skip_validation_row: int | None = None  # an interrupt's: the validation not yet handed out is dropped
        self._validation_ends_taken: set[int] = set()  # rows whose ValEnd some rank has (its all_reduce is due)
        self.position = start
        self.saves_issued: set[int] = set()  # global steps a Save was handed out for

    def _stream(self, rank: int, epochs: int, start: Position, has_val: bool, checkpoint_every: int,
                run_dir: Path) -> Iterator[Entry]:
        plan, row = self.plan, 0
        steps = plan.steps_per_epoch
        for epoch in range(start.epoch, epochs):
            for step in range(start.step if epoch == start.epoch else 0, steps):
                global_step = epoch * steps + step
                after = Position(epoch + (step + 1) // steps, (step + 1) % steps, global_step + 1)
                work = plan.train_work(epoch, step, rank)
                yield Entry(row, global_step, work=work, resume_at=after)
                if checkpoint_every and (global_step + 1) % checkpoint_every == 0 and step + 1 < steps:
                    yield Entry(row, global_step, message=_save(run_dir, after),
                               resume_at=after)
                row += 1
            after = Position(epoch + 1, 0, (epoch + 1) * steps)
            if has_val:
                for index in range(plan.val_batches(rank)):
                    yield Entry(row, after.global_step - 1, work=plan.val_work(epoch, index, rank))
                yield Entry(row, after.global_step - 1, message=ValEnd(epoch), resume_at=after)
            yield Entry(row, after.global_step - 1, message=_save(run_dir, after),
                       resume_at=after)
            row += 1

    def cut(self, row: int | None = None, skip_validation: bool = False) -> int:
        """Stop every rank at the end of `row`, by default the furthest row any rank has started (used to
        interrupt cleanly); returns the row. Machines that agree on a later row raise their cut to it.

        `skip_validation` (one machine): when the cut row is a validation pass, the batches of it not handed out
        yet are dropped, with its ValEnd, so that a signal does not wait for a whole pass; its checkpoint stays. Only
        while no rank has its ValEnd: one that does is in (or bound for) the pass's all_reduce, which every rank
        must then reach."""
        self._limit_row = max(self._last_row_issued) if row is None else row
        if skip_validation and self._limit_row not in self._validation_ends_taken:
            self._skip_validation_row = self._limit_row
        return self._limit_row

    def issue_one(self) -> Placement | None:
        """The next batch to build, for the rank with the fewest batches in flight; slot-less items (a rank with
        no samples in a short last step, ValEnd, Save) go straight to the ready side on the way."""
        for rank in sorted(range(self.num_ranks), key=lambda r: self._outstanding[r]):
            while (item := self._peek(rank)) is not None and not _needs_slot(item):
                self._ready[rank][self._take(rank)] = self._message(item, slot=None)
            if item is None or not self.free_slots or self._outstanding[rank] >= self.per_rank_slots:
                continue
            assert item.work is not None  # an item that needs a slot has work
            slot = self.free_slots.popleft()
            self._outstanding[rank] += 1
            return Placement(rank, self._take(rank), item.work, slot, item.global_step)
        return None

    def waits_for_slot(self) -> bool:
        """After `issue_one` found nothing: a batch is next in line for some rank and no slot is free for it (every
        slot holds a batch being built, or built and not yet taken): the ring, not the plan, holds it back."""
        return any((item := self._peek(rank)) is not None and _needs_slot(item) for rank in range(self.num_ranks))

    def _peek(self, rank: int) -> Entry | None:
        if self._peeked[rank] is None:
            self._peeked[rank] = next(self._streams[rank], None)
        while (item := self._peeked[rank]) is not None and self._skipped(item):
            self._peeked[rank] = next(self._streams[rank], None)
        item = self._peeked[rank]
        if item is not None and self._limit_row is not None and item.row > self._limit_row:
            return None
        return item

    def _skipped(self, item: Entry) -> bool:
        if item.row != self._skip_validation_row:
            return False
        return isinstance(item.message, ValEnd) or (item.work is not None and item.work.kind == "val")

    def _take(self, rank: int) -> int:
        item = self._peeked[rank]
        assert item is not None, "taken after a peek that found an item"
        self._peeked[rank] = None
        if isinstance(item.message, ValEnd):
            self._validation_ends_taken.add(item.row)
        self._last_row_issued[rank] = item.row
        self._items[rank][self._next_seq[rank]] = item
        self._next_seq[rank] += 1
        return self._next_seq[rank] - 1

    def _message(self, item: Entry, slot: int | None) -> Any:
        if item.work is None:
            return item.message
        work = item.work
        return Batch(work.kind, work.epoch, work.step, item.global_step, slot, work.step_samples)

    def complete(self, issue: Placement) -> None:
        """A producer finished the batch: it can be handed over once every earlier one has been."""
        self._ready[issue.rank][issue.seq] = self._message(self._items[issue.rank][issue.seq], issue.slot)

    def deliverable(self) -> Iterator[tuple[int, Any]]:
        """(rank, message) pairs that can go to consumers now, in each rank's stream order."""
        for rank in range(self.num_ranks):
            ready = self._ready[rank]
            while self._next_delivery[rank] in ready:
                seq = self._next_delivery[rank]
                item = self._items[rank].pop(seq)
                if item.resume_at is not None and rank == 0:
                    self.position = item.resume_at
                if isinstance(item.message, Save):
                    self.saves_issued.add(item.message.global_step)
                self._next_delivery[rank] += 1
                yield rank, ready.pop(seq)

    def release(self, slot: int, rank: int) -> None:
        self._outstanding[rank] -= 1
        self.free_slots.append(slot)

    def exhausted(self) -> bool:
        """Every item up to the end (or the cut) has been handed to its consumer."""
        return all(self._peek(rank) is None and self._next_delivery[rank] == self._next_seq[rank]
                   for rank in range(self.num_ranks))


def _needs_slot(item: Entry) -> bool:
    return item.work is not None and len(item.work.sample_ids) > 0


def _save(run_dir: Path, position: Position) -> Save:
    return Save(checkpoint_dir(run_dir, position.global_step, temporary=True), position.global_step)

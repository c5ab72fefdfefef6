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

from stoker.common.positions import Position, checkpoint_dir
from stoker.pipeline.messages import Batch, Save, ValEnd
from stoker.pipeline.plan import BatchPlan, EpochPlan


@dataclass(frozen=True)
class Entry:
    row: int
    global_step: int
    batch_plan: BatchPlan | None = None  # a batch to build, or
    message: Any = None  # a message that needs no slot (ValEnd, Save)
    resume_at: Position | None = None  # set on the last item of a row: where training continues after it


@dataclass(frozen=True)
class Unfinished:
    """What a plan made again after the consumers changed does first: the validation of the epoch before its start,
    and the checkpoint at its start, when the group that broke did not finish them."""

    validate: bool = False
    save: bool = False


@dataclass(frozen=True)
class Placement:
    """A batch to build: for `rank`, at `seq` in its stream, into `slot`."""

    rank: int
    seq: int
    batch_plan: BatchPlan
    slot: int
    global_step: int


class Scheduler:
    """Schedules this machine's consumers: local rank r is global rank `first_rank + r` in the plan."""

    def __init__(self, plan: EpochPlan, epochs: int, start: Position, num_slots: int, has_val: bool,
                 checkpoint_every: int, run_dir: Path, first_rank: int = 0, num_ranks: int | None = None,
                 unfinished: Unfinished | None = None) -> None:
        self.plan = plan
        self.start = start
        self.unfinished = unfinished or Unfinished()
        self.num_ranks = plan.num_consumers if num_ranks is None else num_ranks
        self.per_rank_slots = num_slots // self.num_ranks
        self.free_slots = deque(range(num_slots))
        self.owner: dict[int, int] = {}  # slot -> the rank its batch is for, from its issue to its release
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
        plan, row, global_step = self.plan, 0, start.global_step
        if self.unfinished.validate or self.unfinished.save:
            if start.step == 0 and start.epoch > 0:
                yield from self._epoch_end(rank, start.epoch - 1, row, start, self.unfinished.validate and has_val,
                                           run_dir, save=self.unfinished.save)
            else:
                yield Entry(row, global_step - 1, message=_save(run_dir, start), resume_at=start)
            row += 1
        for epoch in range(start.epoch, epochs):
            steps = plan.steps_in(epoch)
            for step in range(start.step if epoch == start.epoch else 0, steps):
                last = step + 1 == steps
                after = Position(epoch + 1, 0, global_step + 1, 0) if last else Position(
                    epoch, step + 1, global_step + 1, plan.offset(epoch, step + 1))
                yield Entry(row, global_step, batch_plan=plan.train_work(epoch, step, rank), resume_at=after)
                if checkpoint_every and (global_step + 1) % checkpoint_every == 0 and not last:
                    yield Entry(row, global_step, message=_save(run_dir, after), resume_at=after)
                row += 1
                global_step += 1
            yield from self._epoch_end(rank, epoch, row, Position(epoch + 1, 0, global_step, 0), has_val, run_dir)
            row += 1

    def _epoch_end(self, rank: int, epoch: int, row: int, after: Position, has_val: bool,
                   run_dir: Path, save: bool = True) -> Iterator[Entry]:
        """The row after an epoch's last step: its validation pass, then its checkpoint."""
        if has_val:
            for index in range(self.plan.val_batches(rank)):
                yield Entry(row, after.global_step - 1, batch_plan=self.plan.val_work(epoch, index, rank))
            yield Entry(row, after.global_step - 1, message=ValEnd(epoch), resume_at=after)
        if save:
            yield Entry(row, after.global_step - 1, message=_save(run_dir, after), resume_at=after)

    def position_after(self, global_step: int) -> Position:
        """Where training continues after `global_step` (one of this scheduler's steps, or the one before its
        start)."""
        epoch, step, steps_done = self.start.epoch, self.start.step, global_step + 1 - self.start.global_step
        assert steps_done >= 0, f"step {global_step} is before this plan's start at {self.start.global_step}"
        while steps_done >= self.plan.steps_in(epoch) - step:
            steps_done -= self.plan.steps_in(epoch) - step
            epoch, step = epoch + 1, 0
        step += steps_done
        return Position(epoch, step, global_step + 1, self.plan.offset(epoch, step))

    def work_of(self, global_step: int, rank: int) -> BatchPlan:
        """What `rank` trained at `global_step` (one of this scheduler's steps)."""
        before = self.position_after(global_step - 1)
        return self.plan.train_work(before.epoch, before.step, rank)

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
            assert item.batch_plan is not None  # an item that needs a slot has work
            slot = self.free_slots.popleft()
            self.owner[slot] = rank
            self._outstanding[rank] += 1
            return Placement(rank, self._take(rank), item.batch_plan, slot, item.global_step)
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
        return isinstance(item.message, ValEnd) or (item.batch_plan is not None and item.batch_plan.kind == "val")

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
        if item.batch_plan is None:
            return item.message
        batch_plan, plan = item.batch_plan, self.plan
        return Batch(batch_plan.kind, batch_plan.epoch, batch_plan.step, item.global_step, slot,
                     batch_plan.step_samples, schedule_step=plan.schedule_step(batch_plan.epoch, batch_plan.step),
                     lr_scale=plan.lr_scale, epoch_steps=plan.steps_in(batch_plan.epoch))

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

    def release(self, slot: int) -> int:
        """The batch in `slot` was taken: the slot is free again. Returns the rank it was for."""
        rank = self.owner.pop(slot)
        self._outstanding[rank] -= 1
        self.free_slots.append(slot)
        return rank

    def exhausted(self) -> bool:
        """Every item up to the end (or the cut) has been handed to its consumer."""
        return all(self._peek(rank) is None and self._next_delivery[rank] == self._next_seq[rank]
                   for rank in range(self.num_ranks))


def _needs_slot(item: Entry) -> bool:
    return item.batch_plan is not None and len(item.batch_plan.sample_ids) > 0


def _save(run_dir: Path, position: Position) -> Save:
    return Save(checkpoint_dir(run_dir, position.global_step, temporary=True), position.global_step, position)

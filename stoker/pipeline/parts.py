"""A batch built in parts: several producers fill one slot at once, so input capacity follows the producers, not
the slots (one producer per whole batch capped a consumer at `slots_per_consumer` batches being built: 16 producers
no faster than 4).

Each issued batch is split into parts of consecutive samples of its plan, written by whichever producer is free into
its own rows of the slot; a compaction (a producer's task: the engine never touches pixels) moves a short part's rows
down, so the slot holds what a batch built whole holds. A lost producer costs its part, not its batch. How many parts,
and why: docs/producers.md, "The ring, parts and the producers' figures"."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from stoker.pipeline.producer import Part
from stoker.pipeline.ring import SlotRing
from stoker.pipeline.scheduler import Placement

MIN_PART_SAMPLES = 4


def parts_per_batch(batch_size: int, num_slots: int, max_producers: int, max_in_flight: int) -> int:
    """Parts per batch so that the slots hold a part for each of the `max_in_flight` places of every producer; where
    the smallest parts cannot give every producer that many, as many as give each one part. Uneven holdings cost
    more than a held part gains: a batch waits for its last part, and a producer holding two of them finishes the
    second a part's time late (reads waiting 25 ms: 28 producers on 32 parts in flight trained at 751 samples/s,
    32 at 979)."""
    slots, most = max(1, num_slots), max(1, batch_size // MIN_PART_SAMPLES)
    wanted = -(-max_in_flight * max_producers // slots)
    return max(1, wanted if wanted <= most else min(most, max_producers // slots))


def most_parts_in_flight(batch_size: int, num_slots: int) -> int:
    """The parts the ring can hold in flight at once: every slot split into the smallest parts. More producers than
    this have nothing to build."""
    return num_slots * max(1, batch_size // MIN_PART_SAMPLES)


def part_bounds(num_samples: int, parts: int) -> list[tuple[int, int]]:
    """[first, stop) of each part: consecutive, sizes differing by at most one, none empty."""
    bounds = np.linspace(0, num_samples, min(parts, num_samples) + 1).round().astype(int).tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


@dataclass
class _Assembly:
    issue: Placement
    parts: dict[int, Part]  # first row -> the part as last handed out
    counts: dict[int, int] = field(default_factory=dict)  # first row -> samples the part wrote (parts done)


class Assembler:
    """Splits placed batches into parts and says when a slot holds its whole batch. Part ids are the caller's:
    parts come out with id -1 and are matched back by (slot, first row)."""

    def __init__(self, ring: SlotRing, parts: int) -> None:
        self.ring = ring
        self.parts = parts
        self._assemblies: dict[int, _Assembly] = {}  # slot -> the batch being built in it

    def split(self, issue: Placement) -> list[Part]:
        bounds = part_bounds(len(issue.batch_plan.sample_ids), self.parts)
        new_parts = [Part(-1, issue.batch_plan, issue.slot, {}, first, stop) for first, stop in bounds]
        self._assemblies[issue.slot] = _Assembly(issue, {part.first: part for part in new_parts})
        return new_parts

    def done(self, part: Part, count: int) -> tuple[Placement | None, Part | None]:
        """A part finished: (the issue, when its slot now holds the whole batch; a compaction to run first)."""
        assembly = self._assemblies[part.slot]
        if part.compact:
            return self._complete(part.slot), None
        assembly.counts[part.first] = count
        if len(assembly.counts) < len(assembly.parts):
            return None, None
        layout = tuple((first, assembly.counts[first]) for first in sorted(assembly.parts))
        if all(first == row for (first, _), row in zip(layout, _rows_after(layout), strict=True)):
            self.ring.counts[part.slot] = sum(n for _, n in layout)  # every part full (or only the last short)
            return self._complete(part.slot), None
        return None, Part(-1, assembly.issue.batch_plan, part.slot, compact=layout)

    def again(self, part: Part) -> list[Part]:
        """The parts to build again for a lost one: the part itself (with what its loss taught to skip); for a lost
        compaction, every part it may have moved (their rows may be half-overwritten), then it runs again."""
        assembly = self._assemblies[part.slot]
        if not part.compact:
            assembly.parts[part.first] = replace(part, part_id=-1)
            return [assembly.parts[part.first]]
        moved = [first for (first, _), row in zip(part.compact, _rows_after(part.compact), strict=True)
                 if first != row]
        for first in moved:
            del assembly.counts[first]
        return [assembly.parts[first] for first in moved]

    def _complete(self, slot: int) -> Placement:
        return self._assemblies.pop(slot).issue


def _rows_after(layout: tuple[tuple[int, int], ...]) -> list[int]:
    """Where each part's rows start once the slot is compacted."""
    starts, row = [], 0
    for _, count in layout:
        starts.append(row)
        row += count
    return starts

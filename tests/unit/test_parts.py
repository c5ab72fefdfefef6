"""A batch built in parts by several producers holds the same bytes as the batch built whole by one, with real JPEG
files (some unusable) decoded into a real shared-memory ring, whatever order the parts finish in and when a
compaction is lost half-way."""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from PIL import Image

from stoker.data.pixels.imaging import make_decode_warnings_errors
from stoker.pipeline.parts import Assembler, most_parts_in_flight, part_bounds, parts_per_batch
from stoker.pipeline.plan import BatchPlan
from stoker.pipeline.producer import Part, ProducerSetup, Source, build_batch, compact_slot
from stoker.pipeline.ring import SlotRing
from stoker.pipeline.scheduler import Placement

BATCH = 16
SIZE = 24
BAD = {3, 4, 9}  # sample ids of unusable files: two in one part, one in another


@pytest.fixture()
def source(tmp_path):
    rng = np.random.default_rng(0)
    paths = []
    for sample in range(BATCH):
        path = tmp_path / f"{sample:02d}.jpg"
        if sample in BAD:
            path.write_bytes(b"" if sample == 3 else b"\xff\xd8\xff\xe0 not a jpeg")
        else:
            buffer = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(buffer, "JPEG")
            path.write_bytes(buffer.getvalue())
        paths.append(str(path))
    make_decode_warnings_errors()
    return Source(tuple(paths), np.arange(BATCH, dtype=np.int64) % 5)


@pytest.fixture()
def ring():
    ring = SlotRing.create(num_slots=2, batch_size=BATCH, image_size=SIZE, num_status=1, samples=(BATCH, 0))
    yield ring
    ring.close()


def work() -> BatchPlan:
    order = np.random.default_rng(1).permutation(BATCH).astype(np.int64)  # plan order is not id order
    return BatchPlan("train", 0, 0, 0, order, BATCH)


def slot_contents(ring: SlotRing, slot: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    count = int(ring.counts[slot])
    return count, ring.images[slot, :count].copy(), ring.labels[slot, :count].copy(), ring.ids[slot, :count].copy()


def build_whole(ring, setup) -> tuple:
    build_batch(Part(0, work(), 1), setup, ring, ring.status[0])
    return slot_contents(ring, 1)


def build_in_parts(ring, setup, parts: int, finish_order) -> tuple:
    assembler = Assembler(ring, parts)
    parts = assembler.split(Placement(0, 0, work(), 0, 0))
    ring.images[0] = 255  # garbage a previous batch left: nothing of it may show through
    issued = compaction = None
    for index in finish_order(len(parts)):
        part = parts[index]
        count, _ = build_batch(part, setup, ring, ring.status[0])
        issued, compaction = assembler.done(part, count)
    if compaction is not None:
        compact_slot(compaction, ring, ring.status[0])
        issued, _ = assembler.done(compaction, 0)
    assert issued is not None
    return slot_contents(ring, 0)


def same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and all(np.array_equal(x, y) for x, y in zip(a[1:], b[1:], strict=True))


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("order", ["forward", "backward"])
def test_parts_in_any_order_give_the_bytes_of_the_whole_batch(source, ring, parts, order):
    setup = ProducerSetup(ring.spec, source, None, "standard", seed=3)
    whole = build_whole(ring, setup)
    finish = (lambda n: range(n)) if order == "forward" else (lambda n: reversed(range(n)))
    assert same(build_in_parts(ring, setup, parts, finish), whole)
    # and independently of the whole-batch path: the usable samples, in plan order
    assert whole[3].tolist() == [s for s in work().sample_ids.tolist() if s not in BAD]
    assert whole[0] == BATCH - len(BAD)


def test_a_compaction_lost_half_way_is_redone_from_the_parts_it_moved(source, ring):
    setup = ProducerSetup(ring.spec, source, None, "standard", seed=3)
    whole = build_whole(ring, setup)
    assembler = Assembler(ring, 4)
    parts = assembler.split(Placement(0, 0, work(), 0, 0))
    compaction = None
    for part in parts:
        count, _ = build_batch(part, setup, ring, ring.status[0])
        _, compaction = assembler.done(part, count)
    assert compaction is not None
    half = Part(-1, compaction.batch_plan, 0, compact=compaction.compact[:3])  # killed after moving three parts
    compact_slot(half, ring, ring.status[0])
    again = assembler.again(compaction)
    moved = [first for first, _ in compaction.compact[1:]]
    assert [t.first for t in again] == [f for f in moved if f != sum(n for g, n in compaction.compact if g < f)]
    for part in again:
        count, _ = build_batch(part, setup, ring, ring.status[0])
        issued, compaction_again = assembler.done(part, count)
    assert compaction_again is not None and compaction_again.compact == compaction.compact
    compact_slot(compaction_again, ring, ring.status[0])
    issued, _ = assembler.done(compaction_again, 0)
    assert issued is not None and same(slot_contents(ring, 0), whole)


def test_full_parts_need_no_compaction_and_set_the_count(ring):
    assembler = Assembler(ring, 4)
    parts = assembler.split(Placement(0, 0, BatchPlan("val", 0, 0, 0, np.arange(10, dtype=np.int64), 10), 1, 0))
    assert [(t.first, t.end) for t in parts] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    for part in parts[:-1]:
        assert assembler.done(part, part.end - part.first) == (None, None)
    issued, compaction = assembler.done(parts[-1], 1)  # only the last part short: nothing to move
    assert issued is not None and compaction is None and ring.counts[1] == 9


def test_parts_are_sized_from_the_producers():
    assert parts_per_batch(batch_size=32, num_slots=4, max_producers=1, max_in_flight=2) == 1  # slots suffice
    assert parts_per_batch(batch_size=32, num_slots=4, max_producers=4, max_in_flight=2) == 2
    assert parts_per_batch(batch_size=32, num_slots=4, max_producers=16, max_in_flight=2) == 8
    assert parts_per_batch(batch_size=32, num_slots=4, max_producers=64, max_in_flight=2) == 8  # never under 4 a part
    assert parts_per_batch(batch_size=3, num_slots=4, max_producers=64, max_in_flight=2) == 1
    # A queue of 4 places per producer needs twice the parts to fill from the same slots.
    assert parts_per_batch(batch_size=32, num_slots=4, max_producers=4, max_in_flight=4) == 4
    assert part_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]  # never an empty part


def test_producers_the_smallest_parts_cannot_give_two_each_get_one_each():
    # 4 slots of 32 hold 32 parts of 4 at most. 28 producers on 32 parts: 4 would hold two, and a batch waits for
    # its last part. One part each instead: 7 a batch, 28 in flight.
    assert parts_per_batch(batch_size=32, num_slots=4, max_producers=28, max_in_flight=2) == 7
    assert parts_per_batch(batch_size=32, num_slots=4, max_producers=20, max_in_flight=2) == 5
    assert parts_per_batch(batch_size=32, num_slots=4, max_producers=32, max_in_flight=2) == 8
    assert parts_per_batch(batch_size=32, num_slots=4, max_producers=3, max_in_flight=2) == 2  # two each fit
    assert most_parts_in_flight(batch_size=32, num_slots=4) == 32
    assert most_parts_in_flight(batch_size=3, num_slots=4) == 4


def test_a_stop_set_while_a_part_is_built_ends_it_between_samples(ring, source):
    """A close waited for whole parts (seconds of decoding at batch 256), then killed the producer at its deadline."""
    import threading

    from stoker.pipeline.producer import StopRequested

    stop = threading.Event()
    reads: list[int] = []

    class StoppingSource:  # the real files, and the stop the controller sets after the fourth read
        paths, labels = source.paths, source.labels

        def read(self, sample_id: int) -> bytes:
            reads.append(sample_id)
            if len(reads) == 4:
                stop.set()
            return source.read(sample_id)

    setup = ProducerSetup(ring.spec, StoppingSource(), None, "none", seed=0)
    with pytest.raises(StopRequested):
        build_batch(Part(0, work(), 1), setup, ring, ring.status[0], stop=stop)
    assert len(reads) == 4  # not one sample more after the stop


def _engine(batch_size: int, num_slots: int, ceiling: int, cores: int, auto: bool = True,
            read_share: float = 0.9) -> Any:
    """An engine's sizing state without its processes; `read_share`: of the producers' busy time in the last
    window, the share spent reading."""
    from stoker.pipeline.engine import Engine

    engine = Engine.__new__(Engine)
    engine.build = SimpleNamespace(batch_size=batch_size, train=SimpleNamespace())
    engine.num_slots, engine.budget, engine.cores = num_slots, ceiling, cores
    engine.room = most_parts_in_flight(batch_size, num_slots)
    engine.autoscaler = object() if auto else None
    engine.gauges = SimpleNamespace(last_window=(0.0, 1.0, read_share, 1.0))  # 1 busy producer-second
    engine._reads_waiting = None
    engine._judge_reads()
    return engine


def test_auto_splits_for_its_next_jump_within_8_a_core_where_reads_wait_and_for_the_producers_past_it():
    # Batch 64, 8 slots (2 consumers), a ceiling of 128 on 2 cores, reads waiting: one producer, or four, get the
    # split of 16 producers (4 parts of 16 samples), not parts of 4 (2-9% slower).
    demo = _engine(64, 8, ceiling=128, cores=2)
    assert demo._parts_for(1) == demo._parts_for(4) == 4
    assert demo._parts_for(40) == 10  # past 8 a core: split for the producers running
    # Reads waiting 25 ms: batch 32, 4 slots, a ceiling of 32. One producer is split for the x16 jump (8 parts);
    # 28 producers get one part each (7 a batch), not 32 parts with 4 producers holding two.
    slow_reads = _engine(32, 4, ceiling=32, cores=2)
    assert slow_reads._parts_for(1) == 8 and slow_reads._parts_for(28) == 7
    # Producers that decode (reads a small share of their time) are never jumped past the cores: their own split,
    # whole batches at 2 producers on 4 slots (8 parts of 4 ran 0.86 of 2 fixed producers).
    decoding = _engine(32, 4, ceiling=32, cores=2, read_share=0.04)
    assert decoding._parts_for(2) == 1 and decoding._parts_for(16) == 8
    streamed = _engine(32, 4, ceiling=32, cores=2)
    streamed._reads_waiting = None  # no window measured yet: samples over a network are taken to wait
    streamed.build.train.streamed = True
    assert streamed._parts_for(2) == 8


def test_the_reads_are_judged_to_wait_past_half_the_busy_time_and_to_stop_under_a_third_and_not_on_idle_windows():
    engine = _engine(32, 4, ceiling=32, cores=2, read_share=0.2)
    assert engine._reads_wait() is False
    for share, waits in ((0.5, True), (0.4, True), (0.36, True), (0.34, False), (0.45, False), (0.6, True)):
        engine.gauges.last_window = (0.0, 1.0, share, 1.0)
        engine._judge_reads()
        assert engine._reads_wait() is waits, share
    engine.gauges.last_window = (0.0, 1.0, 0.0, 0.0)  # no producer worked: nothing learnt
    engine._judge_reads()
    assert engine._reads_wait() is True

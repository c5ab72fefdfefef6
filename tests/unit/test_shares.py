"""One definition of the consumers' time shares: parts over the wall time, never more than 100% together."""

from __future__ import annotations

import time

from stoker.observe.metrics import RunStats
from stoker.pipeline.autoscaler import time_shares
from stoker.pipeline.messages import StepReport
from stoker.pipeline.pool import Handle, ProducerPool
from stoker.pipeline.producer import STATUS_IDLE, PartDone
from stoker.pipeline.ring import SlotRing


def test_shares_are_parts_of_the_wall_time():
    assert time_shares(3.0, 1.0, 0.5, 10.0) == (0.3, 0.1, 0.05)


def test_parts_longer_than_the_wall_time_are_shares_of_their_sum():
    # The controller heard of the first step late, so it saw 1.0 s of wall time for 1.05 s of timed work.
    compute, wait, averaging = time_shares(0.84, 0.0, 0.21, 1.0)
    assert (round(compute, 6), wait, round(averaging, 6)) == (0.8, 0.0, 0.2)


def test_no_time_no_shares():
    assert time_shares(0.0, 0.0, 0.0, 0.0) == (0.0, 0.0, 0.0)


def test_a_run_whose_reports_arrive_late_keeps_every_consumer_under_100_percent():
    import numpy as np

    stats = RunStats(num_consumers=1, samples_per_epoch=4, steps_per_epoch=2)

    def report(step: int, wait_s: float) -> StepReport:
        return StepReport(0, 0, step, step, 2, 1.0, wait_s, 0.6, 0.3, np.array([2 * step, 2 * step + 1]), None)

    stats.record_step(report(0, 0.0), now=10.0)  # heard of at once: the run starts at 10.0 - 0.9
    stats.record_step(report(1, 0.2), now=10.5)  # 1.1 s of work heard of 0.5 s later: a late first report
    [(compute, wait, averaging)] = stats.shares()
    assert compute + wait + averaging <= 1.0
    assert (compute, wait, averaging) == (0.6, 0.1, 0.3)  # 1.2 s, 0.2 s and 0.6 s of the 2.0 s timed


def test_producers_count_from_when_they_are_ready_and_one_no_task_reached_counts_idle():
    # 16 producers forked at once spend seconds importing; counted as idle from their fork, producers busy 96% of
    # the time once started read "idle 48%: they lack work" in the verdict. A producer past its imports that no
    # part reached (the slots' parts all held by others) is idle, though: it must count.
    ring = SlotRing.create(num_slots=1, batch_size=1, image_size=8, num_status=3)
    try:
        pool = ProducerPool(setup=None, ring=ring, mailbox=None, stop=None, capacity=3, producer_timeout_s=60.0)  # type: ignore[arg-type]
        forked = time.monotonic_ns() - 10_000_000_000  # 10 s ago
        pool.handles = {i: Handle(i, None, None, forked_ns=forked) for i in range(3)}  # type: ignore[arg-type]
        ring.status[:] = (STATUS_IDLE, 0, forked)  # as the pool writes them at the fork
        pool.finished(PartDone(producer=0, part_id=1, count=8, skipped={}, busy_s=5.0))  # began 5 s ago
        ring.status[1] = (STATUS_IDLE, 0, time.monotonic_ns() - 2_000_000_000)  # waiting for a part for 2 s
        pool.take_utilization(1.0)  # the window producer 0's first part ended in
        pool.finished(PartDone(producer=0, part_id=2, count=8, skipped={}, busy_s=0.6))
        utilization, busy_s, _ = pool.take_utilization(1.0)
    finally:
        ring.close()
    # producer 0 busy 0.6 of 1 s, producer 1 ready and idle all the window, producer 2 still importing
    assert busy_s == 0.6 and abs(utilization - 0.3) < 1e-3, utilization

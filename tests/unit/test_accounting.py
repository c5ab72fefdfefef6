"""Exactly-once accounting: the scheduler hands out every sample once per epoch, the stats count what consumers
acknowledged (twice or never included), and a checkpoint's accounting is taken at its exact step."""

from __future__ import annotations

import numpy as np

from stoker.common.checkpoint import Position
from stoker.observe.metrics import RunStats
from stoker.observe.summary import Ledger, read_accounting
from stoker.pipeline.messages import Batch, StepReport
from stoker.pipeline.plan import EpochPlan
from stoker.pipeline.scheduler import Scheduler


def report(epoch: int, step: int, ids: list[int], steps_per_epoch: int = 4) -> StepReport:
    return StepReport(rank=0, epoch=epoch, step=step, global_step=epoch * steps_per_epoch + step, count=len(ids),
                      loss=1.0, wait_s=0.0, compute_s=0.01, averaging_s=0.0, sample_ids=np.array(ids),
                      digest=None)


def test_the_scheduler_hands_every_sample_to_one_consumer_once_per_epoch(tmp_path):
    plan = EpochPlan(num_train=37, num_val=0, batch_size=4, num_consumers=2, seed=3)
    scheduler = Scheduler(plan, epochs=2, start=Position(0, 0, 0), num_slots=4, has_val=False,
                          checkpoint_every=0, run_dir=tmp_path)
    delivered: dict[int, list[int]] = {0: [], 1: []}
    while not scheduler.exhausted():
        while (issue := scheduler.issue_one()) is not None:
            scheduler.complete(issue)  # built at once, in issue order
        for rank, message in scheduler.deliverable():
            if isinstance(message, Batch) and message.slot is not None:
                delivered[message.epoch].extend(plan.train_work(message.epoch, message.step, rank).sample_ids)
                scheduler.release(message.slot, rank)
    for epoch in (0, 1):
        assert sorted(delivered[epoch]) == list(range(37))


def test_stats_count_a_sample_acknowledged_twice_and_one_never():
    stats = RunStats(num_consumers=1, samples_per_epoch=6, steps_per_epoch=3)
    stats.expect(0, np.arange(6))
    for step, ids in enumerate([[0, 1], [2, 3], [2, 3]]):  # the batch of step 1 delivered again for step 2
        stats.record_step(report(0, step, ids, 3), now=float(step))
    assert stats.epoch_accounting() == [{"epoch": 0, "consumed": 6, "duplicates": 2, "missing": 2,
                                         "missing_unusable": 0}]
    assert stats.accounting()["duplicate_samples"] == 2


def test_a_checkpoint_holds_the_accounting_at_its_step_and_a_resume_counts_every_sample_once(tmp_path):
    """Steps 0-1 of epoch 1 are before the checkpoint at global step 6; step 2 reported before it was committed.
    The resumed part trains steps 2-3 again: each sample counts once."""
    ids = [[0, 1], [2, 3], [4, 5], [6, 7]]
    stats, ledger = RunStats(1, 8, 4), Ledger(steps_per_epoch=4)
    for epoch, steps in ((0, range(4)), (1, range(3))):
        for step in steps:
            stats.expect(epoch, np.array(ids[step]))
            stats.record_step(message := report(epoch, step, ids[step]), now=0.0)
            ledger.record_step(message)
    name, digest = ledger.write_snapshot(stats, global_step=6, folder=tmp_path)

    resumed_stats, resumed = RunStats(1, 8, 4), Ledger(steps_per_epoch=4)
    resumed.resume(read_accounting(tmp_path, {"files": {name: digest}}), tmp_path, resumed_stats)
    for step in (2, 3):
        resumed_stats.expect(1, np.array(ids[step]))
        resumed_stats.record_step(message := report(1, step, ids[step]), now=0.0)
    part = {"status": "completed", "epochs": 1, "steps": 2, "train_loss": 1.0, "wall_s": 1.0,
            "throughput_samples_per_s": 4.0}
    whole = resumed.whole_run(part, resumed_stats, start_step=6)
    exact = {"consumed": 8, "duplicates": 0, "missing": 0, "missing_unusable": 0}
    assert whole["epoch_accounting"] == [{"epoch": 0, **exact}, {"epoch": 1, **exact}]
    assert (whole["epochs"], whole["steps"], whole["samples_consumed"]) == (2, 8, [8, 8])

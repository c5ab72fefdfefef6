"""Exactly-once accounting: the scheduler hands out every sample once per epoch, the stats count what consumers
acknowledged (twice or never included), and a checkpoint's accounting is taken at its exact step."""

from __future__ import annotations

import numpy as np

from stoker.common.checkpoint import Position, write_atomic
from stoker.observe.metrics import RunStats
from stoker.observe.summary import ACCOUNTING_FILE, Ledger, read_accounting
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
                scheduler.release(message.slot)
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
    stats, ledger = RunStats(1, 8, 4), Ledger()
    for epoch, steps in ((0, range(4)), (1, range(3))):
        for step in steps:
            stats.expect(epoch, np.array(ids[step]))
            stats.record_step(message := report(epoch, step, ids[step]), now=0.0)
            ledger.record_step(message)
    name = ACCOUNTING_FILE
    digest = write_atomic(tmp_path / name, ledger.snapshot(stats, Position(epoch=1, step=2, global_step=6)))

    resumed_stats, resumed = RunStats(1, 8, 4), Ledger()
    resumed.resume(read_accounting(tmp_path, {"files": {name: digest}}), tmp_path, resumed_stats)
    for step in (2, 3):
        resumed_stats.expect(1, np.array(ids[step]))
        resumed_stats.record_step(message := report(1, step, ids[step]), now=0.0)
    part = {"status": "completed", "epochs": 1, "steps": 2, "train_loss": 1.0, "wall_s": 1.0,
            "throughput_samples_per_s": 4.0, "producers_initial": 1, "producers_max": 1}
    whole = resumed.whole_run(part, resumed_stats, start_step=6, start_epoch=1)
    exact = {"consumed": 8, "duplicates": 0, "missing": 0, "missing_unusable": 0}
    assert whole["epoch_accounting"] == [{"epoch": 0, **exact}, {"epoch": 1, **exact}]
    assert (whole["epochs"], whole["steps"], whole["samples_consumed"]) == (2, 8, [8, 8])


def test_after_a_resume_the_rate_and_the_shares_are_the_whole_run_s_and_the_table_says_their_span(tmp_path):
    """The issue's run: summary.json's throughput and the table's samples/s were the last part's alone (37.84)
    beside the whole run's wall time. Part 1 trained 512 samples in 20.0 s of steps, waiting 10.0 s of them; the
    resumed part trains 640 in 16.9 s without waiting: 1,152 samples in 36.9 s is 31.22 samples/s, and the
    consumer waited 10.0 of its 36.9 s."""
    import json

    from stoker.observe.report import RunRecord, describe

    first = {"start_step": 0, "end_step": 8, "status": "interrupted", "wall_s": 25.0,
             "throughput_samples_per_s": 25.6, "samples_trained": 512, "train_s": 20.0,
             "consumer_s": [[10.0, 10.0, 0.0, 0.0, 20.0]], "producers_initial": 1, "producers_max": 3}
    (tmp_path / "summary.json").write_text(json.dumps({"segments": [first]}))
    stats, ledger = RunStats(1, 1152, 18), Ledger()
    ledger.resume(None, tmp_path, stats)
    for step in range(10):  # 64 samples each, the first starting at 0.9 s and the last ending at 17.8 s
        stats.record_step(StepReport(0, 0, 8 + step, 8 + step, 64, 1.0, 0.0, 0.1, 0.0, np.arange(64), None),
                          now=1.0 + step * 16.8 / 9)
    part = {"status": "completed", "epochs": 1, "steps": 10, "train_loss": 1.0, "wall_s": 18.0,
            "throughput_samples_per_s": round(stats.throughput(), 2), "producers_initial": 2, "producers_max": 2,
            "producers_final": 2, "num_consumers": 1}
    assert part["throughput_samples_per_s"] == 37.87  # the resumed part alone: 640 / 16.9
    whole = ledger.whole_run(part, stats, start_step=8, start_epoch=0)
    assert whole["throughput_samples_per_s"] == 31.22 and whole["samples_trained"] == 1152
    assert whole["train_s"] == 36.9 and whole["wall_s"] == 43.0
    assert whole["input_stall_fraction"] == [round(10.0 / 36.9, 4)]
    assert (whole["producers_initial"], whole["producers_max"]) == (1, 3)
    row = next(line for line in describe([RunRecord("run", {**whole, "verdict": None}, {})]).splitlines()
               if line.startswith("samples/s"))
    assert row.split()[1:] == ["31", "(1,152", "in", "36.9", "s", "of", "steps)"], row


def test_after_a_resume_on_another_count_the_rate_is_still_the_whole_run_s(tmp_path):
    """Issue 53 (14): a run on cpu:2 resumed on cpu:1 reported the resumed part's samples/s alone (its first part,
    with two consumers' times, was left out of every figure) beside the whole run's wall time. Part 1 trained 512
    samples in 20.0 s of steps on two consumers; the resumed part trains 640 in 16.9 s on one: 1,152 samples in
    36.9 s. The time shares are per consumer, so they cover the parts with this part's consumers."""
    import json

    first = {"start_step": 0, "end_step": 8, "status": "interrupted", "wall_s": 25.0,
             "throughput_samples_per_s": 25.6, "samples_trained": 512, "train_s": 20.0,
             "consumer_s": [[10.0, 10.0, 0.0, 0.0, 20.0]] * 2, "producers_initial": 1, "producers_max": 3}
    (tmp_path / "summary.json").write_text(json.dumps({"segments": [first]}))
    stats, ledger = RunStats(1, 1152, 18), Ledger()
    ledger.resume(None, tmp_path, stats)
    for step in range(10):  # 64 samples each, the first starting at 0.9 s and the last ending at 17.8 s
        stats.record_step(StepReport(0, 0, 8 + step, 8 + step, 64, 1.0, 0.0, 0.1, 0.0, np.arange(64), None),
                          now=1.0 + step * 16.8 / 9)
    part = {"status": "completed", "epochs": 1, "steps": 10, "train_loss": 1.0, "wall_s": 18.0,
            "throughput_samples_per_s": round(stats.throughput(), 2), "producers_initial": 2, "producers_max": 2,
            "producers_final": 2, "num_consumers": 1}
    whole = ledger.whole_run(part, stats, start_step=8, start_epoch=0)
    assert whole["throughput_samples_per_s"] == 31.22 and whole["samples_trained"] == 1152
    assert whole["train_s"] == 36.9 and whole["wall_s"] == 43.0
    assert whole["segments"][-1]["throughput_samples_per_s"] == 37.87  # the part's own figure, named per part
    assert whole["input_stall_fraction"] == [0.0]  # the one consumer of this part never waited
    assert ledger.so_far(stats)["throughput_samples_per_s"] == 31.22  # the live view's last line says the same

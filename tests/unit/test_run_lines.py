"""What a run says while it goes and what it trains on short runs: the EMA's accuracy in the epoch lines, a
warning for a decay too high for the run's length, a loss shown from the first steps of an epoch on, and a
`--drop-last` that leaves out a last step of a few samples."""

from __future__ import annotations

import numpy as np

from stoker.observe.metrics import RunStats
from stoker.pipeline.messages import StepReport, ValReport


def test_the_epoch_line_shows_the_ema_s_validation_beside_the_model_s():
    from stoker.observe.evaluation import val_line

    plain = ValReport(epoch=0, loss=1.5, accuracy=0.25, count=40)
    assert val_line(plain) == "epoch 1: val accuracy 25.00% loss 1.5000"
    ema = ValReport(epoch=2, loss=1.5, accuracy=0.25, count=40, ema={"loss": 1.25, "accuracy": 0.375, "top5": 1.0})
    assert val_line(ema) == "epoch 3: val accuracy 25.00% loss 1.5000; EMA val accuracy 37.50% loss 1.2500"


def test_a_decay_too_high_for_the_run_is_warned_with_one_that_fits():
    from stoker.training.ema import ema_warning

    # The run: 0.99 over 28 steps; 0.99 ** 28 = 0.7547 of the initialization stays in model_ema.pt.
    text = ema_warning(0.99, 28)
    assert text is not None and "keeps 75% of the initial weights" in text and "--ema 0.921 " in text, text
    assert 0.921 ** 28 <= 0.1 < 0.922 ** 28  # the decay it names is the highest (to 3 digits) that keeps 10%
    assert ema_warning(0.9, 28) is None  # 0.9 ** 28 = 0.052
    assert ema_warning(0.0, 28) is None  # no EMA


def _step(epoch: int, step: int, loss: float) -> StepReport:
    return StepReport(0, epoch, step, epoch * 4 + step, 2, loss, 0.0, 0.1, 0.0, np.arange(2) + 2 * step, None)


def test_the_loss_is_the_latest_trained_epoch_s_while_the_next_one_is_being_handed_out():
    # 8 samples, 4 steps an epoch: the next epoch's batches are handed out (its books opened) while this one's
    # last steps train, and the live line said "loss -" for most of the epoch.
    stats = RunStats(num_consumers=1, samples_per_epoch=8, steps_per_epoch=4)
    stats.expect(0, np.arange(8))
    for step, loss in enumerate((2.0, 1.0)):
        stats.record_step(_step(0, step, loss), now=1.0 + step)
    stats.expect(1, np.arange(8))
    assert stats.latest_train_loss() == 1.5  # (2.0 x 2 + 1.0 x 2) / 4 samples
    stats.record_step(_step(1, 0, 0.5), now=3.0)
    assert stats.latest_train_loss() == 0.5


def test_drop_last_leaves_out_a_last_step_of_two_samples(textures, tmp_path):
    from stoker.common.config import make_config
    from stoker.run.controller import Controller

    train, val = textures  # 120 training images: 59 + 59 + 2
    settings = {"data": train, "val": val, "devices": "cpu:1", "image_size": 16, "batch_size": 59}
    kept = Controller(make_config({**settings, "out": tmp_path / "kept"}))  # starts nothing
    assert kept.plan.steps_per_epoch == 3 and len(kept.plan.train_work(0, 2, 0).sample_ids) == 2
    dropped = Controller(make_config({**settings, "drop_last": True, "out": tmp_path / "dropped"}))
    assert dropped.plan.steps_per_epoch == 2 and dropped.plan.samples_trained_per_epoch == 118
    assert all(len(dropped.plan.train_work(epoch, step, 0).sample_ids) == 59 for epoch in (0, 1) for step in (0, 1))

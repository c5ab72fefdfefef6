"""The batch plan: a pure function of (seed, epoch, step, rank) that covers every sample once per epoch."""

from __future__ import annotations

import numpy as np
import pytest

from stoker.pipeline.plan import EpochPlan


@pytest.mark.parametrize("samples,batch,ranks", [(120, 16, 1), (121, 16, 2), (100, 7, 3), (5, 4, 4)])
def test_epoch_covers_every_sample_once(samples, batch, ranks):
    plan = EpochPlan(samples, 0, batch, ranks, seed=1)
    for epoch in range(2):
        ids = np.concatenate([plan.train_work(epoch, step, rank).sample_ids
                              for step in range(plan.steps_per_epoch) for rank in range(ranks)])
        assert np.array_equal(np.sort(ids), np.arange(samples))


def test_last_step_is_split_evenly_and_weighted_by_all_ranks():
    plan = EpochPlan(121, 0, 16, 2, seed=1)
    last = [plan.train_work(0, plan.steps_per_epoch - 1, rank) for rank in range(2)]
    sizes = [len(w.sample_ids) for w in last]
    assert sum(sizes) == 121 - 3 * 32 and max(sizes) - min(sizes) <= 1
    assert all(w.step_samples == sum(sizes) for w in last)


def test_same_inputs_same_batches_and_epochs_differ():
    a, b = EpochPlan(50, 0, 8, 2, seed=3), EpochPlan(50, 0, 8, 2, seed=3)
    assert np.array_equal(a.train_work(1, 2, 1).sample_ids, b.train_work(1, 2, 1).sample_ids)
    assert not np.array_equal(a.permutation(0), a.permutation(1))


def test_validation_shards_cover_the_set_once():
    plan = EpochPlan(10, 23, 4, 3, seed=0)
    ids = np.concatenate([plan.val_work(0, i, r).sample_ids for r in range(3) for i in range(plan.val_batches(r))])
    assert np.array_equal(np.sort(ids), np.arange(23))


@pytest.mark.parametrize("fixed", [False, True])
def test_after_a_consumer_leaves_mid_epoch_every_sample_is_still_in_one_step_and_the_global_batch_as_set(fixed):
    """3 consumers of batch 8 lose one after 2 steps of epoch 0. `shrink`: each survivor keeps 8, a step holds 16,
    the epoch takes more steps and the learning rate scales by 2/3 (Goyal et al.: with the global batch).
    `fixed`: a step keeps 24 samples, 12 a survivor (what their slots are sized for), the epoch the same steps
    as unbroken, on the same schedule."""
    whole = EpochPlan(120, 0, 8, 3, seed=5, fixed_global=fixed)
    survivors = whole.regrouped(2, epoch=0, step=2, offset=48)
    before = [whole.train_work(0, step, rank).sample_ids for step in range(2) for rank in range(3)]
    after = [[survivors.train_work(epoch, step, rank).sample_ids for rank in range(2)]
             for epoch in range(2) for step in range(2 if epoch == 0 else 0, survivors.steps_in(epoch))]
    epoch_0 = np.concatenate(before + [ids for step in after[:survivors.steps_in(0) - 2] for ids in step])
    assert np.array_equal(np.sort(epoch_0), np.arange(120))
    shares = {len(ids) for step in after for ids in step}
    if fixed:
        assert survivors.steps_in(0) == survivors.steps_per_epoch == whole.steps_per_epoch == 5
        assert shares == {12} and survivors.largest_share(2) == 12 and whole.largest_share(1) == 24
        assert survivors.lr_scale == 1.0
        assert [survivors.schedule_step(0, step) for step in (2, 4)] == [2.0, 4.0]
        assert survivors.schedule_step(1, 3) == 5 + 3
    else:
        assert survivors.steps_in(0) == 2 + 5 and survivors.steps_per_epoch == 8  # 72 and 120 samples, 16 a step
        assert max(shares) == 8 == survivors.largest_share(1)
        assert survivors.lr_scale == pytest.approx(2 / 3)
        assert survivors.schedule_step(0, 3) == pytest.approx(2 + 16 / 24)  # samples trained, in whole steps

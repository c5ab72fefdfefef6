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

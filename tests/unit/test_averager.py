"""Overlapped averaging on a real two-process gloo group: what each replica holds after each averaging point."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from stoker.averager import Averager
from stoker.bench.group import run_group


def _two_rounds(rank: int, world: int) -> dict[str, list[float] | float]:
    averager = Averager(nn.Linear(2, 2), sync_every=1, world_size=world, batch_size=1, overlap=True)
    state = averager.float_buckets[0]
    state.fill_(rank + 1.0)  # replicas hold 1 and 2: their average is 1.5
    averager.after_step(0, local_samples=1, global_samples=world)  # sent in the background, nothing applied
    at_first_point = state.unique().tolist()
    state.add_(10.0 * (rank + 1))  # what each replica learns meanwhile: +10 and +20
    averager.after_step(1, local_samples=1, global_samples=world)  # the first average arrives under it
    at_second_point = state.unique().tolist()
    averager.settle()  # the second average (of 11.5 and 21.5) applied, then one blocking average
    spread = state.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return {"first": at_first_point, "second": at_second_point, "final": state.unique().tolist(),
            "largest_difference": (spread - state).abs().max().item()}


def test_overlapped_average_lands_one_window_late_under_the_local_progress_and_replicas_end_identical():
    result = run_group(_two_rounds, 2, (), timeout_s=60)
    assert result["first"] == [1.0]  # training went on from the replica's own state
    assert result["second"] == [1.5 + 10.0]  # the first average, with what rank 0 learned since on top
    assert result["final"] == [16.5]  # the average of 11.5 and 21.5, exactly
    assert result["largest_difference"] == 0.0

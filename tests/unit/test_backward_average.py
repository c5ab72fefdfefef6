"""Averaging started during backward, group by group, on a real two-process gloo group: bitwise the weights of
averaging after the optimizer's step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stoker.bench.group import run_group
from stoker.training.averager import Averager
from stoker.training.models import build_model

# Per step, (samples on rank 0, samples on rank 1): full steps, a short last batch, a rank without samples.
STEPS = [(8, 8), (8, 8), (8, 8), (5, 3), (8, 8), (4, 0), (8, 8)]


def _train(rank: int, world: int, optimizer_name: str, in_backward: bool) -> tuple[dict, int]:
    torch.manual_seed(0)
    model = build_model("resnet8", 10)  # BatchNorm: its running statistics are averaged too
    averager = Averager(model, sync_every=1, world_size=world, in_backward=in_backward)
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=5e-4) if optimizer_name == "adamw"
                 else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4))
    generator = torch.Generator().manual_seed(100 + rank)
    for step, counts in enumerate(STEPS):
        count = counts[rank]
        images = torch.randn(count, 3, 16, 16, generator=generator)
        labels = torch.randint(0, 10, (count,), generator=generator)
        averager.begin_step(step, count, sum(counts), optimizer)
        if count:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
        averager.end_step(step)
    groups = len(averager.backward.groups) if averager.backward else 0
    return {k: v.clone() for k, v in model.state_dict().items()}, groups


def _compare(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    start = build_model("resnet8", 10).state_dict()["head.weight"]
    result = {}
    for optimizer_name in ("sgd", "adamw"):
        blocking, _ = _train(rank, world, optimizer_name, in_backward=False)
        hidden, groups = _train(rank, world, optimizer_name, in_backward=True)
        result[optimizer_name] = {"differing": [k for k in blocking if not torch.equal(blocking[k], hidden[k])],
                                  "groups": groups, "changed": not torch.equal(blocking["head.weight"], start)}
    return result


@pytest.mark.timeout(120)
def test_averaging_during_backward_gives_bitwise_the_weights_of_averaging_after_the_step():
    result = run_group(_compare, 2, (), timeout_s=100)
    for optimizer_name in ("sgd", "adamw"):
        outcome = result[optimizer_name]
        assert outcome["groups"] >= 2, optimizer_name  # more than one group: sends interleave with backward
        assert outcome["changed"], optimizer_name  # it trained
        assert outcome["differing"] == [], optimizer_name

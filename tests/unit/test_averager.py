"""Averaging on a real two-process gloo group: what each replica holds after each averaging point (overlapped), and
what averaging AdamW replicas computes."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from stoker.bench import sync
from stoker.bench.group import run_group
from stoker.training.averager import Averager


def _two_rounds(rank: int, world: int) -> dict[str, list[float] | float]:
    averager = Averager(nn.Linear(2, 2), sync_every=1, world_size=world, overlap=True)
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


ADAMW = {"model": "stoker.bench.sync:small_cnn", "optimizer": "adamw", "batch_size": 8, "image_size": 16}
ADAMW_STEPS = 6


def _adamw_replica(rank: int, world: int) -> dict[str, np.ndarray]:
    """stoker's way: each replica steps AdamW on its own batches, then the Averager averages the parameters."""
    model = sync._model(ADAMW)
    averager = Averager(model, sync_every=1, world_size=world)
    optimizer = sync._optimizer(model, ADAMW)
    for step, (images, labels) in enumerate(sync._batches(rank, ADAMW, ADAMW_STEPS)):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
        averager.after_step(step, local_samples=len(labels), global_samples=world * len(labels))
    return {name: tensor.numpy().copy() for name, tensor in model.state_dict().items()}  # tensors would travel
    # through shared memory that dies with this process


def _in_one_process(world: int, average: str) -> dict[str, torch.Tensor]:
    """The two meanings of data-parallel AdamW, written out plainly in one process: `parameters` keeps one model
    and one AdamW per replica and replaces every replica's parameters by their mean after each step (model
    averaging); `gradients` keeps one model and one AdamW and steps on the mean of the replicas' gradients (DDP)."""
    replicas = [sync._model(ADAMW) for _ in range(world if average == "parameters" else 1)]
    optimizers = [sync._optimizer(model, ADAMW) for model in replicas]
    batches = [sync._batches(rank, ADAMW, ADAMW_STEPS) for rank in range(world)]
    for step in range(ADAMW_STEPS):
        if average == "parameters":
            for model, optimizer, own in zip(replicas, optimizers, batches):
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(model(own[step][0]), own[step][1]).backward()
                optimizer.step()
            with torch.no_grad():
                for tensors in zip(*(model.parameters() for model in replicas)):
                    mean = torch.stack(tensors).mean(dim=0)
                    for tensor in tensors:
                        tensor.copy_(mean)
        else:
            [model], [optimizer] = replicas, optimizers
            optimizer.zero_grad(set_to_none=True)
            for own in batches:  # equal batches: the mean of the losses has the mean of the gradients
                (F.cross_entropy(model(own[step][0]), own[step][1]) / world).backward()
            optimizer.step()
    return replicas[0].state_dict()


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


def test_adamw_replicas_are_model_averaged_each_with_its_own_moments_not_ddp():
    """README: averaging AdamW replicas is model averaging (each keeps its own moment estimates, the parameters are
    averaged), which is not DDP+AdamW. Both references are computed here in one process, without the Averager."""
    stoker = {name: torch.from_numpy(array) for name, array in run_group(_adamw_replica, 2, (), 120).items()}
    model_averaging = _in_one_process(2, "parameters")
    ddp = _in_one_process(2, "gradients")
    assert _largest_difference(stoker, model_averaging) < 1e-5  # float32 rounding: the same arithmetic
    assert _largest_difference(stoker, ddp) > 100 * _largest_difference(stoker, model_averaging)
    assert _largest_difference(stoker, ddp) > 1e-4  # far beyond rounding: AdamW is not linear in the gradient

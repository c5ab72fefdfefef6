"""Parameter averaging across consumers with torch.distributed.

All floating-point parameters and buffers (BatchNorm running statistics included) are re-pointed into one flat
tensor per dtype at start, so averaging is one all_reduce per dtype with no copy in or out: the model *is* the
bucket. Integer buffers (BatchNorm's batch counters) are reconciled with a MAX. The collective doubles as the
barrier that makes every replica continue from the same average at the same time.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn


class Averager:
    """Averages a model's state every `sync_every` steps, weighted by the samples each replica trained on."""

    def __init__(self, model: nn.Module, sync_every: int, world_size: int) -> None:
        self.sync_every = sync_every
        self.world_size = world_size
        self.float_buckets = flatten_float_state(model)
        self.int_tensors = [t for t in _state_tensors(model) if not t.is_floating_point()]
        self.pending = (0, 0)  # samples since the last averaging: (this replica's, all replicas')

    def after_step(self, step: int, local_samples: int, global_samples: int) -> float | None:
        """Count this step's samples; average when `step` closes a window of `sync_every`. Returns seconds spent."""
        self.pending = (self.pending[0] + local_samples, self.pending[1] + global_samples)
        if (step + 1) % self.sync_every:
            return None
        return self.average()

    def average(self) -> float:
        started = time.perf_counter()
        local, total = self.pending
        uniform = local * self.world_size == total
        for bucket in self.float_buckets:
            if not uniform:  # a short last batch: weight each replica by its share of the samples
                bucket.mul_(local * self.world_size / max(1, total))
            dist.all_reduce(bucket)
            bucket.div_(self.world_size)
        for tensor in self.int_tensors:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        self.pending = (0, 0)
        return time.perf_counter() - started

    def digest(self) -> str:
        """A hash of every state byte: replicas are compared by it, not assumed equal."""
        hasher = hashlib.blake2b(digest_size=16)
        for tensor in [*self.float_buckets, *self.int_tensors]:
            hasher.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        return hasher.hexdigest()


def _state_tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def flatten_float_state(model: nn.Module) -> list[torch.Tensor]:
    """Move every floating parameter and buffer into one contiguous tensor per (device, dtype), as views."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for tensor in _state_tensors(model):
        if tensor.is_floating_point():
            groups[(tensor.device, tensor.dtype)].append(tensor)
    buckets = []
    for (device, dtype), tensors in groups.items():
        flat = torch.empty(sum(t.numel() for t in tensors), device=device, dtype=dtype)
        offset = 0
        for tensor in tensors:
            view = flat[offset:offset + tensor.numel()].view_as(tensor)
            view.copy_(tensor.detach())
            tensor.data = view
            offset += tensor.numel()
        buckets.append(flat)
    return buckets

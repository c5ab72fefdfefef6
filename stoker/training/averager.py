"""Parameter averaging across consumers with torch.distributed.

All floating-point parameters and buffers (BatchNorm running statistics included) are re-pointed into one flat
tensor per dtype at start, so averaging is one all_reduce per dtype with no copy in or out: the model *is* the
bucket. Integer buffers (BatchNorm's batch counters) advance alike on every replica while each has samples in
every step; after a step with fewer samples than replicas, where one had none, they are reconciled with a MAX.
The collective doubles as the barrier that makes every replica continue from the same average at the same time.

With an outer optimizer (DiLoCo), the averaged change of the parameters since the last averaging is a
pseudo-gradient: SGD or Nesterov momentum applies it to the parameters as they were at the last averaging.

With `in_backward` (the default for every-step and every-H averaging without an outer optimizer or overlap),
the averaging of a step starts during its backward, group by group, with the same arithmetic
(`backward_average.BackwardAverage`).

With `overlap`, the all_reduce runs in the background while training goes on (`DelayedAverage`): replicas then
share an average one window old, and are made identical again by one blocking average at the end.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from stoker.training import recovery
from stoker.training.backward_average import GROUP_BYTES, BackwardAverage

GPU_GROUP_BYTES = 25 << 20  # DDP's bucket size: the largest group on a GPU
MIN_GPU_GROUP_BYTES = 128 << 10  # below this an NCCL launch and a group's optimizer step cost more than they hide
GPU_GROUPS = 8  # groups a model's parameters are cut into on a GPU, so averaging overlaps most of backward
# Since the last averaging: (this replica's samples, all replicas' samples, steps that were not full).
NOTHING_PENDING = (0, 0, 0)
ALIGN_BYTES = 64  # every view in a flat bucket starts here: cuDNN, NCCL and inductor pick aligned kernels (>= 16)


@dataclass(frozen=True)
class OuterSpec:
    kind: Literal["sgd", "nesterov"]
    lr: float
    momentum: float


class Averager:
    """Averages a model's state every `sync_every` steps, weighted by the samples each replica trained on."""

    def __init__(self, model: nn.Module, sync_every: int, world_size: int,
                 outer: OuterSpec | None = None, overlap: bool = False, in_backward: bool = False) -> None:
        if outer is not None and overlap:
            raise ValueError("an outer optimizer needs the average before it steps: it cannot overlap")
        self.sync_every = sync_every
        self.world_size = world_size
        self.float_buckets, parameters = flatten_float_state(model)
        self.int_tensors = [t for t in _state_tensors(model) if not t.is_floating_point()]
        self.pending = NOTHING_PENDING
        self.outer = OuterOptimizer(outer, parameters) if outer is not None else None
        self.delayed = DelayedAverage(self.float_buckets, world_size) if overlap and world_size > 1 else None
        hide = in_backward and world_size > 1 and outer is None and not overlap
        self.backward = BackwardAverage(model, self.float_buckets, world_size,
                                        _group_bytes(self.float_buckets)) if hide else None

    def regroup(self, world_size: int) -> None:
        """The group changed (a peer died): average over `world_size` replicas from now on; an averaging that was
        in flight in the old group is dropped (the replica went back to the state before it)."""
        self.world_size = world_size
        if self.backward is not None:
            self.backward.world_size = world_size
            self.backward.optimizer, self.backward.works = None, []

    @property
    def holds_average(self) -> bool:
        """Whether every replica holds the averaged model now: right after an averaging, none in flight."""
        return self.replicas_agree and not self.pending[1]

    @property
    def replicas_agree(self) -> bool:
        """Whether replicas are identical right after an averaging (not while one is in flight)."""
        return self.delayed is None

    def after_step(self, step: int, local_samples: int, global_samples: int) -> float | None:
        """Count this step's samples; average when `step` closes a window of `sync_every`. Returns seconds spent."""
        self.begin_step(step, local_samples, global_samples)
        return self.end_step(step)

    def begin_step(self, step: int, local_samples: int, global_samples: int,
                   optimizer: torch.optim.Optimizer | None = None) -> None:
        """Before the step's backward: count its samples and, when it averages and `optimizer` is given, let the
        averaging start during backward (the optimizer then steps each group of parameters as it completes)."""
        local, total, short = self.pending
        # Fewer planned samples than replicas: one had none and skipped its forward pass (its counters lag). A share
        # whose every file was unusable is not seen here (rare; the final replica check reports it).
        self.pending = (local + local_samples, total + global_samples, short + (global_samples < self.world_size))
        if self.backward is not None and optimizer is not None and not (step + 1) % self.sync_every:
            self.backward.arm(optimizer, self._weight())

    def end_step(self, step: int) -> float | None:
        """After the optimizer's step: average when `step` closes a window. Returns the seconds held up."""
        if (step + 1) % self.sync_every:
            return None
        return self.average()

    def average(self) -> float:
        """Average now (or, overlapped, start averaging); returns the seconds this replica was held up."""
        started = time.perf_counter()
        if self.delayed is not None:
            self.delayed.send(self._weight())
            self._reconcile_counters()
            self.pending = NOTHING_PENDING
        elif self.backward is not None and self.backward.armed:
            self.backward.finish()
            self._reconcile_counters()
            self.pending = NOTHING_PENDING
        else:
            self._average_now()
        return time.perf_counter() - started

    def settle(self) -> None:
        """The final model: what is in flight applied, then one blocking average, so every replica ends identical
        whatever H is."""
        if self.delayed is not None:
            self.delayed.apply()
        if self.pending[1] or self.delayed is not None:
            self._average_now()

    def _average_now(self) -> None:
        if self.world_size > 1:
            self._reduce()
        if self.outer is not None:
            self.outer.step()
        self.pending = NOTHING_PENDING

    def _weight(self) -> float:
        """1 when every replica trained on as many samples since the last averaging, else this replica's share
        (a short last batch), so the average weights every sample alike."""
        local, total, _ = self.pending
        return 1.0 if local * self.world_size == total else local * self.world_size / max(1, total)

    def _reduce(self) -> None:
        weight = self._weight()
        for bucket in self.float_buckets:
            if weight != 1.0:
                bucket.mul_(weight)
            recovery.all_reduce(bucket)
            bucket.div_(self.world_size)
        self._reconcile_counters()

    def _reconcile_counters(self) -> None:
        if self.pending[2]:  # a replica without samples skipped its forward pass: counters (BatchNorm's) may differ
            for tensor in self.int_tensors:
                recovery.all_reduce(tensor, op=dist.ReduceOp.MAX)

    def digest(self) -> str:
        """A hash of every state byte: replicas are compared by it, not assumed equal."""
        hasher = hashlib.blake2b(digest_size=16)
        for tensor in [*self.float_buckets, *self.int_tensors]:
            hasher.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        return hasher.hexdigest()


def _state_tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def flatten_float_state(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Move every floating parameter and buffer into one contiguous tensor per (device, dtype), as views.

    Returns the buckets and, per bucket, the view of its leading part that holds the parameters (buffers follow).
    Every view starts at a multiple of ALIGN_BYTES; the padding between views is zeros and stays zeros (averaging
    and the optimizers are elementwise, and no gradient reaches it)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    parameter_counts: dict[tuple[torch.device, torch.dtype], int] = defaultdict(int)
    tensor: torch.Tensor  # parameters first, then any state tensor
    for tensor in model.parameters():
        if tensor.is_floating_point():
            parameter_counts[(tensor.device, tensor.dtype)] += tensor.numel()
    for tensor in _state_tensors(model):  # parameters first, so they lead every bucket
        if tensor.is_floating_point():
            groups[(tensor.device, tensor.dtype)].append(tensor)
    buckets, parameters = [], []
    for key, tensors in groups.items():
        step = max(1, ALIGN_BYTES // key[1].itemsize)
        offsets = _aligned_offsets([t.numel() for t in tensors], step)
        flat = torch.zeros(offsets[-1], device=key[0], dtype=key[1])
        parameter_end = 0
        for tensor, offset in zip(tensors, offsets):
            view = flat[offset:offset + tensor.numel()].view_as(tensor)
            view.copy_(tensor.detach())
            is_parameter = isinstance(tensor, nn.Parameter)
            tensor.data = view
            if is_parameter:
                parameter_end = offset + tensor.numel()
        buckets.append(flat)
        parameters.append(flat[:parameter_end] if parameter_counts[key] else flat[:0])
    return buckets, parameters


def _aligned_offsets(sizes: list[int], step: int) -> list[int]:
    """Where each of `sizes` starts, each a multiple of `step`, and the total length last."""
    offsets, offset = [], 0
    for size in sizes:
        offsets.append(offset)
        offset += -(-size // step) * step
    return [*offsets, offset]


class DelayedAverage:
    """Averaging that overlaps the next window's steps. At an averaging point the replica's state is copied and
    sent into an asynchronous all_reduce; at the next point the average replaces the state it was made from and
    what the replica learned in between is kept on top of it: state = state - sent + average. On GPUs the
    collective runs on its own stream while the device computes; the price is an average one window old, and
    replicas that agree only on it, not bitwise, until `Averager.settle`. Memory: two more copies of the state."""

    def __init__(self, buckets: list[torch.Tensor], world_size: int) -> None:
        self.buckets = buckets
        self.world_size = world_size
        self.sent = [torch.empty_like(b) for b in buckets]  # the state as it was sent
        self.summed = [torch.empty_like(b) for b in buckets]  # the all_reduce's buffer
        self.works: list = []
        self.held = False  # a round was sent and not yet applied

    def send(self, weight: float) -> None:
        self.apply()
        for bucket, sent, summed in zip(self.buckets, self.sent, self.summed):
            sent.copy_(bucket)
            summed.copy_(bucket)
            if weight != 1.0:
                summed.mul_(weight)
            self.works.append(dist.all_reduce(summed, async_op=True))
        self.held = True

    def apply(self) -> None:
        if not self.held:
            return
        self.wait()
        for bucket, sent, summed in zip(self.buckets, self.sent, self.summed):
            # In this order: with no step in between, state - sent is exactly 0 and every replica gets the
            # same bits.
            bucket.sub_(sent).add_(summed, alpha=1 / self.world_size)
        self.held = False

    def wait(self) -> None:
        """Let the round in flight complete (the state is not touched)."""
        works, self.works = self.works, []
        for work in works:
            work.wait()

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        """The round not yet applied, so a resumed run applies it where an uninterrupted one would."""
        self.wait()
        return {"sent": self.sent, "sum": self.summed} if self.held else {}

    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        self.held = bool(state)
        for mine, saved in [*zip(self.sent, state.get("sent", [])), *zip(self.summed, state.get("sum", []))]:
            mine.copy_(saved)


class OuterOptimizer:
    """SGD or Nesterov on the averaged parameter change since the last averaging (DiLoCo's outer step).

    Every replica holds the same anchor and velocity and applies the same update to the same average, so replicas
    stay identical. With lr 1 and momentum 0 the result is the plain average."""

    def __init__(self, spec: OuterSpec, parameters: list[torch.Tensor]) -> None:
        self.spec = spec
        self.parameters = parameters
        self.anchor = [p.detach().clone() for p in parameters]
        self.velocity = [torch.zeros_like(p) for p in parameters]

    def reset_anchor(self) -> None:
        for anchor, parameters in zip(self.anchor, self.parameters):
            anchor.copy_(parameters)

    def step(self) -> None:
        lr, momentum = self.spec.lr, self.spec.momentum
        for parameters, anchor, velocity in zip(self.parameters, self.anchor, self.velocity):
            change = anchor - parameters  # the pseudo-gradient: the average's step, with a gradient's sign
            velocity.mul_(momentum).add_(change)
            update = change.add_(velocity, alpha=momentum) if self.spec.kind == "nesterov" else velocity
            anchor.sub_(update, alpha=lr)
            parameters.copy_(anchor)

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        return {"anchor": self.anchor, "velocity": self.velocity}

    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        for mine, saved in [*zip(self.anchor, state["anchor"]), *zip(self.velocity, state["velocity"])]:
            mine.copy_(saved)


def _group_bytes(buckets: list[torch.Tensor]) -> int:
    on_gpu = bool(buckets) and buckets[0].is_cuda
    return group_bytes(sum(b.numel() * b.element_size() for b in buckets), on_gpu)


def group_bytes(model_bytes: int, on_gpu: bool) -> int:
    """Groups averaged during backward: small on the CPU, where each all_reduce is cheap to start and the backward
    of a small model is short. On a GPU each group costs an optimizer step and an NCCL launch, but DDP's fixed
    25 MB would leave every built-in model up to resnet18 with one or two groups, the first of which fires only
    at the end of backward: overlapping nothing. So the model is cut into about GPU_GROUPS groups, within
    [MIN_GPU_GROUP_BYTES, GPU_GROUP_BYTES]."""
    if not on_gpu:
        return GROUP_BYTES
    return max(MIN_GPU_GROUP_BYTES, min(GPU_GROUP_BYTES, model_bytes // GPU_GROUPS))

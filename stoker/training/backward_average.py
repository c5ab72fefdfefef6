"""Every-step averaging hidden behind backward, with the same arithmetic as averaging after the step.

The flat state (see `averager`) is cut into groups of consecutive parameters from the last layer back; when a group's
gradients are all accumulated, the optimizer steps that group alone and its all_reduce starts, so averaging the late
layers overlaps the backward of the early ones, and `finish` waits and divides before the next forward. The result is
the same because the optimizer's update is per parameter and a slice's sum is the whole's, element by element.
Groups go in one fixed order, so every replica, one without samples too, issues the same collectives. Details:
docs/consumers.md, "Averaging strategies"."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from stoker.training import recovery

GROUP_BYTES = 256 * 1024  # small enough that a small model still has groups to overlap, large enough to batch


@dataclass
class _Group:
    flat: torch.Tensor  # the slice of a flat state bucket holding these parameters
    parameters: list[nn.Parameter]
    waiting_for: int = 0  # gradients not yet accumulated in this step
    stepped: bool = False


class BackwardAverage:
    """Arm it before a step's backward; `finish` after the optimizer's step waits for the average."""

    def __init__(self, model: nn.Module, buckets: list[torch.Tensor], world_size: int,
                 group_bytes: int = GROUP_BYTES) -> None:
        self.world_size = world_size
        self.parameters = [p for p in model.parameters() if p.is_floating_point()]
        self.groups = _groups(self.parameters, buckets, group_bytes)
        self.rest = _uncovered(buckets, self.groups)  # buffers and anything no group holds: sent last
        self.group_of = {id(p): g for g in self.groups for p in g.parameters}
        self.handles = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self.parameters
                        if p.requires_grad]
        self.optimizer: torch.optim.Optimizer | None = None
        self.weight = 1.0
        self.sent = 0  # groups sent in this step, in order
        self.works: list = []

    @property
    def armed(self) -> bool:
        return self.optimizer is not None

    def arm(self, optimizer: torch.optim.Optimizer, weight: float) -> None:
        """The coming backward is a step that averages: step and send each group as soon as it is complete."""
        self.optimizer, self.weight, self.sent, self.works = optimizer, weight, 0, []
        for group in self.groups:
            group.waiting_for = sum(p.requires_grad for p in group.parameters)
            group.stepped = group.waiting_for == 0  # frozen parameters only: nothing to wait for

    def finish(self) -> None:
        """After the optimizer's step: send what is left, in order, wait for everything, divide."""
        for group in self.groups:
            group.stepped = True  # the optimizer's own step took whatever no hook had stepped
        self._send_ready()
        for flat in self.rest:
            self._send(flat)
        for work in self.works:
            recovery.done(work)
        for flat in [*(g.flat for g in self.groups), *self.rest]:
            flat.div_(self.world_size)
        self.optimizer, self.works = None, []

    def _on_gradient(self, parameter: nn.Parameter) -> None:
        if self.optimizer is None:
            return
        group = self.group_of[id(parameter)]
        group.waiting_for -= 1
        if group.waiting_for == 0:
            self._step(group)
            self._send_ready()

    def _step(self, group: _Group) -> None:
        """Step this group's parameters alone: the optimizer skips parameters without a gradient, so the others'
        gradients are set aside meanwhile, and this group's are dropped after (already applied)."""
        members = {id(p) for p in group.parameters}
        aside = [(p, p.grad) for p in self.parameters if p.grad is not None and id(p) not in members]
        for parameter, _ in aside:
            parameter.grad = None
        assert self.optimizer is not None, "groups step only while a step is open"
        self.optimizer.step()
        for parameter, gradient in aside:
            parameter.grad = gradient
        for parameter in group.parameters:
            parameter.grad = None
        group.stepped = True

    def _send_ready(self) -> None:
        while self.sent < len(self.groups) and self.groups[self.sent].stepped:
            self._send(self.groups[self.sent].flat)
            self.sent += 1

    def _send(self, flat: torch.Tensor) -> None:
        if self.weight != 1.0:
            flat.mul_(self.weight)
        self.works.append(dist.all_reduce(flat, async_op=True))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _groups(parameters: list[nn.Parameter], buckets: list[torch.Tensor], group_bytes: int) -> list[_Group]:
    """Consecutive parameters of one bucket, from the last backwards, cut at about `group_bytes`."""
    located = sorted(((_locate(p, buckets), p) for p in parameters), key=lambda item: item[0], reverse=True)
    groups: list[_Group] = []
    current: list[tuple[tuple[int, int], nn.Parameter]] = []
    for (bucket, offset), parameter in located:
        if current and (current[0][0][0] != bucket or _nbytes(current) >= group_bytes):
            groups.append(_group(current, buckets))
            current = []
        current.append(((bucket, offset), parameter))
    if current:
        groups.append(_group(current, buckets))
    return groups


def _locate(parameter: torch.Tensor, buckets: list[torch.Tensor]) -> tuple[int, int]:
    """(bucket index, element offset) of a parameter that `flatten_float_state` made a view of a bucket."""
    for index, bucket in enumerate(buckets):
        if parameter.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr():
            return index, int(parameter.storage_offset() - bucket.storage_offset())
    raise AssertionError("every floating parameter lives in a flat bucket")


def _nbytes(members: list[tuple[tuple[int, int], nn.Parameter]]) -> int:
    return sum(p.numel() * p.element_size() for _, p in members)


def _group(members: list[tuple[tuple[int, int], nn.Parameter]], buckets: list[torch.Tensor]) -> _Group:
    bucket = members[0][0][0]
    start = min(offset for (_, offset), _ in members)
    end = max(offset + p.numel() for (_, offset), p in members)
    return _Group(buckets[bucket][start:end], [p for _, p in members])


def _uncovered(buckets: list[torch.Tensor], groups: list[_Group]) -> list[torch.Tensor]:
    """The parts of each bucket no group holds (the buffers after the parameters), as slices."""
    rest = []
    for bucket in buckets:
        covered = sorted((int(g.flat.storage_offset() - bucket.storage_offset()), g.flat.numel()) for g in groups
                         if g.flat.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr())
        position = 0
        for start, length in covered:
            if start > position:
                rest.append(bucket[position:start])
            position = max(position, start + length)
        if position < bucket.numel():
            rest.append(bucket[position:])
    return rest

"""The simulated device's model for `stoker bench scaling` (`--model stoker.bench.scaling:simulated_model`): apart
from the benchmark's flags so that parsing them does not import torch."""

from __future__ import annotations

import torch
from torch import nn


class SimulatedModel(nn.Module):
    """A tiny classifier plus `params` parameters that take no part in the forward pass (the device time is the
    simulated step's sleep) but are averaged like any other."""

    def __init__(self, num_classes: int, params: int) -> None:
        super().__init__()
        self.head = nn.Linear(3, num_classes)
        self.ballast = nn.Parameter(torch.zeros(max(0, params - 4 * num_classes)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(images.mean(dim=(2, 3)))

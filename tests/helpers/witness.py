"""A model that counts, by content, the samples it trains on (loaded through --model witness:counting_cnn).

Each training image is one flat colour that spells its number (red = number % 256, green = number // 256; written
by tests/faults/test_elastic.py). In training mode the model reads the number back from the normalized pixels and
adds the group's size to `seen[number]`, a buffer, so it is averaged with the weights: after an averaging every
replica's `seen` grows by one for each sample any replica trained, and a step the survivors of a death went back on
leaves no trace. At the end `seen` holds how many times each image was trained, as the model itself saw it.
"""

import torch
import torch.distributed as dist
from nobn import small_cnn
from torch import nn

from stoker.training.to_device import MEAN, STD

CAPACITY = 4096


class CountingCNN(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = small_cnn(num_classes)
        self.register_buffer("seen", torch.zeros(CAPACITY))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.seen.index_add_(0, numbers(images), torch.full((len(images),), float(group_size())))
        return self.net(images)


def counting_cnn(num_classes: int) -> nn.Module:
    return CountingCNN(num_classes)


def group_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def numbers(images: torch.Tensor) -> torch.Tensor:
    """The number each normalized image spells, read from its mean colour."""
    mean = torch.tensor(MEAN, device=images.device).view(1, 3)
    std = torch.tensor(STD, device=images.device).view(1, 3)
    pixels = ((images.float().mean(dim=(2, 3)) * std + mean) * 255).round().long()
    return pixels[:, 0] + 256 * pixels[:, 1]

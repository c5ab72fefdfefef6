"""A model whose replica writes a warning straight to file descriptor 2 in the middle of training, as torch's C++
code or a library in a consumer would (loaded through --model noisy:noisy_cnn)."""

import os

from nobn import small_cnn
from torch import nn

WARNING = "noisy: a warning written by a consumer"


class Noisy(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = small_cnn(num_classes)
        self.training_steps = 0

    def forward(self, images):
        if self.training:
            self.training_steps += 1
            if self.training_steps in (3, 20):
                os.write(2, f"{WARNING} at step {self.training_steps}\n".encode())
        return self.net(images)


def noisy_cnn(num_classes: int) -> nn.Module:
    return Noisy(num_classes)

"""A model that writes down every input it sees (process, train or eval mode, shape) to the file named by
STOKER_TEST_SHAPES: the --val-image-size test reads what the consumer trained and validated on
(loaded through --model sized:recording_cnn). With STOKER_TEST_DIGESTS it also writes each input's SHA-256 there,
in the same order (the --image-size-ramp resume test compares the bytes two runs trained on)."""

import hashlib
import multiprocessing
import os

from torch import nn


class RecordingCnn(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(8, num_classes))

    def forward(self, images):
        with open(os.environ["STOKER_TEST_SHAPES"], "a") as record:
            mode = "train" if self.training else "eval"
            record.write(f"{multiprocessing.current_process().name}|{mode}|{tuple(images.shape)}\n")
        if "STOKER_TEST_DIGESTS" in os.environ:
            with open(os.environ["STOKER_TEST_DIGESTS"], "a") as record:
                digest = hashlib.sha256(images.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
                record.write(f"{multiprocessing.current_process().name}|{mode}|{digest}\n")
        return self.body(images)


def recording_cnn(num_classes: int) -> nn.Module:
    return RecordingCnn(num_classes)


def conv_head(num_classes: int) -> nn.Module:
    """A classifier whose head is a 1x1 convolution: no nn.Linear for --lr-head-multiplier to find."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Conv2d(8, num_classes, 1), nn.Flatten())

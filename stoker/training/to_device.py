"""Slot to device: a batch slot in shared memory becomes a normalized float batch on the device (for a consumer, and
for a Loader with a device).

The slot is copied out on the host and handed back at once, before any device work, so producers refill it while
the device trains. On a GPU the host copies into one of several pinned staging buffers, the host-to-device copy
runs on a side stream and the compute stream waits only for that copy's event: the host prepares batch k+1 while
the device trains on batch k, and the GPU never waits for a host memcpy. A staging buffer is rewritten only after
the event of the copy that read it has completed, and its device-side twin only after the compute that read it.
The slot itself is never read by the device (the host copy out of it is synchronous), so handing it back early is
safe. Normalization (and the memory format the model wants) happens on the device, on uint8 input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stoker.pipeline.plan import Kind
from stoker.pipeline.ring import SlotRing
from stoker.training.streams import DeviceOps, ops_for

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
NUM_STAGING = 2  # one being copied to the device while the host fills the other


def normalization_constants(mean: tuple[float, ...], std: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, 3, 1, 1) float32 on the CPU: 255 mean and 1 / (255 std), computed once, here, for the feed and for
    `stoker.load`'s preprocess alike (the same bits wherever they are copied to)."""
    scaled_std = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1) * 255
    return torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1) * 255, 1 / scaled_std


@dataclass
class Staging:
    """One pinned host buffer and its device twin, with the events that say when each may be rewritten."""

    host_images: torch.Tensor
    host_labels: torch.Tensor
    device_images: torch.Tensor
    device_labels: torch.Tensor
    copied: Any  # the host-to-device copy out of host_* has completed
    used: Any  # the compute that read device_* has completed
    in_use: bool = False  # a copy was issued from it (the events mean something)


class DeviceLoader:
    """Takes a slot (uint8 NHWC images, labels, sample ids) to the device as normalized float NCHW, in the memory
    format asked for: with `channels_last` the model is in channels_last too, otherwise the input is contiguous
    NCHW (a permuted NHWC buffer is channels_last by accident, which makes cuDNN convert every step)."""

    def __init__(self, ring: SlotRing, device: torch.device, channels_last: bool = True,
                 ops: DeviceOps | None = None, num_staging: int = NUM_STAGING) -> None:
        self.ring = ring
        self.ops = ops or ops_for(device)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.mean, self.inv_std = (self._on_device(c) for c in normalization_constants(MEAN, STD))
        self.staging = [self._staging() for _ in range(num_staging)] if self.ops.asynchronous else []
        self.turn = 0

    def take(self, slot: int | None, release: Callable[[int], None], kind: Kind = "train",
             fed: Callable[[], None] = lambda: None,
             epoch: int | None = None) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """The batch in `slot` on the device; `release(slot)` is called as soon as the slot may be refilled. `kind`
        and `epoch` say which side the slot's images have (`--val-image-size`, `--image-size-ramp`; the epoch
        matters only with a ramp). `fed()` is called once the compute stream
        waits for the batch's copy, before the normalization: a step's start event goes there, so the
        normalization's kernels count as the step's compute (on the CPU, where a step starts when the host has its
        batch, it is called last)."""
        if slot is None:
            fed()
            return torch.empty(0), torch.empty(0, dtype=torch.int64), np.zeros(0, dtype=np.int64)
        count = int(self.ring.counts[slot])
        ids = self.ring.ids[slot, :count].copy()
        pixels = self.ring.images_of(kind, epoch)[slot, :count]
        if not self.staging:
            labels = torch.from_numpy(self.ring.labels[slot, :count].copy())
            images = self._normalize(torch.from_numpy(pixels))  # the copy out of the slot
            release(slot)
            fed()
            return images, labels, ids
        stage = self._next_staging()
        np.copyto(_sized(stage.host_images, pixels.shape).numpy(), pixels)  # beats Tensor.copy_
        np.copyto(stage.host_labels[:count].numpy(), self.ring.labels[slot, :count])
        release(slot)
        device_images = self._copy_to_device(stage, count, pixels.shape)
        fed()
        images = self._normalize(device_images)
        labels = stage.device_labels[:count].clone()
        self.ops.record(stage.used, self.ops.compute_stream())
        return images, labels, ids

    def _next_staging(self) -> Staging:
        """The next buffer in turn, once the copy that last read it has completed (the host is about to
        overwrite it). Usually it has: the consumer held the host back until the step that read it ended
        (`StepClock.begin`), so this wait, a blocking event's (it sleeps), is rarely reached."""
        stage = self.staging[self.turn]
        self.turn = (self.turn + 1) % len(self.staging)
        if stage.in_use and not self.ops.done(stage.copied):
            self.ops.synchronize(stage.copied)
        return stage

    def _copy_to_device(self, stage: Staging, count: int, shape: tuple[int, ...]) -> torch.Tensor:
        """On the side stream, after the compute that read the device buffer last time; the compute stream
        waits for the copy's event, the host does not. Returns the device images, of `shape`."""
        ops, copy_stream = self.ops, self.ops.copy_stream()
        if stage.in_use:
            ops.wait(copy_stream, stage.used)
        device_images = _sized(stage.device_images, shape)
        with ops.on(copy_stream):
            ops.copy(device_images, _sized(stage.host_images, shape))
            ops.copy(stage.device_labels[:count], stage.host_labels[:count])
        ops.record(stage.copied, copy_stream)
        ops.wait(ops.compute_stream(), stage.copied)
        stage.in_use = True
        return device_images

    def _normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 NHWC -> float NCHW in the chosen memory format, (x - mean) / std."""
        return normalize_pixels(pixels, self.mean, self.inv_std, self.memory_format)

    def _on_device(self, constant: torch.Tensor) -> torch.Tensor:
        on_device = self.ops.empty((1, 3, 1, 1), torch.float32)
        on_device.copy_(constant)
        return on_device

    def _staging(self) -> Staging:
        """Buffers of a slot's bytes, flat: a training and a validation batch of other sides both fit."""
        images_shape, batch = self.ring.pixels.shape[1:], self.ring.labels.shape[1]
        ops = self.ops
        return Staging(ops.pinned(images_shape, torch.uint8), ops.pinned((batch,), torch.int64),
                       ops.empty(images_shape, torch.uint8), ops.empty((batch,), torch.int64),
                       ops.new_event(), ops.new_event())


def _sized(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The first bytes of a flat staging buffer as a batch of `shape` (count, side, side, 3)."""
    return flat[:int(np.prod(shape))].view(shape)


def normalize_pixels(pixels: torch.Tensor, mean_255: torch.Tensor, inv_std_255: torch.Tensor,
                     memory_format: torch.memory_format, device: torch.device | None = None,
                     non_blocking: bool = False) -> torch.Tensor:
    """uint8 NHWC -> float32 NCHW (x - 255 mean) * (1 / (255 std)) on `device`, in `memory_format`, with the
    constants of `normalization_constants`: one conversion pass, in place after it. The feed, `stoker.load`'s
    preprocess, eval and the benchmarks all call this, so a file gives validation's tensor to the bit.

    channels_last is NHWC in memory, where a (1, 3, 1, 1) constant broadcasts over an innermost dimension of 3,
    which TensorIterator cannot vectorize on the CPU (measured: 2.5-3x slower than the same arithmetic on NCHW).
    The same arithmetic on rows of W*C values, against the constants tiled W times, is contiguous and vectorized;
    the results are bitwise the same (each element gets the same two IEEE operations)."""
    count, height, width, channels = pixels.shape
    images = torch.empty((count, channels, height, width), dtype=torch.float32, device=device or pixels.device,
                         memory_format=memory_format)
    if memory_format != torch.channels_last:
        images.copy_(pixels.permute(0, 3, 1, 2), non_blocking=non_blocking)
        return images.sub_(mean_255).mul_(inv_std_255)
    rows = images.permute(0, 2, 3, 1).view(count * height, width * channels)  # the NHWC memory of `images`
    rows.copy_(pixels.reshape(count * height, width * channels), non_blocking=non_blocking)
    rows.sub_(mean_255.reshape(channels).repeat(width)).mul_(inv_std_255.reshape(channels).repeat(width))
    return images

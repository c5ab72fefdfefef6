"""torch.compile done before the group's first collective, so that no rank's compile times out another.

Compiled lazily, a model compiles at its first step, again at the first short batch (a new shape), and again at
the first validation (eval mode): minutes each under contention (8 consumers compiling on 16 cores), while a peer
that finished first waits in an NCCL collective whose timeout (60 s) runs from when it was enqueued. So each
consumer compiles every graph it will need at start, with a dynamic batch dimension (one graph for every batch
of 2 or more: the full one, the short last one, validation's) and at batch size 1 (which dynamo specializes), on
dummy input, and leaves the model exactly as it was; then the consumers meet through the store, which a slow
compile cannot time out (it waits up to COMPILE_ALLOWANCE_S, checking that the run is still on), before any
collective.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from stoker.training.accel import MixedPrecision

COMPILE_ALLOWANCE_S = 1800.0  # a cold inductor compile of a large model on a busy machine: minutes, not hours
POLL_S = 0.05


def warm_up(model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor], precision: MixedPrecision,
            device: torch.device, batch_size: int, image_size: int, num_classes: int, channels_last: bool,
            val_image_size: int | None = None) -> None:
    """Run the compiled `forward` (and its backward) in train and eval mode, batch dimension dynamic, and in eval
    mode at `val_image_size` too (--val-image-size: validation's own shape); the model's parameters, buffers,
    gradients and the random state come out as they went in."""
    saved = [tensor.detach().clone() for tensor in (*model.parameters(), *model.buffers())]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    sizes = warm_up_sizes(batch_size)
    try:
        for size in sizes:
            images = torch.zeros((size, 3, image_size, image_size), device=device).contiguous(
                memory_format=memory_format)
            labels = torch.arange(size, device=device) % max(1, num_classes)
            torch._dynamo.maybe_mark_dynamic(images, 0)
            torch._dynamo.maybe_mark_dynamic(labels, 0)
            model.train()
            with precision.autocast():
                loss = F.cross_entropy(forward(images), labels)
            loss.backward()
            model.eval()
            with torch.no_grad(), precision.autocast():
                forward(images)
                if val_image_size not in (None, image_size):
                    val_images = torch.zeros((size, 3, val_image_size, val_image_size), device=device).contiguous(
                        memory_format=memory_format)
                    torch._dynamo.maybe_mark_dynamic(val_images, 0)
                    forward(val_images)
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for tensor, value in zip((*model.parameters(), *model.buffers()), saved):
                tensor.copy_(value)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
        model.train()


def warm_up_sizes(batch_size: int) -> list[int]:
    """Half the batch first (compiled with a dynamic batch dimension), then the full batch (which must reuse that
    graph), then 1: dynamo specializes size 1, so a rank whose share of a short step, or whose last validation
    batch, holds one sample would otherwise compile mid-run while its peers wait in an NCCL collective."""
    if batch_size < 2:
        return [batch_size]
    return [max(2, batch_size // 2), batch_size, 1]


def wait_for_peers(store: dist.Store, name: str, world_size: int, alive: Callable[[], None],
                   allowance_s: float = COMPILE_ALLOWANCE_S) -> None:
    """Every rank has reached `name` (through the store: no collective is enqueued while a peer still compiles).
    `alive()` raises when this process must stop."""
    key = f"stoker-ready/{name}"
    store.add(key, 1)
    deadline = time.monotonic() + allowance_s
    while store.add(key, 0) < world_size:
        alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: not every consumer got there within {allowance_s:.0f} s "
                               "(a consumer's torch.compile is stuck?)")
        time.sleep(POLL_S)

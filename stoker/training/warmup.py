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

from stoker.training import startup
from stoker.training.accel import MixedPrecision

COMPILE_ALLOWANCE_S = 1800.0  # a cold inductor compile of a large model on a busy machine: minutes, not hours
POLL_S = 0.05


def warm_up(model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor], precision: MixedPrecision,
            device: torch.device, batch_size: int, image_size: int, num_classes: int, channels_last: bool,
            val_image_size: int | None = None, one_sample: tuple[bool, bool] = (True, True),
            ramp_sizes: tuple[int, ...] = ()) -> None:
    """Run the compiled `forward` (and its backward) in train and eval mode, batch dimension dynamic, and in eval
    mode at `val_image_size` too (--val-image-size: validation's own shape); the model's parameters, buffers,
    gradients and the random state come out as they went in. `one_sample`: whether the run's plan can give a
    training share, and a validation batch, of one sample (`EpochPlan.one_sample_batches`): size 1 is warmed up
    only in the modes where it can occur. A BatchNorm cannot train on one value per channel (a 1x1 last stage, a
    BatchNorm1d head), so a run that never meets such a batch must not fail on one at its warm-up. `ramp_sizes`:
    the other sides training reaches (`--image-size-ramp`), each a shape of its own, trained at too."""
    startup.phase(startup.COMPILING)
    saved = [tensor.detach().clone() for tensor in (*model.parameters(), *model.buffers())]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    sides = [image_size] if val_image_size in (None, image_size) else [image_size, val_image_size]
    try:
        for size in warm_up_sizes(batch_size):
            train, evaluate = (True, True) if size != 1 or batch_size == 1 else one_sample
            images = [_dummy(size, side, device, memory_format) for side in sides]
            if train:
                labels = torch.arange(size, device=device) % max(1, num_classes)
                torch._dynamo.maybe_mark_dynamic(labels, 0)
                model.train()
                ramped = [_dummy(size, side, device, memory_format) for side in ramp_sizes if side != image_size]
                for batch in (images[0], *ramped):
                    with precision.autocast():
                        loss = F.cross_entropy(forward(batch), labels)
                    loss.backward()
            if evaluate:
                model.eval()
                with torch.no_grad(), precision.autocast():
                    for batch in images:
                        forward(batch)
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for tensor, value in zip((*model.parameters(), *model.buffers()), saved):
                tensor.copy_(value)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)
        model.train()


def _dummy(size: int, side: int, device: torch.device, memory_format: torch.memory_format) -> torch.Tensor:
    images = torch.zeros((size, 3, side, side), device=device).contiguous(memory_format=memory_format)
    torch._dynamo.maybe_mark_dynamic(images, 0)
    return images


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
    startup.phase(startup.PEERS_COMPILING)
    key = f"stoker-ready/{name}"
    store.add(key, 1)
    deadline = time.monotonic() + allowance_s
    while store.add(key, 0) < world_size:
        alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: not every consumer got there within {allowance_s:.0f} s "
                               "(a consumer's torch.compile is stuck?)")
        time.sleep(POLL_S)

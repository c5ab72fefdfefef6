"""Which GPU `device="cuda"` means for this rank (`stoker.Loader`)."""

from __future__ import annotations

import os

import torch


def rank_gpu() -> int:
    """This rank's GPU, never simply cuda:0 for every rank. In order:
    1. the device the default process group is bound to (`init_process_group(device_id=...)`): the rank's own
       by the user's word;
    2. the current device once CUDA is initialized, if it is not 0: the user's `torch.cuda.set_device`. Current
       device 0 says nothing: a script that moves its model with `.to(f"cuda:{local_rank}")` and never calls
       `set_device` has initialized CUDA with 0 current on every rank;
    3. the only GPU where a rank sees one (SLURM's --gpus-per-task=1, a per-rank CUDA_VISIBLE_DEVICES);
    4. cuda:LOCAL_RANK (torchrun on a machine whose GPUs every rank sees); else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        bound = dist.group.WORLD.bound_device_id  # type: ignore[union-attr]  # initialized: the default group
        if bound is not None and bound.type == "cuda" and bound.index is not None:
            return bound.index
    if torch.cuda.is_initialized() and torch.cuda.current_device() != 0:
        return torch.cuda.current_device()
    local = os.environ.get("LOCAL_RANK")
    if torch.cuda.device_count() == 1 or local is None:
        return 0
    return int(local)

"""An out-of-memory error that says where the batch came from: under `--global-batch fixed` a run resumed on fewer
GPUs gives each a larger share than `--batch-size`, which may not fit where the first run's did."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def fixed_share_note(batch_size: int, largest_share: int, consumers: int, global_batch: str) -> str:
    """Why a consumer's batch may be larger than --batch-size ("" where it is not)."""
    if global_batch != "fixed" or largest_share <= batch_size:
        return ""
    return (f"--global-batch fixed keeps the run's first global batch, which gives each of these {consumers} "
            f"device(s) up to {largest_share} samples a step, not --batch-size {batch_size}: resume with "
            f"--global-batch shrink (each device keeps {batch_size}), or on as many devices as the run started with")


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error))


@contextmanager
def explaining_out_of_memory(note: str) -> Iterator[None]:
    """An out-of-memory error inside raised again with `note` first (nothing changes where `note` is "")."""
    try:
        yield
    except RuntimeError as error:
        if not note or not is_out_of_memory(error):
            raise
        raise torch.OutOfMemoryError(f"{note}. {str(error).splitlines()[0][:300]}") from error

"""The samples between the ring and a `stoker.Loader`'s loop: no step is ever empty.

A step none of whose files was usable (or a short last step with no sample for this rank) takes one sample from
the next batch, whose rest is the next step's: every sample is still handed out once and every rank hands out
len() batches. This object holds what was pulled and not yet handed out, the loan a saved state recorded, and the
last sample handed out, which a step repeats only where no later batch of the epoch has a sample left.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from stoker.common.procs import StokerRunError

log = logging.getLogger(__name__)

Out = tuple[torch.Tensor, torch.Tensor, np.ndarray]  # images, labels, dataset positions


@dataclass(frozen=True)
class _Pool:
    """Samples of this rank's batches pulled from the ring and not yet handed out. A step none of whose own files
    was usable takes its one sample from the next batch, so `through` (the last batch pulled) may be ahead of the
    step handed out next; `lent` of batch `through`'s samples went to earlier steps."""

    images: torch.Tensor
    labels: torch.Tensor
    ids: np.ndarray
    through: int
    lent: int = 0

    def split(self, count: int) -> tuple[Out, _Pool]:
        rest = _Pool(self.images[count:], self.labels[count:], self.ids[count:], self.through, self.lent + count)
        return (self.images[:count], self.labels[:count], self.ids[:count]), rest


class LentBatches:
    """What was pulled out of the ring and not yet handed out (`serve`), and what a loaded state lent."""

    def __init__(self) -> None:
        self._pool: _Pool | None = None
        self._last_out: Out | None = None  # a sample handed out
        self.restored: tuple[int, int] | None = None  # from a loaded state: (batch, samples handed out before)
        self.repeated_samples = 0  # handed out twice to keep a batch from being empty (`summary()`)

    def begin_epoch(self) -> None:
        self._pool, self._last_out = None, None

    def end_epoch(self) -> None:
        """Nothing of an epoch is lent to the next."""
        self._pool = None

    def saved(self, step: int) -> list[int] | None:
        """The loan `state_dict()` records when the next step to hand out is `step`: [batch, samples lent]."""
        pool = self._pool
        return [pool.through, pool.lent] if pool is not None and pool.through >= step else None

    def serve(self, epoch: int, step: int, steps: int, take: Callable[[int], Out], rank: int) -> Out:
        """This rank's batch `step` of `steps`, never empty; `take(k)` pulls this rank's batch k out of the ring.
        Only where no later batch has a sample left does a step repeat one already handed out this epoch
        (counted in `repeated_samples`)."""
        pool = self._pool
        if pool is None and self.restored is not None:
            (through, lent), self.restored = self.restored, None
            pool = self._pull_lent(take, step, through, lent)
        elif pool is None or pool.through < step:
            pool = self._pull(take, step)
        borrowed = False
        while not len(pool.ids) and pool.through + 1 < steps:
            pool, borrowed = self._pull(take, pool.through + 1), True
        self._pool = pool  # pulled through `pool.through`, even when nothing of it is left to hand out
        if not len(pool.ids):
            return self._repeat_last(epoch, step, rank)
        out, self._pool = pool.split(1 if borrowed else len(pool.ids))
        # A copy: a view would keep the whole batch alive, and the loop's in-place changes would reach the repeat.
        self._last_out = (out[0][-1:].clone(), out[1][-1:].clone(), out[2][-1:].copy())
        return out

    @staticmethod
    def _pull(take: Callable[[int], Out], step: int, drop: int = 0) -> _Pool:
        """This rank's batch `step` out of the ring, less its first `drop` samples (handed out before a save)."""
        images, labels, ids = take(step)
        return _Pool(images[drop:], labels[drop:], ids[drop:], step, drop)

    def _pull_lent(self, take: Callable[[int], Out], step: int, through: int, lent: int) -> _Pool:
        """After a resume whose save fell while batch `through` had lent `lent` samples to earlier steps: the
        batches up to it (empty, or their samples would not have been lent), less what was handed out, as the
        saved run held it."""
        for empty in range(step, through):
            self._pull(take, empty)
        return self._pull(take, through, lent)

    def _repeat_last(self, epoch: int, step: int, rank: int) -> Out:
        if self._last_out is None:
            raise StokerRunError(f"rank {rank}: no file of epoch {epoch} up to its last step was usable on this "
                                 f"rank: there is no sample to hand out")
        self.repeated_samples += 1
        log.warning("epoch %d step %d: no file left that this rank could use; repeating sample %d (trained twice "
                    "this epoch, counted in summary()['repeated_samples']) so that no batch is empty", epoch, step,
                    int(self._last_out[2][0]))
        return self._last_out

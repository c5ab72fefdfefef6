"""What every batch holds, as a pure function of (seed, epoch, step, rank).

Whichever producer builds a batch, and whenever, the bytes are the same: determinism independent of the number of
producers and of timing, exactly-once delivery, re-issue of a dead producer's work, and exact resume.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np

Kind = Literal["train", "val"]


@dataclass(frozen=True)
class BatchPlan:
    """One batch for one consumer: which samples, in which order, and how to augment them."""

    kind: Kind
    epoch: int
    step: int
    rank: int
    sample_ids: np.ndarray  # int64 positions in the train or val index
    step_samples: int  # samples of this step over all ranks: the averaging weight's denominator

    @property
    def key(self) -> tuple[str, int, int, int]:
        return (self.kind, self.epoch, self.step, self.rank)


@dataclass(frozen=True)
class EpochPlan:
    num_train: int
    num_val: int
    batch_size: int
    num_consumers: int
    seed: int
    drop_last: bool = False  # as in DataLoader: no short last step (`stoker.Loader(drop_last=True)`)

    @property
    def steps_per_epoch(self) -> int:
        per_step = self.batch_size * self.num_consumers
        return self.num_train // per_step if self.drop_last else -(-self.num_train // per_step)

    @property
    def samples_per_epoch(self) -> int:
        return self.num_train

    @property
    def samples_trained_per_epoch(self) -> int:
        """The samples an epoch's steps hold: all of them, less a dropped short last step's."""
        return min(self.num_train, self.steps_per_epoch * self.batch_size * self.num_consumers)

    def train_work(self, epoch: int, step: int, rank: int) -> BatchPlan:
        order = self.permutation(epoch)
        per_step = self.batch_size * self.num_consumers
        chunk = order[step * per_step:(step + 1) * per_step]
        # The last step is split evenly: shard sizes differ by at most one sample.
        bounds = np.linspace(0, len(chunk), self.num_consumers + 1).round().astype(int)
        return BatchPlan("train", epoch, step, rank, chunk[bounds[rank]:bounds[rank + 1]], len(chunk))

    def permutation(self, epoch: int) -> np.ndarray:
        return _permutation(self.seed, epoch, self.num_train)

    def val_batches(self, rank: int) -> int:
        shard = self._val_shard(rank)
        return -(-len(shard) // self.batch_size)

    def val_work(self, epoch: int, index: int, rank: int) -> BatchPlan:
        shard = self._val_shard(rank)
        ids = shard[index * self.batch_size:(index + 1) * self.batch_size]
        return BatchPlan("val", epoch, index, rank, ids, len(ids))

    def _val_shard(self, rank: int) -> np.ndarray:
        bounds = np.linspace(0, self.num_val, self.num_consumers + 1).round().astype(int)
        return np.arange(bounds[rank], bounds[rank + 1], dtype=np.int64)


@functools.lru_cache(maxsize=2)
def _permutation(seed: int, epoch: int, size: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch, 0x7A1]).permutation(size)
    order.flags.writeable = False
    return order


def sample_rng(seed: int, kind: Kind, epoch: int, sample_id: int) -> np.random.Generator:
    """The augmentation draws of one sample in one epoch; independent of which batch or producer holds it."""
    return np.random.default_rng([seed, 0 if kind == "train" else 1, epoch, sample_id])


def step_rng(seed: int, epoch: int, step: int, rank: int) -> np.random.Generator:
    """The device-side draws of one rank's batch (mixup, cutmix, random erasing): the same whichever producers
    built it, and on resume."""
    return np.random.default_rng([seed, 2, epoch, step, rank])

"""What every batch holds, as a pure function of (seed, epoch, step, rank) and the consumers' membership.

Whichever producer builds a batch, and whenever, the bytes are the same: determinism independent of the number of
producers and of timing, exactly-once delivery, re-issue of a dead producer's work, and exact resume.

An epoch is one permutation of the training set, eaten from its start in steps of `batch_size` x consumers. When
the consumers change (one died and the survivors go on, `run/membership.py`), the plan is made again from where the
agreed steps ended: the same permutation, from that sample on, in steps of the new count (or, with
`--global-batch fixed`, in steps of the first count's size, each consumer a larger share). So the plan of a run is
a pure function of (seed, epoch, position in the epoch, membership history), and every sample of every epoch is
still in exactly one step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
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
    """The steps of every epoch for `num_consumers`. From `start_step` of `start_epoch` on, step k holds the
    samples from `start_offset` + (k - start_step) x the step's size: a plan made again after the consumers changed
    mid-epoch (`start_offset` samples were trained, in `start_step` steps, before). Defaults: the plan of the whole
    run, where step k of any epoch starts at k x the step's size."""

    num_train: int
    num_val: int
    batch_size: int
    num_consumers: int
    seed: int
    drop_last: bool = False  # as in DataLoader: no short last step (`stoker.Loader(drop_last=True)`)
    start_epoch: int = 0
    start_step: int = 0
    start_offset: int = 0
    # The consumers the learning-rate schedule was made for (the run's first count): `schedule_step`.
    reference_consumers: int | None = None
    # `--global-batch fixed`: a step holds the reference count's samples whatever the consumers, each a larger share
    # when there are fewer (the optimizer steps and the schedule stay the run's); else each keeps `batch_size`.
    fixed_global: bool = False

    @property
    def per_step(self) -> int:
        consumers = (self.reference_consumers or self.num_consumers) if self.fixed_global else self.num_consumers
        return self.batch_size * consumers

    def largest_share(self, fewest: int) -> int:
        """The most samples one consumer's batch of a step may hold while at least `fewest` consumers train: the
        batch slots are sized for it."""
        return -(-self.reference.per_step // max(1, fewest)) if self.fixed_global else self.batch_size

    @property
    def steps_per_epoch(self) -> int:
        """Steps of a whole epoch (every epoch after `start_epoch`)."""
        return self._steps(self.num_train)

    def steps_in(self, epoch: int) -> int:
        """Steps of `epoch` as this plan numbers them: the steps before the plan's start included."""
        if epoch != self.start_epoch or not self.start_offset:
            return self.steps_per_epoch
        return self.start_step + self._steps(self.num_train - self.start_offset)

    def offset(self, epoch: int, step: int) -> int:
        """Samples of `epoch` in the steps before `step`."""
        if epoch == self.start_epoch and step >= self.start_step:
            return min(self.num_train, self.start_offset + (step - self.start_step) * self.per_step)
        return min(self.num_train, step * self.per_step)

    def _steps(self, samples: int) -> int:
        return samples // self.per_step if self.drop_last else -(-samples // self.per_step)

    @property
    def samples_per_epoch(self) -> int:
        return self.num_train

    @property
    def samples_trained_per_epoch(self) -> int:
        """The samples an epoch's steps hold: all of them, less a dropped short last step's."""
        return min(self.num_train, self.steps_per_epoch * self.per_step)

    @functools.cached_property
    def reference(self) -> EpochPlan:
        """The whole run's plan at the count the learning-rate schedule was made for."""
        return replace(self, num_consumers=self.reference_consumers or self.num_consumers, start_epoch=0,
                       start_step=0, start_offset=0, reference_consumers=None)

    def schedule_step(self, epoch: int, step: int) -> float:
        """Where `step` stands on the learning-rate schedule, in steps of the reference count: its own global step
        while the consumers have not changed, else the samples before it over the reference step's size."""
        whole = self.reference
        if whole.num_consumers == self.num_consumers and not self.start_offset:
            return float(epoch * whole.steps_per_epoch + step)
        return epoch * whole.steps_per_epoch + self.offset(epoch, step) / whole.per_step

    @property
    def lr_scale(self) -> float:
        """The learning rate follows the global batch (Goyal et al. 2017): fewer consumers, a smaller step."""
        return self.per_step / self.reference.per_step

    def regrouped(self, consumers: int, epoch: int, step: int, offset: int) -> EpochPlan:
        """The plan from step `step` of `epoch` (after `offset` of its samples) for `consumers`."""
        return replace(self, num_consumers=consumers, start_epoch=epoch, start_step=step, start_offset=offset,
                       reference_consumers=self.reference.num_consumers)

    def continuing(self, epoch: int, step: int, offset: int) -> EpochPlan:
        """This plan where its step `step` of `epoch` starts after `offset` samples, else the plan made again from
        there (a state saved at another count, or after one changed)."""
        return self if self.offset(epoch, step) == offset else self.regrouped(self.num_consumers, epoch, step, offset)

    def one_sample_batches(self) -> tuple[bool, bool]:
        """(whether some rank's share of a training step can hold exactly one sample, whether some rank's
        validation batch can), for this plan's consumers: a compiled model warms up at size 1 (which a BatchNorm
        cannot train on) only where the run can meet it. A plan made again after the consumers changed (elastic
        CPU runs) has its own answer."""
        steps = [self.per_step]  # a whole step, then the epoch's short last step (the start epoch's too)
        if not self.drop_last:
            steps += [self.num_train % self.per_step, (self.num_train - self.start_offset) % self.per_step]
        train = any(1 in _split(samples, self.num_consumers) for samples in steps if samples)
        val = any(shard % self.batch_size == 1 or (shard and self.batch_size == 1)
                  for shard in _split(self.num_val, self.num_consumers))
        return train, val

    def train_work(self, epoch: int, step: int, rank: int) -> BatchPlan:
        order = self.permutation(epoch)
        first = self.offset(epoch, step)
        chunk = order[first:first + self.per_step]
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


def _split(samples: int, parts: int) -> list[int]:
    """`samples` split into `parts` as `train_work` and `_val_shard` split them (sizes differ by one at most)."""
    return np.diff(np.linspace(0, samples, parts + 1).round().astype(int)).tolist()


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

"""Where a `stoker.Loader` stands in its epochs, and where a state it loaded makes it continue.

A Loader's batch k of epoch e on rank r is a pure function of (seed, e, k, r): its place is (epoch, step), and a
state saved at another world size is the plan made again from the samples its epoch had trained. This object
keeps that place, writes it into `state_dict()` and checks a state before the Loader takes it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stoker.common.positions import Position
from stoker.data.pixels import PIXELS_VERSION
from stoker.pipeline.plan import EpochPlan

STATE_VERSION = 1
# The last epoch a loader takes: far past any run, below the scheduler's open end (an epoch past it had no batch and
# its iter() waited for ever), and epoch x steps stays an int64 global step for up to 2^32 steps an epoch.
MAX_EPOCH = (1 << 30) - 1


class ResumePosition:
    """The next batch to hand out, and what a loaded state resumes: the step the next `iter()` of its epoch
    starts at, and the epoch's samples before it (the plan is made again from there when another world size saved
    it, or a loader that itself was)."""

    def __init__(self, num_samples: int, batch_size: int, seed: int, drop_last: bool) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.drop_last = drop_last
        self.next = Position(0, 0, 0)  # the next batch to hand out
        self.resume: Position | None = None  # from a loaded state, used by the next iter() of that epoch
        # From a loaded state: (epoch, step, samples of the epoch before that step), which the plan is made again
        # from when the state was saved at another world size (or by a loader that itself was).
        self.resumed_at: tuple[int, int, int] | None = None

    def plan(self, world: int) -> EpochPlan:
        return EpochPlan(self.num_samples, 0, self.batch_size, world, self.seed, self.drop_last)

    def resume_plan(self, world: int) -> EpochPlan:
        """The plan for `world` ranks, made again from where a loaded state stood when that is not where this
        world's own plan would be (another world size saved it): the rest of its epoch, every sample once."""
        plan = self.plan(world)
        return plan if self.resumed_at is None else plan.continuing(*self.resumed_at)

    def take_resume(self, epoch: int) -> int | None:
        """The step the loaded state resumes `epoch` at, None when it resumes no step of it (used once)."""
        resume, self.resume = self.resume, None
        return resume.step if resume is not None and resume.epoch == epoch else None

    def state(self, world: int) -> dict[str, Any]:
        """The place and what the batches are a function of, as `state_dict()` writes them."""
        epoch, step = self.next.epoch, self.next.step
        offset = self.resume_plan(world).offset(epoch, step)  # recorded where it is not `step` whole steps
        moved = {"offset": offset} if offset != self.plan(world).offset(epoch, step) else {}
        return {"version": STATE_VERSION, "epoch": epoch, "step": step, **moved, "seed": self.seed,
                "batch_size": self.batch_size, "drop_last": self.drop_last, "world_size": world,
                "num_samples": self.num_samples, "pixels": PIXELS_VERSION}

    def load(self, state: dict[str, Any], world: int) -> int:
        """Take a state checked by `check`: the next `iter()` of its epoch starts at its step. Returns the epoch."""
        epoch = int(state["epoch"])
        self.resume = self.next = Position(epoch, int(state["step"]), 0)
        saved_world = int(state.get("world_size", world))
        offset = state.get("offset")
        offset = self.plan(saved_world).offset(epoch, self.resume.step) if offset is None else int(offset)
        self.resumed_at = (epoch, self.resume.step, offset)
        return epoch

    def check(self, state: dict[str, Any], world: int) -> None:
        """A state this loader can continue from, for a job of `world` ranks: a clear error otherwise."""
        for key in ("epoch", "step", "seed", "batch_size", "num_samples"):
            if key not in state:
                raise ValueError(f"load_state_dict: the state has no {key!r} (expected a Loader.state_dict())")
        self._check_same_batches(state)
        pixels = state.get("pixels")  # None: saved before versions were recorded
        if pixels is not None and (isinstance(pixels, bool) or not isinstance(pixels, (int, np.integer))
                                   or pixels < 1):
            raise ValueError(f"load_state_dict: the state's pixels is {pixels!r}; expected a positive integer (the "
                             "decoder's pixels version a Loader.state_dict() records)")
        saved_world = state.get("world_size", world)
        if isinstance(saved_world, bool) or not isinstance(saved_world, (int, np.integer)) or not \
                1 <= saved_world <= 1 << 20:
            raise ValueError(f"load_state_dict: the state's world_size is {saved_world!r}; expected an integer from "
                             "1 to 2^20")
        if saved_world != world and state.get("lent") is not None:
            raise ValueError(f"load_state_dict: the state was saved with world_size={saved_world} while a batch whose "
                             f"files were unusable borrowed from the next (lent); this job has {world} ranks: resume "
                             f"it with {saved_world}")
        steps = self._saved_steps(state, int(saved_world))
        self._check_place(state, steps)
        self._check_lent(state, steps)

    def _check_same_batches(self, state: dict[str, Any]) -> None:
        mine = {"seed": self.seed, "batch_size": self.batch_size, "num_samples": self.num_samples,
                "drop_last": self.drop_last}
        for key, value in mine.items():
            if key in state and state[key] != value:
                raise ValueError(f"load_state_dict: the state was saved with {key}={state[key]!r}, this loader has "
                                 f"{key}={value!r}; batches would differ, resume with the same settings")

    def _saved_steps(self, state: dict[str, Any], saved_world: int) -> int:
        """The steps per epoch of the loader that saved the state, its offset checked."""
        offset, samples = state.get("offset"), self.num_samples
        if offset is not None and (isinstance(offset, bool) or not isinstance(offset, (int, np.integer))
                                   or not 0 <= offset <= samples):
            raise ValueError(f"load_state_dict: the state's offset is {offset!r}; expected an integer from 0 to "
                             f"{samples} (the samples of its epoch before its step)")
        steps = self.plan(saved_world).steps_per_epoch
        if offset is not None and isinstance(state["step"], int) and offset != self.plan(saved_world).offset(
                0, state["step"]):
            # Saved by a loader that resumed at another world size: its steps are its own, each trained a sample
            # at least, and a sample of the epoch is left (else it would resume no batch while len() says more).
            if not state["step"] <= offset < samples:
                raise ValueError(f"load_state_dict: the state's offset {offset} does not fit its step "
                                 f"{state['step']}: expected an offset from {state['step']} to {samples - 1} (each "
                                 f"step before it trained a sample at least, and one of the epoch's {samples} is "
                                 "left); it would resume no batch")
            steps = samples + 1
        return steps

    @staticmethod
    def _check_place(state: dict[str, Any], steps: int) -> None:
        for key, below in (("epoch", MAX_EPOCH + 1), ("step", steps)):
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < below:
                bound = f"from 0 to {below - 1}" + (f" (this loader has {below} batches per epoch)" if key == "step"
                                                     else "")
                raise ValueError(f"load_state_dict: the state's {key} is {value!r}; expected an integer {bound}")

    def _check_lent(self, state: dict[str, Any], steps: int) -> None:
        lent = state.get("lent")
        if lent is not None and not (isinstance(lent, (list, tuple)) and len(lent) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) for v in lent) and state["step"] <= lent[0] < steps
                and 0 <= lent[1] <= self.batch_size):
            raise ValueError(f"load_state_dict: the state's lent is {lent!r}; expected None or [batch, samples] "
                             f"with batch from the state's step to {steps - 1} and samples from 0 to "
                             f"{self.batch_size}")

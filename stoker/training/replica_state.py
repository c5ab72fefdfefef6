"""A replica's own state, apart from the weights every replica shares: its optimizer, RNG, the averager's
pending counters and outer optimizer, the gradient scaler and the EMA. A checkpoint keeps it per rank, a resume and a
regroup put it back."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from stoker.training.accel import MixedPrecision
from stoker.training.averager import Averager
from stoker.training.ema import ModelEma


class HoldsState(Protocol):
    model: nn.Module
    optimizer: torch.optim.Optimizer
    averager: Averager
    precision: MixedPrecision
    device: torch.device
    ema: ModelEma | None


def own(replica: HoldsState) -> dict[str, Any]:
    """This replica's own state: what a checkpoint keeps per rank and a regroup hands a consumer started again."""
    state = {"optimizer": replica.optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
             "pending": torch.tensor(replica.averager.pending, dtype=torch.int64),
             "grad_scaler": replica.precision.state_dict()}
    if replica.device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(replica.device)
    if not replica.averager.holds_average:  # replicas differ: keep this one's own
        state["model"] = replica.model.state_dict()
    if replica.averager.outer is not None:
        state["outer"] = replica.averager.outer.state_dict()
    if replica.averager.delayed is not None:
        state["delayed"] = replica.averager.delayed.state_dict()
    if replica.ema is not None:
        state["ema"] = replica.ema.state_dict()
    return state


def apply(replica: HoldsState, state: dict[str, Any]) -> None:
    """A replica's state from a checkpoint (`own`) or an agreed copy (the consumer's `_agreed_state`)."""
    for target, source in zip([*replica.averager.float_buckets, *replica.averager.int_tensors],
                              [*state.get("buckets", ()), *state.get("ints", ())], strict=False):
        target.copy_(source)
    if "model" in state:
        replica.model.load_state_dict(state["model"])
    replica.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    if replica.device.type == "cuda" and "cuda_rng" in state:
        torch.cuda.set_rng_state(state["cuda_rng"], replica.device)
    replica.precision.load_state_dict(state.get("grad_scaler", {}))
    replica.averager.pending = tuple(state["pending"].tolist())
    if replica.averager.outer is not None:
        replica.averager.outer.load_state_dict(state["outer"])
    if replica.averager.delayed is not None:
        replica.averager.delayed.load_state_dict(state["delayed"])
    if replica.ema is not None:
        replica.ema.load_state_dict(state["ema"])

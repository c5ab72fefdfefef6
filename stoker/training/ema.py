"""An exponential moving average of the weights (Polyak averaging; timm's ModelEma): ema <- d * ema + (1 - d) * w.

With several consumers it follows the averaged model: it is updated right after each averaging, when every
replica holds the same weights, so every replica's EMA is the same too (with `--sync-every H`, once per window
with the decay raised to the H steps it covers). Buffers follow the same average (BatchNorm's running statistics
are floats); integer buffers (counters) are copied.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class ModelEma:
    def __init__(self, shadow: nn.Module, model: nn.Module, decay: float) -> None:
        """`shadow` is a second instance of the model's architecture; it starts as a copy of `model`."""
        self.decay = decay
        self.model = shadow
        self.model.load_state_dict(model.state_dict())
        self.model.requires_grad_(False)
        self.model.eval()
        self.last_step = -1  # the global step of the last update

    def update(self, model: nn.Module, global_step: int) -> None:
        """Move the average towards `model` for the steps since the last update."""
        decay = self.decay ** (global_step - self.last_step)
        self.last_step = global_step
        averaged, current, copied, source = _pairs(self.model, model)
        with torch.no_grad():
            if averaged:
                torch._foreach_mul_(averaged, decay)
                torch._foreach_add_(averaged, current, alpha=1 - decay)
            for target, value in zip(copied, source):
                target.copy_(value)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**{f"model.{k}": v for k, v in self.model.state_dict().items()},
                "last_step": torch.tensor(self.last_step, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
        self.last_step = int(state["last_step"].item())


EMA_KEEPS_AT_MOST = 0.1  # of the initial weights, at the run's end: more, and model_ema.pt is mostly the start


def ema_warning(decay: float, total_steps: int) -> str | None:
    """The warning for a decay too high for the run: after T steps the EMA still holds decay**T of the weights it
    started from (each update, every H steps, moves it by decay**H)."""
    if not decay or total_steps <= 0:
        return None
    kept = decay ** total_steps
    if kept <= EMA_KEEPS_AT_MOST:
        return None
    at_most = math.floor(EMA_KEEPS_AT_MOST ** (1 / total_steps) * 1e4) / 1e4  # keeps 10% at most, rounded down
    return (f"ema={decay:g} over this run's {total_steps} steps keeps {kept:.0%} of the initial weights in "
            f"model_ema.pt (the decay to the power of the steps); --ema {at_most:g} or lower keeps at most "
            f"{EMA_KEEPS_AT_MOST:.0%}, or train more steps")


def _pairs(shadow: nn.Module, model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                          list[torch.Tensor], list[torch.Tensor]]:
    averaged, current, copied, source = [], [], [], []
    for mine, theirs in zip([*shadow.parameters(), *shadow.buffers()], [*model.parameters(), *model.buffers()]):
        if mine.is_floating_point():
            averaged.append(mine)
            current.append(theirs.detach())
        else:
            copied.append(mine)
            source.append(theirs)
    return averaged, current, copied, source

"""The switches GPU users turn on first: backend flags, mixed precision, channels_last, torch.compile, fused
optimizers, and the memory figures that say what they cost.

Mixed precision is autocast over fp32 weights: the model's parameters (what the averager flattens and averages,
and what checkpoints hold) stay fp32 master weights; only the forward's matmuls and convolutions run in bf16 or
fp16. fp16 needs a gradient scaler (its range is too small for gradients); its scale travels in checkpoints, so a
resumed run continues with the same one.
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)

Precision = Literal["fp32", "bf16", "fp16"]
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def configure_backends(deterministic: bool) -> None:
    """cuDNN picks the fastest algorithm for each shape, and fp32 matmuls use TF32 on GPUs that have it, unless
    the user asked for determinism (bitwise-repeatable runs and resumes on one GPU model)."""
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cuda.matmul.allow_tf32 = not deterministic
    torch.backends.cudnn.allow_tf32 = not deterministic
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for repeatable results
        # warn_only: some backward kernels (adaptive pooling on CUDA) have no deterministic version; they are
        # named in a warning instead of stopping the run.
        torch.use_deterministic_algorithms(True, warn_only=True)


class MixedPrecision:
    """Autocast for the forward pass, and for fp16 a gradient scaler around backward and the optimizer step.

    With `agree` (several replicas), the replicas' scalers decide together: each replica's overflow flag is
    all-reduced (MAX) before its step, so all skip or all step, and their scales stay equal. A replica with no
    samples in a step joins with `skip_step`. Otherwise an overflow on one rank would skip its step while the
    others stepped, and the average would be a partial step."""

    def __init__(self, precision: Precision, device: torch.device, agree: bool = False) -> None:
        self.precision = precision
        self.device = device
        self.device_type = device.type
        self.agree = agree
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def autocast(self) -> AbstractContextManager:
        if self.precision == "fp32":
            return nullcontext()
        return torch.autocast(self.device_type, dtype=AUTOCAST_DTYPES[self.precision])

    def backward_and_step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer,
                          before_step: Callable[[], None] | None = None) -> None:
        """`before_step` sees the true gradients (unscaled under fp16): gradient clipping."""
        if self.scaler is None:
            loss.backward()
            if before_step is not None:
                before_step()
            optimizer.step()
            return
        self.scaler.scale(loss).backward()
        if before_step is not None or self.agree:
            self.scaler.unscale_(optimizer)  # the overflow flags exist from here, and step and update read them
        if before_step is not None:
            before_step()
        if self.agree:
            for found_inf in self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        self.scaler.step(optimizer)  # skipped when a gradient overflowed; the scale then shrinks
        self.scaler.update()

    def skip_step(self) -> None:
        """This replica has no samples this step: it joins the overflow agreement with none of its own, and moves
        its scale as its peers' `update` does, so that all scales stay equal."""
        if self.scaler is None or not self.agree:
            return
        scaler = self.scaler
        found_inf = torch.zeros(1, device=self.device)
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        if scaler._scale is None:  # no step scaled anything yet
            scaler._lazy_init_scale_growth_tracker(self.device)
        assert scaler._scale is not None and scaler._growth_tracker is not None
        torch._amp_update_scale_(scaler._scale, scaler._growth_tracker, found_inf, scaler.get_growth_factor(),
                                 scaler.get_backoff_factor(), scaler.get_growth_interval())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The scaler's state as tensors (checkpoints hold tensors only)."""
        if self.scaler is None:
            return {}
        state = self.scaler.state_dict()
        return {"scale": torch.tensor(float(state["scale"])),
                "growth_tracker": torch.tensor(int(state["_growth_tracker"]))}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict({**self.scaler.state_dict(), "scale": state["scale"].item(),
                                         "_growth_tracker": int(state["growth_tracker"].item())})


def compiled(model: nn.Module, threads: int | None = None, backend: Any = "inductor") -> nn.Module:
    """torch.compile of `model` (the original keeps the parameters and the state_dict keys). Inductor compiles in
    worker processes; a consumer is a daemonic process, which multiprocessing forbids to have children, so the
    workers are started as plain subprocesses. `threads` caps inductor's compile workers at this consumer's share
    of the cores (by default each consumer would start one per core: 8 consumers, 8 times the cores)."""
    import torch._inductor.config as inductor

    if multiprocessing.current_process().daemon and hasattr(inductor, "worker_start_method"):
        inductor.worker_start_method = "subprocess"
    if threads is not None:
        inductor.compile_threads = max(1, threads)
    return cast(nn.Module, torch.compile(model, backend=backend))  # an OptimizedModule; the stub says a callable


def fused_option(optimizer_class: type[torch.optim.Optimizer], device: torch.device) -> dict[str, Any]:
    """`fused=True` where torch has a fused kernel for this optimizer on a GPU: one launch per step instead of
    several per parameter tensor."""
    if device.type == "cuda" and "fused" in inspect.signature(optimizer_class).parameters:
        return {"fused": True}
    return {}


def memory_stats(device: torch.device) -> dict[str, int]:
    """Peak allocated and reserved bytes on a GPU since the start (nothing on the CPU)."""
    if device.type != "cuda":
        return {}
    return {"gpu_peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "gpu_peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}

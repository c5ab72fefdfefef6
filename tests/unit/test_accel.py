"""Backend switches, the fp16 gradient scaler's checkpointed state, torch.compile inside a consumer process."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from stoker.common.checkpoint import load_verified, save_tensors
from stoker.training import accel


@pytest.fixture
def restored_backends():
    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.are_deterministic_algorithms_enabled())
    yield
    (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cuda.matmul.allow_tf32,
     torch.backends.cudnn.allow_tf32) = saved[:4]
    torch.use_deterministic_algorithms(saved[4])


def test_fast_by_default_deterministic_on_request(restored_backends):
    accel.configure_backends(deterministic=False)
    assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    accel.configure_backends(deterministic=True)
    assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert torch.are_deterministic_algorithms_enabled()


def test_fp16_scaler_state_survives_a_checkpoint(tmp_path):
    """The scale a run has reached (after overflows halved it) is what a resumed run continues with."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trained = accel.MixedPrecision("fp16", torch.device("cpu"))
    for _ in range(3):
        loss = model(torch.full((2, 4), 1e36)).sum()  # scaled gradients overflow: step skipped, scale halved
        optimizer.zero_grad()
        trained.backward_and_step(loss, optimizer)
    assert trained.scaler.get_scale() == 65536.0 / 8
    save_tensors(tmp_path / "rank_0.pt", {"grad_scaler": trained.state_dict()})
    resumed = accel.MixedPrecision("fp16", torch.device("cpu"))
    resumed.load_state_dict(load_verified(tmp_path / "rank_0.pt")["grad_scaler"])
    assert resumed.scaler.get_scale() == trained.scaler.get_scale()
    assert resumed.scaler.state_dict() == trained.scaler.state_dict()


def test_bf16_autocast_keeps_fp32_master_weights():
    model = torch.nn.Linear(4, 2)
    precision = accel.MixedPrecision("bf16", torch.device("cpu"))
    with precision.autocast():
        output = model(torch.ones(3, 4))
    assert output.dtype == torch.bfloat16 and model.weight.dtype == torch.float32


def _compile_and_step(results) -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(144, 2))
    try:
        compiled = accel.compiled(model)
        compiled(torch.randn(2, 3, 8, 8)).sum().backward()
        results.put(("ok", model[0].weight.grad is not None))
    except Exception as error:  # carried back as a value, so the test shows what failed
        results.put(("error", f"{type(error).__name__}: {error}"[:2000]))


def test_compile_works_inside_a_daemonic_process():
    """Consumers are daemonic processes (they die with the controller), which multiprocessing forbids to start
    children; inductor's compile workers must still start."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_compile_and_step, args=(results,), daemon=True)
    process.start()
    try:
        assert results.get(timeout=240) == ("ok", True)
    finally:
        process.join(timeout=30)
        results.close()

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


def _peers(monkeypatch, overflowed: bool) -> list[float]:
    """A group of replicas in which a peer's gradients did (or did not) overflow: an all_reduce(MAX) of the
    overflow flag gives 1 whatever this replica found."""
    import torch.distributed as dist

    reduced: list[float] = []

    def all_reduce(tensor, op=None):
        assert op == dist.ReduceOp.MAX
        reduced.append(float(tensor.sum()))
        tensor.clamp_(min=1.0 if overflowed else 0.0)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return reduced


def _fp16_step(precision):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    precision.backward_and_step(model(torch.randn(3, 4)).square().mean(), optimizer)
    return [torch.equal(a, b) for a, b in zip(before, model.parameters())]


@pytest.mark.parametrize("overflowed", [True, False])
def test_fp16_replicas_skip_or_step_together_when_one_of_them_overflows(monkeypatch, overflowed):
    """Each replica has its own gradient scaler: a rank that overflowed skipped its step while the others
    stepped, and the average was a partial step; the scales then drifted apart."""
    reduced = _peers(monkeypatch, overflowed)
    precision = accel.MixedPrecision("fp16", torch.device("cpu"), agree=True)
    initial = precision.scaler.get_scale()
    unchanged = _fp16_step(precision)  # this replica's own gradients are finite
    assert reduced == [0.0]  # it said so to its peers
    assert all(unchanged) is overflowed
    assert precision.scaler.get_scale() == (initial * 0.5 if overflowed else initial)


@pytest.mark.parametrize("overflowed", [True, False])
def test_an_fp16_replica_without_samples_updates_its_scale_as_its_peers_do(monkeypatch, overflowed):
    _peers(monkeypatch, overflowed)
    empty, trained = (accel.MixedPrecision("fp16", torch.device("cpu"), agree=True) for _ in range(2))
    _fp16_step(trained)
    empty.skip_step()
    assert empty.state_dict() == trained.state_dict()

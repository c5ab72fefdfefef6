"""Mixed precision on the CPU (bf16 autocast runs there too), and what precision leaves in checkpoints."""

from __future__ import annotations

import torch

from tests.conftest import read_summary, run_cli


def _digits_accuracy(digits, out, *extra: str) -> dict:
    train, val = digits
    run_cli("train", "--data", str(train), "--val", str(val), "--devices", "cpu:2", "--producers", "1",
            "--augment", "none", "--image-size", "32", "--batch-size", "32", "--epochs", "3", "--seed", "1",
            "--out", str(out), "--quiet", *extra)
    return read_summary(out)


def test_bf16_learns_digits_within_a_point_of_fp32(digits, tmp_path):
    full = _digits_accuracy(digits, tmp_path / "fp32", "--precision", "fp32")
    half = _digits_accuracy(digits, tmp_path / "bf16", "--precision", "bf16", "--channels-last", "true")
    assert full["val_accuracy"] >= 0.95, full["val_accuracy"]
    assert abs(half["val_accuracy"] - full["val_accuracy"]) <= 0.01, (half["val_accuracy"], full["val_accuracy"])
    assert half["replicas_identical"] is True
    weights = torch.load(tmp_path / "bf16" / "model.pt", weights_only=True)["state_dict"]
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.float32}  # fp32 master weights

"""Averaging parameters after each step equals averaging gradients (DDP) for SGD with momentum and weight decay,
which are linear in the gradient; for AdamW, which is not, the two differ."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli


@pytest.mark.parametrize("optimizer,should_match", [("sgd", True), ("adamw", False)])
def test_parameter_averaging_matches_ddp_exactly_when_the_optimizer_is_linear(tmp_path, optimizer, should_match):
    report = tmp_path / "sync.json"
    run_cli("bench", "sync", "--steps", "2", "--repeats", "1", "--optimizer", optimizer, "--json", str(report))
    result = json.loads(report.read_text())
    assert result["weights_match"] is should_match
    if should_match:
        assert result["max_weight_difference"] < 1e-5

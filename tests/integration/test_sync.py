"""Averaging parameters after each step equals averaging gradients (DDP) for SGD with momentum and weight decay,
which are linear in the gradient (AdamW, which is not: tests/unit/test_averager.py)."""

from __future__ import annotations

import json

from tests.conftest import run_cli


def test_parameter_averaging_matches_ddp_exactly_when_the_optimizer_is_linear(tmp_path):
    """For AdamW, which is not linear, see tests/unit/test_averager.py: what averaging computes there instead."""
    report = tmp_path / "sync.json"
    run_cli("bench", "sync", "--steps", "2", "--repeats", "1", "--optimizer", "sgd", "--json", str(report))
    result = json.loads(report.read_text())
    assert result["weights_match"] is True
    assert result["max_weight_difference"] < 1e-5

"""What a new user meets on the command line: a diverged run fails naming the step (--quiet staying quiet
is checked in tests/integration/test_report.py, on a run that validates)."""

from __future__ import annotations

import pytest

from tests.conftest import read_summary, run_cli

pytestmark = pytest.mark.timeout(240)


def _train(textures, out, *extra, check=True):
    train_dir, val_dir = textures
    return run_cli("train", "--data", str(train_dir), "--val", str(val_dir), "--batch-size", "16", "--image-size",
                   "16", "--out", str(out), "--devices", "cpu:1", "--producers", "1", *extra, check=check)


def test_a_diverged_run_fails_naming_the_step_and_a_lower_lr(textures, tmp_path):
    result = _train(textures, tmp_path / "run", "--epochs", "1", "--lr", "1e9", "--quiet", check=False)
    summary = read_summary(tmp_path / "run")
    assert result.returncode == 1 and summary["status"] == "failed", (result.returncode, summary["status"])
    assert "training loss became" in summary["error"] and "--lr" in summary["error"]
    assert summary["model"] is None
    assert "training loss became" in result.stdout  # the ending's error line

"""A consumer that hangs before its first step: the run ends, failed, within the start-up bound, naming the
phase the consumer last reported, and leaves no process or segment (the autouse fixture checks)."""

from __future__ import annotations

import time

import pytest

from stoker.training import startup
from tests.conftest import read_summary, run_cli

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("phase", [startup.GROUP, startup.INITIAL_STATE])
def test_a_consumer_hung_as_it_starts_fails_the_run_within_its_bound_naming_the_phase(textures, tmp_path, phase):
    train, val = textures
    started = time.monotonic()
    result = run_cli("train", "--data", str(train), "--val", str(val), "--devices", "cpu:1", "--producers", "1",
                     "--batch-size", "8", "--image-size", "32", "--epochs", "1", "--collective-timeout-s", "3",
                     "--out", str(tmp_path / "run"), "--quiet",
                     env={"STOKER_FAULT": f"consumer-start:hang:rank=0,phase={phase};"}, check=False)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "failed"
    assert f"consumer 0 never finished starting: it has been {phase} for" in summary["error"], summary["error"]
    assert elapsed < 120, elapsed  # the bound is 6 s from the phase's start; the run's own start is the rest


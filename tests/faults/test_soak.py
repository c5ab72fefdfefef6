"""The soak benchmark, short: producers SIGKILLed at random, memory and /dev/shm flat, exactly once every epoch."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.timeout(180)


def test_short_soak_with_random_producer_kills_holds_every_check(tmp_path):
    report = tmp_path / "soak.json"
    run_cli("bench", "soak", "--minutes", "0.4", "--kill-every-s", "2", "--json", str(report))
    result = json.loads(report.read_text())
    assert result["passed"] and all(result["checks"].values())
    assert result["kills"] >= 5 and result["producers_replaced"] == result["kills"]
    assert result["epochs"] >= 3 and result["epochs_exactly_once"] == result["epochs"]
    assert {"stoker controller", "stoker consumer 0"} <= set(result["rss"])

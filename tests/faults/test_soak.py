"""The soak benchmark, short: producers SIGKILLed at random, memory and /dev/shm flat, exactly once every epoch."""

from __future__ import annotations

import argparse
import json

import pytest

from stoker.bench import soak
from tests.conftest import run_cli

pytestmark = pytest.mark.timeout(180)


@pytest.mark.serial  # counts every segment in /dev/shm
def test_short_soak_with_random_producer_kills_holds_every_check(tmp_path):
    report = tmp_path / "soak.json"
    run_cli("bench", "soak", "--minutes", "0.4", "--kill-every-s", "2", "--json", str(report), check=False)
    result = json.loads(report.read_text())
    assert result["checks"] == dict.fromkeys(result["checks"], True), result  # names the check that failed
    assert result["passed"]
    assert result["kills"] >= 5 and result["producers_replaced"] == result["kills"]
    # at least one epoch boundary under kills (3+ epochs on a quiet machine; 2 at a load average of 15)
    assert result["epochs"] >= 2 and result["epochs_exactly_once"] == result["epochs"]
    # one pid each; the zygotes producers and consumers are forked from are the run's too, watched with the rest
    assert set(result["rss"]) == {"stoker controller", "stoker consumer 0", "stoker producer 0", "stoker zygote",
                                  "stoker zygote (consumers)"}
    assert result["shm_segments"]["min"] == result["shm_segments"]["max"] == 1


def soak_samples(witness_mb, used_bytes, segments=lambda i: 1):
    """Synthetic watch samples: a controller, the witness producer 0 and a producer 1 replaced every 5 samples
    (each replacement younger and smaller than the one it replaced), /dev/shm as given per sample."""
    return [{"t": float(i), "shm_segments": segments(i), "shm_used_bytes": used_bytes(i), "warm": i >= 5,
             "rss": {10: ("stoker controller", 300 << 20), 11: ("stoker producer 0", int(witness_mb(i) * 2**20)),
                     12: ("stoker consumer 0", 400 << 20),
                     100 + i // 5: ("stoker producer 1", (60 - i % 5 * 5) << 20)}} for i in range(40)]


def judge(samples):
    args = argparse.Namespace(minutes=40 / 60, warmup_fraction=0.25, max_rss_growth=0.10)
    summary = {"epoch_accounting": [{"epoch": 0, "duplicates": 0, "missing": 0}], "status": "interrupted",
               "throughput_samples_per_s": 1.0}
    return soak._judge(samples, 1, 1, summary, {"processes": [], "segments": []}, args)["checks"]


def test_soak_judges_one_producer_over_its_own_life_and_all_of_dev_shm():
    flat = judge(soak_samples(lambda i: 50, lambda i: 1 << 20))
    assert flat["rss_flat"] and flat["shm_flat"]  # replacements of producer 1 are young, not growth
    assert not judge(soak_samples(lambda i: 50 + 2 * i, lambda i: 1 << 20))["rss_flat"]  # the witness grows
    assert not judge(soak_samples(lambda i: 50, lambda i: (1 << 20) + 4096 * i))["shm_flat"]  # bytes leak
    assert not judge(soak_samples(lambda i: 50, lambda i: 1 << 20, segments=lambda i: 1 + i // 30))["shm_flat"]

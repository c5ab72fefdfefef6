"""`stoker bench gpu` in its CPU mode with tiny sizes: the same code a GPU machine runs, end to end."""

from __future__ import annotations

import json

from tests.conftest import run_cli


def test_bench_gpu_runs_on_the_cpu_and_compares_the_three(tmp_path):
    report = tmp_path / "gpu.json"
    result = run_cli("bench", "gpu", "--device", "cpu", "--models", "resnet8", "--image-size", "32", "--batch-size",
                     "8", "--images", "64", "--epochs", "1", "--steps", "3", "--workers", "1", "--json", str(report))
    figures = json.loads(report.read_text())
    (row,) = figures["rows"]
    rates = [row[name]["samples_per_s"] for name in ("ceiling", "stoker", "dataloader")]
    assert all(rate > 0 for rate in rates)
    assert row["stoker_vs_ceiling"] == round(rates[1] / rates[0], 3)
    assert row["stoker_vs_dataloader"] == round(rates[1] / rates[2], 3)
    assert 0 <= row["dataloader"]["input_stall"] < 1 and 0 <= row["stoker"]["input_stall"] < 1
    assert "stoker/ceiling" in result.stdout and figures["precision"] == "bf16"

"""`stoker bench gpu` in its CPU mode with tiny sizes: the same code a GPU machine runs, end to end."""

from __future__ import annotations

import json

from tests.conftest import run_cli


def test_bench_gpu_runs_on_the_cpu_and_compares_the_three(tmp_path):
    report = tmp_path / "gpu.json"
    result = run_cli("bench", "gpu", "--device", "cpu", "--models", "resnet8", "--image-size", "32", "--batch-size",
                     "8", "--images", "80", "--steps", "3", "--workers", "1", "--repeats", "1",
                     "--json", str(report))
    figures = json.loads(report.read_text())
    (row,) = figures["rows"]
    kinds = ("ceiling", "stoker", "dataloader_pillow", "dataloader_stoker_decoder")
    rates = [row[name]["samples_per_s"] for name in kinds]
    assert all(rate > 0 for rate in rates)
    assert all(row[name]["repeats"] == [row[name]["samples_per_s"]] for name in kinds)  # one repeat: its median
    assert row["stoker_vs_ceiling"] == round(rates[1] / rates[0], 3)
    assert row["stoker_vs_dataloader"] == round(rates[1] / rates[2], 3)
    assert row["stoker_vs_dataloader_same_decoder"] == round(rates[1] / rates[3], 3)
    assert all(0 <= row[name]["input_stall"] < 1 for name in kinds)
    assert "stoker/ceiling" in result.stdout and figures["precision"] == "bf16"


def test_stoker_is_timed_over_its_first_epoch_only_so_no_checkpoint_is_inside_the_window(tmp_path):
    """A Save ends each epoch; while it runs the ring refills and the next steps cost no wait. Only epoch 0's
    steps after the warm-up count, host time included in the device's wall time."""
    from stoker.bench.gpu_runs import WARMUP_STEPS, steady_figures

    records = [{"event": "step", "epoch": 0, "global_step": s, "samples": 8, "wait_s": 0.5, "host_s": 0.25,
                "compute_s": 0.25, "averaging_s": 0.0} for s in range(WARMUP_STEPS + 4)]
    records += [{"event": "checkpoint", "step": WARMUP_STEPS + 4}]
    records += [{"event": "step", "epoch": 1, "global_step": WARMUP_STEPS + 4 + s, "samples": 8, "wait_s": 0.0,
                 "host_s": 0.0, "compute_s": 0.25, "averaging_s": 0.0} for s in range(4)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert steady_figures(metrics) == {"samples_per_s": 8.0, "input_stall": 0.5}

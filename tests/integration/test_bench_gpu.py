"""`stoker bench gpu` in its CPU mode with tiny sizes: the same code a GPU machine runs, end to end."""

from __future__ import annotations

import argparse
import json
import time

import torch

from tests.conftest import run_cli

SAMPLE_S = 0.2  # each sample takes a worker this long: 2 workers make at most 2 / SAMPLE_S = 10 samples/s


class _SlowSamples:
    """A dataset whose workers are slow by construction: each sample sleeps SAMPLE_S."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        time.sleep(SAMPLE_S)
        return torch.zeros((16, 16, 3), dtype=torch.uint8), index % 10


def test_bench_gpu_runs_on_the_cpu_and_compares_the_three(tmp_path):
    """Without --images it writes enough for stoker's first epoch to hold the warm-up, the most steps skipped and
    the window; --steps-ahead reaches every run, and the host's share is in the table."""
    report = tmp_path / "gpu.json"
    result = run_cli("bench", "gpu", "--device", "cpu", "--models", "resnet8", "--image-size", "32", "--batch-size",
                     "8", "--steps", "3", "--workers", "1", "--repeats", "1", "--steps-ahead", "2",
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
    assert all(0 <= row[name]["host"] < 1 and row[name]["skipped_steps"] >= 0 for name in kinds)
    assert "stoker/ceiling" in result.stdout and figures["precision"] == "bf16"
    assert figures["steps_ahead"] == 2 and figures["steps"] == 3
    assert "wrote 96 JPEGs" in result.stdout  # (5 warm-up + 4 x 1 worker skipped at most + 3) steps of 8
    assert " host " in result.stdout and "2 steps ahead" in result.stdout


def test_the_dataloader_is_timed_past_its_prefetched_backlog_not_inside_it(monkeypatch, textures):
    """Workers that make at most 10 samples/s, a prefetch backlog of 16 batches, and a first step as slow as cuDNN's
    autotuning (4 s, in which the workers fill the backlog): a window timed inside the backlog reads at the step's
    own speed, far above what the workers can produce. From the steady state it cannot read faster than them."""
    from stoker.bench import gpu_runs

    monkeypatch.setattr(gpu_runs, "PREFETCH", 8)
    # A loaded 2-core machine may take a few ms to hand over a batch that is ready; blocked here means 0.1 s or more
    monkeypatch.setattr(gpu_runs, "BLOCKED_MIN_S", 0.02)
    monkeypatch.setattr(gpu_runs, "_dataset", lambda index, image_size, decoder: _SlowSamples())
    step = gpu_runs._Step.step
    first = []

    def slow_first_step(self, *args, **kwargs):
        if not first:
            first.append(True)
            time.sleep(4.0)  # outside the step's clock, as the warm-up it stands for
        step(self, *args, **kwargs)

    monkeypatch.setattr(gpu_runs._Step, "step", slow_first_step)
    args = argparse.Namespace(device="cpu", image_size=16, batch_size=2, precision="fp32", channels_last="false",
                              workers=2, steps=16, steps_ahead=None)
    figures = gpu_runs.time_dataloader(textures[0], "resnet8", args, decoder="pillow")
    capacity = args.workers / SAMPLE_S
    # the window's first step found no batch ready: at most one batch per worker was part-made when it opened
    assert figures["samples_per_s"] < 1.25 * capacity, figures
    assert 8 <= figures["skipped_steps"] <= gpu_runs.max_skipped(args.workers), figures
    assert figures["steps"] == args.steps and figures["input_stall"] > 0.3


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
    assert steady_figures(metrics, steps=4, most_skipped=8) == {"samples_per_s": 8.0, "input_stall": 0.5,
                                                                "host": 0.25, "steps": 4, "skipped_steps": 0}


def test_a_run_that_fails_is_reported_and_the_others_are_measured_and_saved_as_they_end(monkeypatch, tmp_path,
                                                                                       capsys):
    """A check cut short, or a run that cannot run here (a ring /dev/shm cannot hold), still leaves figures."""
    import argparse

    from stoker.bench import gpu, gpu_runs

    def run(kind, folder, model, args):
        if kind == "stoker":
            raise RuntimeError("stoker train failed: the batch slot ring needs 77 MiB")
        return {"samples_per_s": {"ceiling": 400.0}.get(kind, 200.0), "input_stall": 0.1}

    monkeypatch.setattr(gpu_runs, "_in_own_process", run)
    args = argparse.Namespace(device="cpu", models="resnet8", image_size=32, batch_size=8, precision="fp32",
                              channels_last="true", workers=1, repeats=2, json=tmp_path / "gpu.json")
    saves: list[int] = []
    result = gpu_runs.measure(tmp_path, args, saved=lambda partial: saves.append(len(partial["runs"])))
    assert saves[:8] == list(range(1, 9))  # after each of the 2 x 4 runs
    (row,) = result["rows"]
    assert "77 MiB" in row["stoker"]["error"] and row["stoker_vs_ceiling"] is None
    assert row["ceiling"]["samples_per_s"] == 400.0 and row["dataloader_pillow"]["repeats"] == [200.0, 200.0]
    assert gpu._report(result, args) == 1
    out = capsys.readouterr().out
    assert "failed" in out and "resnet8 stoker (repeat 0) failed: RuntimeError" in out
    assert json.loads(args.json.read_text())["rows"][0]["ceiling"]["samples_per_s"] == 400.0


def test_a_dev_shm_too_small_for_the_ring_skips_the_stoker_run_first_with_the_size_and_the_fix(monkeypatch,
                                                                                               capsys):
    import argparse
    from collections import namedtuple

    from stoker.bench import gpu
    from stoker.pipeline import ring

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(ring.shutil, "disk_usage", lambda path: usage(64 << 20, 0, 64 << 20))  # Docker's default
    args = argparse.Namespace(batch_size=128, image_size=224, workers=15)
    skipped = gpu._runs_shm_cannot_hold(args, gpu.RUN_KINDS)
    assert list(skipped) == ["stoker"]
    err = capsys.readouterr().err
    assert "needs 7" in err and "--shm-size=" in err and "the others are measured" in err
    assert gpu._runs_shm_cannot_hold(args, ("ceiling",)) == {}


def test_the_jpegs_are_written_in_parallel_the_same_whichever_process_writes_a_chunk(tmp_path, monkeypatch):
    import hashlib

    from stoker.bench import pipeline
    from stoker.bench.pipeline import generate

    monkeypatch.setattr(pipeline, "CHUNK", 8)  # the chunks are cut here; each process is told its own
    CHUNK = 8
    def digests(folder):
        files = sorted((folder / "500x375" / "photos").iterdir())
        return [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]

    generate(tmp_path / "a", CHUNK + 3, 0, processes=2)
    generate(tmp_path / "b", CHUNK + 3, 0, processes=3)
    assert len(digests(tmp_path / "a")) == CHUNK + 3
    assert digests(tmp_path / "a") == digests(tmp_path / "b")

"""The CUDA path, where a GPU is (the `gpu` marker: skipped on machines without one). Written before any GPU was
available to this project: each test states what the GPU path promises."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import assert_same_weights, cuda_device_count, read_summary, run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _train(textures, out, *extra: str, env: dict | None = None, check: bool = True):
    train, val = textures
    return run_cli("train", "--data", str(train), "--val", str(val), "--devices", "cuda:0", "--batch-size", "8",
                   "--image-size", "32", "--out", str(out), "--quiet", *extra, env=env, check=check)


def test_model_and_checkpoint_load_on_a_machine_without_a_gpu(textures, tmp_path):
    """Saved from cuda:0, loaded with a plain torch.load where no CUDA device is visible (the README's recipe)."""
    _train(textures, tmp_path, "--epochs", "1")
    summary = read_summary(tmp_path)
    files = [tmp_path / "model.pt", *sorted((tmp_path / "checkpoints").glob("step_*/*.pt"))]
    probe = ("import sys, torch\nfor path in sys.argv[1:]:\n"
             "    torch.load(path, weights_only=True)\nprint(torch.cuda.is_available())")
    result = subprocess.run([sys.executable, "-c", probe, *map(str, files)], capture_output=True, text=True,
                            env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False" and summary["status"] == "completed"


def test_deterministic_resume_on_a_gpu_is_bitwise_exact(textures, tmp_path):
    """--deterministic true, and the CUDA RNG state per consumer in the checkpoint."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = ("--epochs", "2", "--seed", "5", "--deterministic", "true", "--model", "nobn:small_cnn")
    _train(textures, straight, *common)
    result = _train(textures, split, *common, env={"STOKER_FAULT": "consumer:interrupt-parent:rank=0,step=5;"},
                    check=False)
    assert result.returncode == 130
    run_cli("train", "--resume", str(split), "--devices", "cuda:0", "--quiet")
    assert_same_weights(straight, split)


def test_bf16_channels_last_compiled_training_reports_gpu_memory(textures, tmp_path):
    _train(textures, tmp_path, "--epochs", "1", "--precision", "bf16", "--channels-last", "true",
           "--compile", "true")
    summary = read_summary(tmp_path)
    assert summary["status"] == "completed" and summary["replicas_identical"] is True
    (memory,) = summary["gpu_memory"]
    assert 0 < memory["gpu_peak_allocated_bytes"] <= memory["gpu_peak_reserved_bytes"]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if '"event": "step"' in line]
    assert steps and all(step["compute_s"] > 0 for step in steps)


@pytest.mark.two_gpus
@pytest.mark.skipif(cuda_device_count() < 2, reason="needs two GPUs")
def test_averaging_time_is_the_collectives_device_time(textures, tmp_path):
    """NCCL only enqueues: with host timing averaging read about 0. With events it is the all_reduce's time."""
    _train(textures, tmp_path, "--epochs", "1", "--devices", "cuda:0,1")
    summary = read_summary(tmp_path)
    assert all(fraction > 0.001 for fraction in summary["averaging_fraction"]), summary["averaging_fraction"]

"""`tools/gpu-check.sh` on a CPU machine whose fake `nvidia-smi` lists a GPU that this torch cannot use: the GPU
tests fail (they stop, not skip, there), and the check still reaches its benchmark and writes its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def test_the_gpu_check_reaches_its_benchmark_and_writes_figures_when_the_tests_fail(tmp_path):
    """Its CPU mode (GPU_CHECK_DEVICE=cpu: no NCCL smoke test, the benchmark on the CPU) with a fake nvidia-smi
    that lists one GPU and answers its samples: every step runs and keeps its output, the samples are summed up
    per phase, and the check says what it did not check."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(
        "#!/bin/sh\ncase \"$1\" in\n"
        "  -L) echo 'GPU 0: NVIDIA H200 (UUID: GPU-0)' ;;\n"
        "  --query-gpu=*) echo '2026/12/06 01:00:00.000, 0, 37, 1024, 143771' ;;\n"
        "  *) echo '| NVIDIA-SMI 535.1   Driver Version: 535.1   CUDA Version: 12.2 |' ;;\nesac\n")
    (fake / "nvidia-smi").chmod(0o755)
    out = tmp_path / "gpu-check"
    environment = {key: value for key, value in os.environ.items() if key != "CUDA_VISIBLE_DEVICES"}
    environment.update(PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", GPU_CHECK_OUT=str(out),
                       GPU_CHECK_TESTS_S="60", GPU_CHECK_BENCH_S="120", GPU_CHECK_DEVICE="cpu",
                       GPU_CHECK_MODELS="resnet8", GPU_CHECK_SAMPLE_S="0.2",
                       GPU_CHECK_BENCH_ARGS="--image-size 32 --batch-size 8 --steps 3 --workers 1 --repeats 1 "
                                            "--runs ceiling")
    result = subprocess.run(["bash", str(ROOT / "tools" / "gpu-check.sh"), sys.executable], cwd=tmp_path,
                            env=environment, capture_output=True, text=True, timeout=400)
    assert result.returncode != 0, result.stdout[-3000:]  # the tests' failure is the check's status
    assert "GPU 0: NVIDIA H200" in (out / "gpus.txt").read_text()
    assert "the GPU tests cannot run" in (out / "gpu-tests.txt").read_text()
    assert "bench gpu resnet8: " in result.stdout  # reached, and timed
    figures = json.loads((out / "bench-gpu-resnet8.json").read_text())
    assert figures["rows"][0]["ceiling"]["samples_per_s"] > 0 and figures["steps_ahead"] == 3
    assert [(run["kind"], "error" in run) for run in figures["runs"]] == [("ceiling", False)]
    ahead = json.loads((out / "bench-gpu-resnet8-ahead2.json").read_text())  # stoker alone, 2 steps ahead
    assert ahead["steps_ahead"] == 2 and ahead["rows"][0]["stoker"]["samples_per_s"] > 0
    assert "host" in ahead["rows"][0]["stoker"]
    samples = (out / "gpu-samples.csv").read_text().splitlines()
    assert samples[0].startswith("phase,") and any(line.startswith("GPU tests,") for line in samples)
    assert any(line.startswith("bench gpu resnet8,") for line in samples)
    phases = (out / "gpu-phases.txt").read_text()
    assert "GPU tests" in phases and "bench gpu resnet8" in phases
    assert "two-GPU tests" not in result.stdout  # one GPU listed
    assert "not checked: the two-GPU paths" in result.stdout and "not checked: NCCL" in result.stdout


def test_the_gpu_check_names_a_missing_package_before_it_runs_anything(tmp_path):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "simplejpeg.py").write_text("raise ImportError('No module named simplejpeg')\n")  # shadows the real one
    out = tmp_path / "gpu-check"
    environment = {**os.environ, "PYTHONPATH": str(hidden), "GPU_CHECK_OUT": str(out)}
    result = subprocess.run(["bash", str(ROOT / "tools" / "gpu-check.sh"), sys.executable], cwd=tmp_path,
                            env=environment, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "missing Python packages, nothing was run: simplejpeg (ImportError" in result.stdout
    assert not (out / "gpu-tests.txt").exists()


def test_the_gpu_check_refuses_an_opencv_older_than_4_11(tmp_path):
    """stoker reads cv2.IMREAD_COLOR_RGB (OpenCV 4.11) at import: an older OpenCV would pass an import check, then
    fail every run."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "cv2.py").write_text("__version__ = '4.10.0'\nIMREAD_COLOR = 1\n")  # shadows the real one
    out = tmp_path / "gpu-check"
    environment = {**os.environ, "PYTHONPATH": str(hidden), "GPU_CHECK_OUT": str(out)}
    result = subprocess.run(["bash", str(ROOT / "tools" / "gpu-check.sh"), sys.executable], cwd=tmp_path,
                            env=environment, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "cv2 (OpenCV 4.10.0: stoker needs 4.11 or later)" in result.stdout
    assert not (out / "gpu-tests.txt").exists()

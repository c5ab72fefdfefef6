"""Shared fixtures: real image folders made on the fly, and the leave-no-trace check every test gets."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stoker import builtin_data
from stoker.procs import stoker_processes
from stoker.ring import live_segments

ROOT = Path(__file__).resolve().parent.parent
HELPERS = Path(__file__).resolve().parent / "helpers"


def wait_for_no_trace(timeout_s: float = 15.0) -> tuple[list, list]:
    deadline = time.monotonic() + timeout_s
    while True:
        processes, segments = stoker_processes(), live_segments()
        if (not processes and not segments) or time.monotonic() > deadline:
            return processes, segments
        time.sleep(0.1)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; runs wherever one is visible, skipped elsewhere")


def pytest_collection_modifyitems(config, items) -> None:
    needing_cuda = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not needing_cuda or cuda_visible():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in needing_cuda:
        item.add_marker(skip)


def cuda_visible() -> bool:
    return cuda_device_count() > 0


@functools.cache
def cuda_device_count() -> int:
    """Asked in a child process: querying CUDA here would initialise the driver in the test process before a CPU
    test can hide the GPUs from it."""
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    answer = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
    return int(answer) if answer.isdigit() else 0


@pytest.fixture(autouse=True)
def pinned_to_cpu(request, monkeypatch):
    """A test without the `gpu` marker runs on the CPU even on a GPU machine: everything it starts (the CLI,
    `stoker.train`'s processes) sees no CUDA device, so `--devices auto` means CPU consumers and gloo there too."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    yield


@pytest.fixture(autouse=True)
def leaves_no_trace():
    """Every test ends with no stoker process alive and no stoker segment in /dev/shm."""
    yield
    processes, segments = wait_for_no_trace()
    assert not processes, f"stoker processes left behind: {processes}"
    assert not segments, f"shared-memory segments left behind: {segments}"


@pytest.fixture(scope="session")
def textures(tmp_path_factory) -> tuple[Path, Path]:
    """A small copy of the built-in texture dataset: 10 classes, 12 train and 4 val JPEGs each, 64x64."""
    folder = tmp_path_factory.mktemp("textures") / "data"
    builtin_data.generate(folder, train_per_class=12, val_per_class=4)
    return folder / "train", folder / "val"


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> tuple[Path, Path]:
    """scikit-learn's handwritten digits written out as PNG files in ImageFolder layout (train and val)."""
    from sklearn.datasets import load_digits

    folder = tmp_path_factory.mktemp("digits")
    bunch = load_digits()
    order = np.random.default_rng(0).permutation(len(bunch.target))
    for position, index in enumerate(order):
        split = "val" if position < len(order) // 5 else "train"
        pixels = (bunch.images[index] * (255 / 16)).round().astype(np.uint8)
        target = folder / split / str(bunch.target[index])
        target.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels, mode="L").resize((32, 32), Image.NEAREST).save(target / f"{index:04d}.png")
    return folder / "train", folder / "val"


def run_cli(*args: str, env: dict | None = None, timeout: float = 240, check: bool = True
            ) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": f"{HELPERS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   **(env or {})}
    if args[:1] == ("train",) and "--report" not in args:
        args = (*args, "--report", "false")  # drawing takes 2 s a run; tests/integration/test_report.py draws
    result = subprocess.run([sys.executable, "-m", "stoker", *args], capture_output=True, text=True,
                            timeout=timeout, env=environment)
    if check and result.returncode != 0:
        raise AssertionError(f"stoker {' '.join(args)} exited {result.returncode}:\n{result.stderr[-4000:]}")
    return result


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())

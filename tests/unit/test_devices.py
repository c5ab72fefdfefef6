"""CPU tests stay on the CPU on a GPU machine; GPU tests carry the `gpu` marker and run wherever CUDA is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_a_cpu_test_hides_cuda_from_what_it_starts():
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    probe = "import torch; from stoker.common.devices import resolve_devices; print(resolve_devices('auto')[0])"
    started = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert started.stdout.strip() == "cpu"


@pytest.mark.gpu
def test_a_gpu_test_sees_the_gpus():
    import torch

    assert os.environ.get("CUDA_VISIBLE_DEVICES") != ""
    assert torch.cuda.is_available()


def test_more_cpu_consumers_than_cores_is_warned_before_the_run_starts(textures, tmp_path, caplog):
    from stoker.common.config import make_config
    from stoker.common.devices import available_cores
    from stoker.run.controller import Controller

    train, val = textures
    cores = available_cores()
    with caplog.at_level("WARNING"):
        Controller(make_config({"data": train, "val": val, "devices": f"cpu:{cores + 1}", "image_size": 16,
                                "out": tmp_path / "run"}))  # validates and starts nothing
    assert any(f"{cores + 1} CPU consumers on {cores} cores" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING"):
        Controller(make_config({"data": train, "val": val, "devices": f"cpu:{cores}", "image_size": 16,
                                "out": tmp_path / "other"}))  # the first still holds its folder's lock
    assert not any("CPU consumers on" in r.getMessage() for r in caplog.records)

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

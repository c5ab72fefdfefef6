"""A device that runs out of memory under a share larger than --batch-size: the error says why the share is larger
and what to change (no GPU here: CUDA's error is raised by a fault in the step)."""

from __future__ import annotations

import pytest

from tests.conftest import read_summary, run_cli

pytestmark = pytest.mark.timeout(240)


def test_out_of_memory_on_fewer_devices_under_a_fixed_global_batch_names_the_setting(textures, tmp_path):
    """Trained on 2 consumers, resumed on 1 with --global-batch fixed: its batch is twice --batch-size. The step
    runs out of device memory (CUDA's error, raised by a fault): the run fails saying why the batch is larger."""
    train, val = textures
    run_dir = tmp_path / "run"
    common = ("--batch-size", "8", "--image-size", "32", "--global-batch", "fixed", "--quiet")
    run_cli("train", "--data", str(train), "--val", str(val), "--devices", "cpu:2", "--epochs", "1",
            "--out", str(run_dir), *common)
    result = run_cli("train", "--resume", str(run_dir), "--epochs", "2", "--devices", "cpu:1", "--quiet",
                     env={"STOKER_FAULT": "consumer:oom:rank=0,step="}, check=False)
    assert result.returncode != 0
    error = read_summary(run_dir)["error"]
    assert "--global-batch fixed keeps the run's first global batch, which gives each of these 1 device(s) up to " \
           "16 samples a step, not --batch-size 8" in error, error
    assert "CUDA out of memory" in error

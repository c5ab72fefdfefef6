"""The collective timeout is for peers that are gone or stuck, named as such; rank 0's slow disk is not one."""

from __future__ import annotations

import os

import pytest
import torch

from stoker.common.config import AveragingSettings
from stoker.common.faults import CHECKPOINT_READ_ENV, CHECKPOINT_WRITE_ENV
from stoker.training import rendezvous
from stoker.training.consumer import _connect_store, _join_group
from tests.conftest import read_summary, run_cli
from tests.faults.test_faults import fault, train_args

pytestmark = pytest.mark.timeout(180)


def test_checkpoint_writes_and_resume_reads_longer_than_the_collective_timeout_do_not_fail_the_run(
        textures, tmp_path):
    """Each checkpoint file takes 2 s to write or read on rank 0, against a 5 s collective timeout: rank 1 waits 6 s
    for the three files of the checkpoint that ends the epoch, and 6 s while rank 0 reads them to resume."""
    common = ("--devices", "cpu:2", "--collective-timeout-s", "5", "--seed", "2")
    run_cli(*train_args(textures, tmp_path, "--epochs", "1", *common), env={CHECKPOINT_WRITE_ENV: "2000"})
    summary = read_summary(tmp_path)
    assert summary["status"] == "completed" and summary["checkpoint"].endswith("step_00000008")
    run_cli(*train_args(textures, tmp_path, "--epochs", "2", "--resume", str(tmp_path), *common),
            env={CHECKPOINT_READ_ENV: "2000"})
    resumed = read_summary(tmp_path)
    assert resumed["status"] == "completed" and resumed["start_step"] == 8


def test_a_stuck_consumer_is_named(textures, tmp_path):
    result = run_cli(*train_args(textures, tmp_path, "--devices", "cpu:2", "--epochs", "1",
                                 "--collective-timeout-s", "5", "--on-consumer-failure", "stop"),
                     env=fault("consumer:hang:rank=1,step=5;"), check=False)
    summary = read_summary(tmp_path)
    assert result.returncode == 1 and summary["status"] == "failed"
    assert summary["error"].startswith("consumer 1 (pid"), summary["error"][:300]
    assert "is stuck" in summary["error"]


def test_nccl_starts_eagerly_on_its_device_with_errors_raised_not_aborting(tmp_path, monkeypatch):
    """No GPU here: the group's init is recorded instead of run, with the environment it saw."""
    calls = []

    def init_process_group(backend, **kwargs):
        calls.append((backend, kwargs, os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")))

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", *rendezvous.SOCKET_INTERFACE_ENV):
        monkeypatch.setenv(name, "before")  # and restored after the test
    store = rendezvous.LocalStore()
    try:
        for device in ("cuda:1", "cpu"):
            setup = _Setup(device, store.address)
            _join_group(setup, _connect_store(setup))
    finally:
        store.close()
    (nccl, nccl_kwargs, handling), (gloo, gloo_kwargs, _) = calls
    assert nccl == "nccl" and nccl_kwargs["device_id"] == torch.device("cuda:1")
    assert handling == "2"  # set before init: abort the communicator and raise, not SIGABRT the process
    assert gloo == "gloo" and "device_id" not in gloo_kwargs


class _Setup:
    """The fields of ConsumerSetup that joining the group reads."""

    def __init__(self, device: str, store: rendezvous.StoreAddress) -> None:
        self.device, self.store, self.rank, self.world_size = device, store, 0, 1
        self.averaging = AveragingSettings(collective_timeout_s=5.0)

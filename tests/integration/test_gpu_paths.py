"""GPU tests that would catch the CUDA path's known faults (the `gpu` marker: skipped where no GPU is, and the suite
stops instead of skipping when nvidia-smi lists GPUs that torch cannot see). Written without a GPU at hand: each
states what it would catch. The whole GPU check (`tools/gpu-check.sh`) is sized for under 8 minutes on one GPU."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tests.conftest import assert_same_weights, cuda_device_count, read_summary, run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def two_gpus(test):
    """Skipped below two GPUs; `tools/gpu-check.sh` runs these after its benchmark (`-m two_gpus`)."""
    return pytest.mark.two_gpus(pytest.mark.skipif(cuda_device_count() < 2, reason="needs two GPUs")(test))


def _train(textures, out, *extra: str, devices: str = "cuda:0", env: dict | None = None, check: bool = True):
    train, val = textures
    return run_cli("train", "--data", str(train), "--val", str(val), "--devices", devices, "--batch-size", "8",
                   "--image-size", "32", "--out", str(out), "--quiet", *extra, env=env, check=check)


def _completed_and_identical(out) -> dict:
    summary = read_summary(out)
    assert summary["status"] == "completed", summary.get("error")
    assert summary["replicas_identical"] is True
    assert summary["duplicate_samples"] == 0 and summary["missing_samples"] == 0
    return summary


class _SlowCopies:
    """CudaOps whose host-to-device copies start only after 2 ms of device work on the copy stream: a staging
    buffer rewritten before its copy completed, or a compute that does not wait for its copy, shows up as wrong
    bytes (this race shows up there and nowhere else)."""

    def __init__(self) -> None:
        from stoker.training.streams import CudaOps

        self.inner = CudaOps(torch.device("cuda:0"))

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def copy(self, destination, source) -> None:
        torch.cuda._sleep(4_000_000)  # about 2 ms of the copy stream's time
        self.inner.copy(destination, source)


def test_the_batch_on_the_device_is_the_slot_s_bytes_over_many_steps_with_slow_copies():
    from stoker.pipeline.ring import SlotRing
    from stoker.training.to_device import DeviceLoader

    torch.cuda.set_device(0)
    ring = SlotRing.create(2, 16, 32, 1)
    try:
        ops = _SlowCopies()
        loader = DeviceLoader(ring, torch.device("cuda:0"), channels_last=True, ops=ops)  # type: ignore[arg-type]
        rng = np.random.default_rng(0)
        expected, got = [], []
        for step in range(200):
            slot = step % 2
            ring.images[slot] = rng.integers(0, 256, ring.images[slot].shape, dtype=np.uint8)
            ring.labels[slot] = rng.integers(0, 10, ring.labels[slot].shape)
            ring.ids[slot] = np.arange(16) + 16 * step
            ring.counts[slot] = 16 if step % 7 else 11  # short batches too
            count = int(ring.counts[slot])
            expected.append((ring.images[slot, :count].copy(), ring.labels[slot, :count].copy()))
            images, labels, _ = loader.take(slot, lambda s: None)
            got.append((images, labels))  # read only at the end: no synchronization hides a race
            ring.images[slot] = 0  # the producer refills the slot at once
        torch.cuda.synchronize()
        mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
        std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
        for (pixels, labels), (images, device_labels) in zip(expected, got):
            want = (torch.from_numpy(pixels).permute(0, 3, 1, 2).float() - mean) / std
            torch.testing.assert_close(images.cpu(), want, rtol=0, atol=1e-4)
            assert torch.equal(device_labels.cpu(), torch.from_numpy(labels))
    finally:
        ring.close()


def test_a_consumer_waiting_for_its_gpu_sleeps_instead_of_spinning_a_core():
    """The GPU is the limit (40 ms of device work a step): the host holds back at two steps ahead on blocking
    events, so it uses under a third of a core. With spinning events it would use a whole one."""
    from stoker.training.streams import CudaOps
    from stoker.training.timing import StepClock

    torch.cuda.set_device(0)
    ops = CudaOps(torch.device("cuda:0"))
    clock = StepClock(ops)
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(50):
        clock.begin(host_wait_s=0.0)
        clock.fed()
        torch.cuda._sleep(80_000_000)  # about 40 ms at 2 GHz
        clock.computed()
        clock.end(averaged=False)
    torch.cuda.synchronize()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert wall > 1.0  # the device was the limit
    assert cpu / wall < 1 / 3, f"the host used {cpu / wall:.0%} of a core while waiting for the GPU"


def test_the_host_share_of_a_launch_bound_model_is_not_read_as_input_wait(textures, tmp_path):
    """A tiny model at 32 px is launch-bound on any GPU: its device idles for Python, not for input."""
    _train(textures, tmp_path, "--epochs", "2", "--producers", "4")
    summary = _completed_and_identical(tmp_path)
    assert summary["host_fraction"][0] > 0
    assert summary["verdict"]["kind"] != "input-bound" or summary["input_stall_fraction"][0] >= \
        summary["host_fraction"][0]


def test_fp16_with_its_gradient_scaler_trains_and_keeps_the_scale_in_the_checkpoint(textures, tmp_path):
    _train(textures, tmp_path, "--epochs", "1", "--precision", "fp16")
    summary = _completed_and_identical(tmp_path)
    assert np.isfinite(summary["train_loss"])
    (rank0,) = sorted((tmp_path / "checkpoints").glob("step_*/rank_0*.pt"))[-1:]
    state = torch.load(rank0, weights_only=True)
    assert state["grad_scaler"]["scale"].item() > 0


def test_fused_adamw_trains_on_a_gpu(textures, tmp_path):
    _train(textures, tmp_path, "--epochs", "1", "--optimizer", "adamw", "--lr", "0.001")
    assert np.isfinite(_completed_and_identical(tmp_path)["train_loss"])


def test_a_model_has_several_averaging_groups_on_a_gpu():
    from stoker.training.averager import Averager
    from stoker.training.models import build_model

    for name in ("resnet8", "resnet18"):
        model = build_model(name, 10).cuda()
        averager = Averager(model, 1, 2, in_backward=True)
        assert averager.backward is not None and len(averager.backward.groups) >= 3, name
        for tensor in (*model.parameters(), *model.buffers()):
            assert not tensor.is_floating_point() or tensor.data_ptr() % 64 == 0


@two_gpus
def test_two_gpus_average_during_backward_with_several_groups(textures, tmp_path):
    _train(textures, tmp_path, "--epochs", "1", "--model", "resnet18", devices="cuda:0,1")
    _completed_and_identical(tmp_path)


@two_gpus
def test_two_gpus_overlapped_averaging(textures, tmp_path):
    _train(textures, tmp_path, "--epochs", "1", "--overlap-averaging", "true", "--sync-every", "2",
           devices="cuda:0,1")
    _completed_and_identical(tmp_path)


@two_gpus
def test_two_gpus_outer_optimizer(textures, tmp_path):
    _train(textures, tmp_path, "--epochs", "1", "--outer-optimizer", "nesterov", "--sync-every", "2",
           devices="cuda:0,1")
    _completed_and_identical(tmp_path)


@two_gpus
def test_two_gpus_resume_is_exact(textures, tmp_path):
    """The states go to rank 0 and back on the gloo side group; the resumed run ends where a straight one does."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = ("--epochs", "2", "--seed", "5", "--deterministic", "true", "--model", "nobn:small_cnn")
    _train(textures, straight, *common, devices="cuda:0,1")
    result = _train(textures, split, *common, devices="cuda:0,1",
                    env={"STOKER_FAULT": "consumer:interrupt-parent:rank=0,step=5;"}, check=False)
    assert result.returncode == 130
    run_cli("train", "--resume", str(split), "--devices", "cuda:0,1", "--quiet")
    assert_same_weights(straight, split)


@two_gpus
def test_two_gpus_compile_without_a_collective_timeout(textures, tmp_path):
    """Both consumers compile before the first collective; a 20 s collective timeout must not fire even though
    compiling takes longer, and the short last batch and validation compile nothing more."""
    _train(textures, tmp_path, "--epochs", "2", "--compile", "true", "--collective-timeout-s", "20",
           devices="cuda:0,1")
    _completed_and_identical(tmp_path)

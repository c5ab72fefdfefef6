"""Which devices the consumers run on: `auto`, `cpu:N`, `cuda` or `cuda:I,J,...`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

_DEVICES_PATTERN = re.compile(r"^(auto|cpu:[1-9][0-9]*|cuda|cuda:[0-9]+(,[0-9]+)*)$")


def check_devices_form(spec: str) -> str:
    """The form of a devices setting (train's `--devices`, eval's and predict's), before anything resolves it; the
    caller names the setting."""
    if not isinstance(spec, str) or not _DEVICES_PATTERN.match(spec):
        raise ValueError("expected 'auto', 'cpu:N' (N >= 1), 'cuda' or 'cuda:I,J,...'")
    return spec


def resolve_devices(spec: str, batch_size: int | None = None) -> list[str]:
    """One device string per consumer; asking for a GPU that is not there is a user error, raised here. `auto` on
    the CPU splits one batch of `batch_size` over its consumers (`shares_one_batch`): never more of them than the
    batch has samples."""
    import torch  # here: the other helpers count cores for commands that never touch a device (`--help`)

    if spec.startswith("cpu:"):
        return ["cpu"] * int(spec.split(":")[1])
    check_torch_sees_the_gpus()
    if spec == "auto":
        if torch.cuda.is_available():
            return resolve_devices("cuda")
        return ["cpu"] * min(default_cpu_consumers(), batch_size or default_cpu_consumers())
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available == 0:
        raise ValueError(f"devices={spec!r}: no CUDA device is visible (use 'auto' or 'cpu:N')")
    if spec == "cuda":
        return [f"cuda:{i}" for i in range(available)]
    indices = [int(i) for i in spec.split(":")[1].split(",")]
    missing = [i for i in indices if i >= available]
    if missing or len(set(indices)) != len(indices):
        raise ValueError(f"devices={spec!r}: expected distinct indices below {available} (visible GPUs)")
    return [f"cuda:{i}" for i in indices]


class TorchCannotSeeGpus(ValueError):
    """The machine has GPUs (nvidia-smi lists them) and this torch sees none: training would silently run on the
    CPU, GPU tests would skip and pass, and `bench gpu` would run ResNet-50 on the CPU for hours."""


def check_torch_sees_the_gpus() -> None:
    """Raise `TorchCannotSeeGpus` when nvidia-smi lists GPUs that torch cannot use, unless CUDA_VISIBLE_DEVICES
    hides them on purpose."""
    import torch

    if _gpus_hidden_on_purpose() or torch.cuda.device_count() > 0:
        return
    listed, driver_cuda = gpus_listed_by_nvidia_smi()
    if not listed:
        return
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU-only wheel)"
    wheel = f"cu{driver_cuda.replace('.', '')}" if driver_cuda else "cuXYZ"
    raise TorchCannotSeeGpus(
        f"nvidia-smi lists {listed} GPU{'s' if listed > 1 else ''} (driver supports CUDA {driver_cuda or '?'}), "
        f"but torch {torch.__version__}, built for {build}, sees none: install a torch wheel built for a CUDA "
        f"version this driver supports, e.g. pip install torch --index-url https://download.pytorch.org/whl/{wheel} "
        "(or update the driver); to train on the CPU on purpose use --devices cpu:N or CUDA_VISIBLE_DEVICES=''")


def gpus_listed_by_nvidia_smi() -> tuple[int, str | None]:
    """(GPUs `nvidia-smi -L` lists, the CUDA version its driver supports); (0, None) without nvidia-smi."""
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return 0, None
    try:
        listing = subprocess.run([executable, "-L"], capture_output=True, text=True, timeout=20).stdout
        header = subprocess.run([executable], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0, None
    version = re.search(r"CUDA Version:\s*([0-9]+\.[0-9]+)", header)
    return sum(line.startswith("GPU ") for line in listing.splitlines()), version.group(1) if version else None


def _gpus_hidden_on_purpose() -> bool:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles")


def available_cores() -> int:
    """The cores this process may run on: a container's or taskset's CPU set, not the whole machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_cpu_consumers() -> int:
    """On a CPU-only machine, two consumers of half the cores each (one on one core). Measured on 2 cores: two
    single-threaded consumers trained 1.10x one with both threads on the built-in set and 1.17x on 64 px photos
    (intra-op threads split a small model's convolutions poorly; processes split the batch), three 0.97x two.
    Beyond 2 cores this is unmeasured and kept at two. The two share one batch (`shares_one_batch`)."""
    return min(2, available_cores())


def shares_one_batch(spec: str, devices: list[str]) -> bool:
    """Whether the consumers of `devices` split one `--batch-size` a step between them instead of taking one each:
    `--devices auto` without a GPU, where the CPU is the one device, split into processes only because they train
    it faster. An automatic choice must not change what the run learns: the global batch, the steps and the
    learning rate are those of `cpu:1` (one CPU device per machine); `cpu:N`, written out, is N devices of
    `--batch-size` each."""
    return spec == "auto" and len(devices) > 1 and all(device == "cpu" for device in devices)


def threads_per_consumer(devices: list[str]) -> int:
    """CPU consumers share the cores evenly so they don't fight over them; a GPU consumer needs one."""
    if devices[0].startswith("cuda"):
        return 1
    return max(1, available_cores() // len(devices))


def oversubscription(devices: list[str], cores: int) -> str | None:
    """A warning when CPU consumers outnumber the cores: each gets less than a core, they and the producers
    contend, and "device compute" then measures time on a shared core, not a device's."""
    cpu = sum(device == "cpu" for device in devices)
    if cpu <= cores:
        return None
    return (f"{cpu} CPU consumers on {cores} cores: they share the cores with each other and the producers, so "
            f"training is slower than with devices=cpu:{cores} or fewer, and 'device compute' includes time spent "
            "waiting for a core")

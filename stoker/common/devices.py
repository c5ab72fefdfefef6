"""Which devices the consumers run on: `auto`, `cpu:N`, `cuda` or `cuda:I,J,...`."""

from __future__ import annotations

import os


def resolve_devices(spec: str) -> list[str]:
    """One device string per consumer; asking for a GPU that is not there is a user error, raised here."""
    import torch  # here: the other helpers count cores for commands that never touch a device (`--help`)

    if spec == "auto":
        return resolve_devices("cuda") if torch.cuda.is_available() else ["cpu"] * default_cpu_consumers()
    if spec.startswith("cpu:"):
        return ["cpu"] * int(spec.split(":")[1])
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


def available_cores() -> int:
    """The cores this process may run on: a container's or taskset's CPU set, not the whole machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_cpu_consumers() -> int:
    """On a CPU-only machine one consumer uses the cores the producers leave; more would only split them."""
    return 1 if available_cores() <= 2 else 2


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

"""The small device interface the feed and the timings are written against: streams, events and copies.

On a GPU the host only enqueues work: a copy or a kernel has happened when an event recorded after it on its stream
has completed, not when the call returns. `CudaOps` is that, over torch.cuda. `CpuOps` is the same interface for a
device where every call has finished when it returns (events are host timestamps). Tests drive the feed with a
fake that records the calls, so the ordering that CUDA needs is checked on a machine without one.

Every host wait on the device sleeps: CUDA events are made with `blocking=True`. Without it, with the default
`cudaDeviceScheduleAuto` and fewer GPU contexts than cores, `cudaEventSynchronize` spins a whole core for as long
as the device is busy, and a consumer whose GPU is the limit would burn the core its producers were counted on.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch


class DeviceOps(Protocol):
    device: torch.device
    asynchronous: bool  # whether calls return before the device has done the work

    def compute_stream(self) -> Any:
        """The stream training runs on (the current stream)."""

    def copy_stream(self) -> Any:
        """A side stream for host-to-device copies, so they overlap the compute stream."""

    def on(self, stream: Any) -> AbstractContextManager:
        """Work enqueued inside goes to `stream`."""

    def new_event(self) -> Any: ...

    def record(self, event: Any, stream: Any) -> None:
        """`event` completes when `stream` has done everything enqueued on it so far."""

    def wait(self, stream: Any, event: Any) -> None:
        """Work enqueued on `stream` from now on starts after `event` (the host does not wait)."""

    def done(self, event: Any) -> bool:
        """Whether `event` has completed (never blocks)."""

    def synchronize(self, event: Any) -> None:
        """The host waits until `event` has completed."""

    def elapsed_s(self, start: Any, end: Any) -> float:
        """Device time between two completed events."""

    def pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory (a copy from it to the device can be asynchronous)."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Memory on the device."""

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """Enqueue a host-to-device copy on the current stream."""

    def to_host(self, value: torch.Tensor) -> torch.Tensor:
        """A host copy of `value`, enqueued on the current stream: readable without a synchronization once an event
        recorded after it has completed (a `.item()` or `.tolist()` would wait for everything enqueued)."""


class CpuOps:
    """Every call has finished when it returns: an event is the host clock when it was recorded."""

    asynchronous = False

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def compute_stream(self) -> None:
        return None

    def copy_stream(self) -> None:
        return None

    def on(self, stream: Any) -> AbstractContextManager:
        return nullcontext()

    def new_event(self) -> list[float]:
        return [0.0]

    def record(self, event: list[float], stream: Any) -> None:
        event[0] = time.perf_counter()

    def wait(self, stream: Any, event: Any) -> None:
        pass

    def done(self, event: Any) -> bool:
        return True

    def synchronize(self, event: Any) -> None:
        pass

    def elapsed_s(self, start: list[float], end: list[float]) -> float:
        return end[0] - start[0]

    def pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        destination.copy_(source)

    def to_host(self, value: torch.Tensor) -> torch.Tensor:
        return value.detach()


# enable_timing: step phases are read from events; blocking: a host wait on one sleeps instead of spinning.
EVENT_FLAGS = {"enable_timing": True, "blocking": True}


class CudaOps:
    """torch.cuda's streams and events on one GPU."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._copy_stream = torch.cuda.Stream(device)

    def compute_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def copy_stream(self) -> torch.cuda.Stream:
        return self._copy_stream

    def on(self, stream: torch.cuda.Stream) -> AbstractContextManager:
        return torch.cuda.stream(stream)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event(**EVENT_FLAGS)

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def done(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def elapsed_s(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1000

    def pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        destination.copy_(source, non_blocking=True)

    def to_host(self, value: torch.Tensor) -> torch.Tensor:
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        host.copy_(value.detach(), non_blocking=True)
        return host


def ops_for(device: torch.device) -> DeviceOps:
    return CudaOps(device) if device.type == "cuda" else CpuOps()

"""Where the consumers meet to form their process group, and what that opens to the network.

On one machine nothing needs the network: the consumers meet through a FileStore in a folder only this user can
enter, and gloo (or NCCL's bootstrap) is bound to the loopback interface. A TCPStore would listen on every
interface, unauthenticated, for anyone who reaches the machine to write into. On several machines the consumers
meet at the first machine's TCPStore, which the other machines must reach (README: "Several machines").
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stoker.pipeline.ring import hold_lock, remove_if_unheld

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_IFF_LOOPBACK = 0x8  # net/if.h
# The interface the communication libraries bind to; set in each consumer before its group forms.
SOCKET_INTERFACE_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class StoreAddress:
    """A FileStore's file (one machine) or a TCPStore's host and port (several)."""

    file: str | None = None
    host: str | None = None
    port: int | None = None

    @property
    def local(self) -> bool:
        return self.file is not None

    def connect(self, world_size: int, timeout_s: float) -> dist.Store:
        timeout = datetime.timedelta(seconds=timeout_s)
        if self.file is not None:
            store = dist.FileStore(self.file, world_size)
            store.set_timeout(timeout)
            return store
        assert self.host is not None and self.port is not None, "an address is a file or a host and a port"
        return dist.TCPStore(self.host, self.port, world_size, is_master=False, timeout=timeout)


STORE_PREFIX = "stoker-store-"
# stoker-store-PID-XXXXXXXX (mkdtemp's 8 characters never hold a '-'): folders named before they were locked,
# stoker-store-XXXXXXXX, are never swept, as a run of an older stoker may still use one.
_STORE_PATTERN = re.compile(rf"^{STORE_PREFIX}\d+-[a-z0-9_]{{8}}$")


class LocalStore:
    """The private folder that holds one machine's FileStore; `close()` removes it (idempotent). Its controller
    holds a `flock` on the folder while it lives, so a start after a killed run removes it (`sweep_dead_stores`),
    by the ring's rule."""

    def __init__(self) -> None:
        for _ in range(3):  # a start's sweep may take the folder between its creation and our lock: rare
            folder = tempfile.mkdtemp(prefix=f"{STORE_PREFIX}{os.getpid()}-")  # mode 0700: this user only
            lock = hold_lock(folder)
            if lock is not None:
                break
        else:
            raise OSError(f"could not create and lock a store folder in {tempfile.gettempdir()}")
        self._lock = lock
        self.folder: Path | None = Path(folder)
        self.address = StoreAddress(file=str(self.folder / "store"))

    def close(self) -> None:
        folder, self.folder = self.folder, None
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
            os.close(self._lock)


def sweep_dead_stores() -> list[str]:
    """Remove this user's store folders that no live controller holds (a killed one never removed its own)."""
    root = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if _STORE_PATTERN.match(n)]
    except OSError:
        return []
    removed = [n for n in names if _owned(os.path.join(root, n))
               and remove_if_unheld(os.path.join(root, n), remove=shutil.rmtree)]
    if removed:
        log.info("removed %d store folder(s) of dead runs from %s: %s", len(removed), root, ", ".join(removed))
    return removed


def _owned(path: str) -> bool:
    try:
        return os.lstat(path).st_uid == os.getuid() and os.path.isdir(path) and not os.path.islink(path)
    except OSError:
        return False


def host_tcp_store(host: str, clients: int, timeout_s: float) -> tuple[dist.TCPStore, StoreAddress]:
    """Several machines: the first machine's store, on a free port, that the others' consumers connect to."""
    store = dist.TCPStore(host, 0, clients + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, StoreAddress(host=host, port=store.port)


def bind_to_loopback() -> None:
    """This process's gloo and NCCL sockets listen on the loopback interface only (one machine: no peer is
    elsewhere). Overrides a setting meant for multi-machine runs, which would expose a one-machine run."""
    interface = loopback_interface()
    for name in SOCKET_INTERFACE_ENV:
        os.environ[name] = interface


def loopback_interface() -> str:
    """The loopback interface's name (`lo` on Linux), found by its flag rather than assumed."""
    try:
        for name in sorted(os.listdir("/sys/class/net")):
            flags = Path(f"/sys/class/net/{name}/flags").read_text()
            if int(flags, 16) & _IFF_LOOPBACK:
                return name
    except (OSError, ValueError):
        pass
    return "lo"


@dataclass(frozen=True)
class GroupOptions:
    """How a consumer on `device` joins the group: the backend, init_process_group's extra arguments and the
    environment the backend reads at init."""

    backend: str
    init_kwargs: dict[str, Any]
    env: dict[str, str]


def group_options(device: torch.device) -> GroupOptions:
    """gloo on CPU. NCCL on GPU, initialised eagerly on this consumer's device (`device_id`: a bad setup fails at
    start, not at the first average) and with asynchronous error handling that aborts the communicator and raises
    in the consumer (mode 2, CleanUpOnly) instead of torch's default (3), which kills the process with SIGABRT: a
    raised error reaches the controller, which names the dead or stuck peer as it does on CPU."""
    if device.type != "cuda":
        return GroupOptions("gloo", {}, {})
    return GroupOptions("nccl", {"device_id": device}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"})

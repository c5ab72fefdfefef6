"""Replica states between the consumers and rank 0: collected into a checkpoint, handed back on resume.

Each rank's state goes to rank 0 only, point to point, as tensors and JSON (`wire`): O(world) bytes per checkpoint,
nothing unpickled. Rank 0 writes (or reads) one rank's file at a time, so it holds one state besides its own.

Rank 0's disk work can take longer than the collective timeout (a ResNet-50 with AdamW is about 300 MB a rank; a
network filesystem may write 10 MB/s), and that timeout is meant for a peer that is gone, not for a slow disk.
So the other ranks never wait for rank 0's disk inside a collective: they wait here, polling the store, and each
transfer starts only once rank 0 has called that rank. Rank 0 counts every file it finishes; a waiting rank gives
up, naming consumer 0, only when no file was finished for the collective timeout plus the time one file takes at
10 MB/s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stoker.common import checkpoint
from stoker.training import wire

# Polls start fast (a checkpoint of a small model is over in milliseconds, and each poll here delays the next
# step) and back off to POLL_S for a slow disk.
FIRST_POLL_S, POLL_S = 0.001, 0.05
SLOW_DISK_BYTES_PER_S = 10e6


class RankZeroStuck(RuntimeError):
    """Rank 0 finished no file within the allowance, or the store it reports through is gone."""


class RankZeroWork:
    """The store keys through which rank 0 paces the others during one checkpoint or resume (`name`)."""

    def __init__(self, store: dist.Store, name: str, allowance_s: float, alive: Callable[[], None]) -> None:
        self.store = dist.PrefixStore(f"stoker-exchange/{name}/", store)
        self.name = name
        self.allowance_s = allowance_s
        self.alive = alive  # raises when this process must stop (the controller said so, or is gone)

    def post(self, key: str) -> None:
        self.store.set(key, "1")

    def progress(self) -> None:
        self.store.add("progress", 1)

    def wait(self, key: str) -> None:
        """Until rank 0 posts `key`; fails only when rank 0 stops making progress."""
        seen, deadline = -1, time.monotonic() + self.allowance_s
        pause = FIRST_POLL_S
        while not self._ask(lambda: self.store.check([key])):
            self.alive()
            done = self._ask(lambda: self.store.add("progress", 0))
            if done != seen:
                seen, deadline = done, time.monotonic() + self.allowance_s
            elif time.monotonic() > deadline:
                raise RankZeroStuck(f"consumer 0 finished no file of the {self.name} for {self.allowance_s:.0f} s "
                                    "(is its disk or network filesystem stuck?)")
            time.sleep(pause)
            pause = min(2 * pause, POLL_S)

    def _ask(self, question: Callable[[], Any]) -> Any:
        try:
            return question()
        except RuntimeError as error:  # a TCPStore whose server (the first machine's controller) is gone
            raise RankZeroStuck(f"lost contact with consumer 0's machine during the {self.name}: {error}") from None


def allowance_s(collective_timeout_s: float, model: torch.nn.Module) -> float:
    """How long rank 0 may take for one file: a rank's file holds at most the model, its EMA and two optimizer
    moments."""
    model_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    return collective_timeout_s + 4 * model_bytes / SLOW_DISK_BYTES_PER_S


def host_group() -> dist.ProcessGroup | None:
    """The group replica states travel on: the default one where it moves host memory (gloo), else a gloo side
    group. Through NCCL a ResNet-50's 300 MB state with AdamW would go CPU -> GPU -> GPU -> CPU, about five copies
    per rank and as much GPU memory held on rank 0. Every consumer calls this once, in the same order."""
    return dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None


def save(work: RankZeroWork, folder: Path, model_state: dict, state: dict, rank: int, world: int,
         group: dist.ProcessGroup | None = None) -> dict[str, str]:
    """Rank 0 writes the model and every rank's state (file name -> SHA-256); the others send theirs, on the host
    over `group` (gloo; None: the default group, which must be gloo)."""
    device = torch.device("cpu")
    if rank != 0:
        work.wait(f"call/{rank}")
        wire.send(state, 0, device, group)
        work.wait("done")
        return {}
    files = {checkpoint.MODEL_FILE: _write(work, folder / checkpoint.MODEL_FILE, model_state),
             checkpoint.rank_file(0): _write(work, folder / checkpoint.rank_file(0), state)}
    for source in range(1, world):
        work.post(f"call/{source}")
        files[checkpoint.rank_file(source)] = _write(work, folder / checkpoint.rank_file(source),
                                                     wire.recv(source, device, group))
    work.post("done")
    return files


def load_model(work: RankZeroWork, folder: Path, rank: int) -> dict | None:
    """Rank 0 reads the averaged model; the others wait until it has, outside any collective."""
    if rank != 0:
        work.wait("model")
        return None
    model_state = checkpoint.load_verified(folder / checkpoint.MODEL_FILE)
    work.progress()
    work.post("model")
    return model_state


def hand_out(work: RankZeroWork, folder: Path, rank: int, world: int,
             group: dist.ProcessGroup | None = None, saved: int = 0) -> dict:
    """This rank's state from the checkpoint: rank 0 reads each rank's file and sends it to that rank only, on the
    host over `group` (as `save`). A checkpoint of `saved` consumers (another count: 0 means `world`) gives rank r
    the state of its consumer r mod `saved`."""
    saved = saved or world
    device = torch.device("cpu")
    if rank != 0:
        work.wait(f"call/{rank}")
        state = wire.recv(0, device, group)
        work.wait("done")
        return state
    mine = _read(work, folder, 0)
    for target in range(1, world):
        state = _read(work, folder, target % saved)
        work.post(f"call/{target}")
        wire.send(state, target, device, group)
    work.post("done")
    return mine


def _write(work: RankZeroWork, path: Path, state: dict) -> str:
    digest = checkpoint.save_tensors(path, state)
    work.progress()
    return digest


def _read(work: RankZeroWork, folder: Path, rank: int) -> dict:
    state = checkpoint.load_verified(folder / checkpoint.rank_file(rank))
    work.progress()
    return state

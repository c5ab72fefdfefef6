"""Consumer process: one model replica on one device, training on the batches the controller hands it, in order.

It copies a slot to its device (uint8: four times fewer bytes than float32), hands the slot back at once,
normalizes on the device, runs forward, backward and the optimizer step, and joins the averaging collective.
"""

from __future__ import annotations

import math
import queue
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from stoker import checkpoint, faults
from stoker.averager import Averager, OuterSpec
from stoker.models import build_model
from stoker.plan import Kind
from stoker.procs import POLL_S, ChildError, ParentWatch, exit_with_parent, name_process
from stoker.ring import RingSpec, SlotRing

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class ConsumerSetup:
    rank: int  # global, over every machine's consumers
    local_rank: int  # on this machine: how the controller knows this consumer
    world_size: int
    device: str
    store_host: str
    store_port: int
    ring: RingSpec
    model: str
    num_classes: int
    optimizer: str
    lr: float
    schedule: str
    total_steps: int
    momentum: float
    weight_decay: float
    sync_every: int
    outer: OuterSpec | None
    overlap_averaging: bool
    seed: int
    num_threads: int
    collective_timeout_s: float
    check_replicas_every: int
    resume_from: Path | None


# Controller -> consumer, in the order they must be handled.
@dataclass(frozen=True)
class Batch:
    kind: Kind
    epoch: int
    step: int
    global_step: int
    slot: int | None  # None: this rank has no samples in this step but still joins the collective
    step_samples: int


@dataclass(frozen=True)
class ValEnd:
    epoch: int


@dataclass(frozen=True)
class Save:
    folder: Path
    global_step: int


@dataclass(frozen=True)
class Finish:
    model_path: Path


# Consumer -> controller.
@dataclass(frozen=True)
class SlotFree:
    slot: int


@dataclass(frozen=True)
class StepReport:
    rank: int
    epoch: int
    step: int
    global_step: int
    count: int
    loss: float
    wait_s: float
    compute_s: float
    averaging_s: float
    sample_ids: np.ndarray
    digest: str | None


@dataclass(frozen=True)
class ValReport:
    epoch: int
    loss: float
    accuracy: float
    count: int


@dataclass(frozen=True)
class Saved:
    rank: int
    global_step: int
    files: dict[str, str]  # file name -> SHA-256


@dataclass(frozen=True)
class Finished:
    rank: int
    digest: str
    first_wait_s: float


@dataclass(frozen=True)
class ConsumerFailed:
    rank: int
    error: ChildError


class Stopped(Exception):
    """The controller asked us to stop, or it is gone."""


def consumer_main(setup: ConsumerSetup, ready, outbox, stop) -> None:
    """Process entry point."""
    name_process(f"stoker consumer {setup.rank}")
    exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller handles Ctrl-C and tells us what to do
    ring = SlotRing.attach(setup.ring)
    doing = "starting"
    try:
        replica = Replica(setup, ring, outbox)
        doing = "training"
        replica.serve(ready, stop)
    except Stopped:
        pass
    except BaseException as error:
        outbox.send(ConsumerFailed(setup.local_rank, ChildError.capture(f"consumer {setup.rank}", doing, error)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        ring.close()


class Replica:
    def __init__(self, setup: ConsumerSetup, ring: SlotRing, outbox) -> None:
        self.setup = setup
        self.ring = ring
        self.outbox = outbox
        torch.set_num_threads(setup.num_threads)
        torch.manual_seed(setup.seed)
        self.device = torch.device(setup.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        _join_group(setup)
        self.model = build_model(setup.model, setup.num_classes).to(self.device)
        self.averager = Averager(self.model, setup.sync_every, setup.world_size, setup.ring.batch_size,
                                 setup.outer, setup.overlap_averaging)
        self.optimizer = _make_optimizer(self.model, setup)
        self.loader = DeviceLoader(ring, self.device)
        if setup.resume_from is not None:
            self._restore(setup.resume_from)
        else:
            _broadcast_initial_state(self.averager)
            if self.averager.outer is not None:
                self.averager.outer.reset_anchor()
        self.first_wait_s: float | None = None
        self.val_totals = torch.zeros(3, dtype=torch.float64)

    def serve(self, ready, stop) -> None:
        watch = ParentWatch()
        while True:
            waited_from = time.perf_counter()
            message = _next_message(ready, stop, watch)
            wait_s = time.perf_counter() - waited_from
            if isinstance(message, Batch) and message.kind == "train":
                self.train_step(message, wait_s)
            elif isinstance(message, Batch):
                self.val_batch(message)
            elif isinstance(message, ValEnd):
                self.val_end(message)
            elif isinstance(message, Save):
                self.save(message)
            elif isinstance(message, Finish):
                self.finish(message)
                return

    def train_step(self, batch: Batch, wait_s: float) -> None:
        if self.first_wait_s is None:
            self.first_wait_s, wait_s = wait_s, 0.0  # waiting for the very first batch is start-up, not a stall
        started = time.perf_counter()
        images, labels, ids = self.loader.take(batch.slot, self.outbox)
        loss_value = 0.0
        if len(ids):
            self._set_learning_rate(batch.global_step)
            self.model.train()
            self.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(self.model(images), labels)
            loss.backward()
            self.optimizer.step()
            loss_value = loss.item()
            faults.simulated_delay(faults.STEP_TIME_ENV)
        compute_s = time.perf_counter() - started
        faults.maybe_inject("consumer", f"rank={self.setup.rank},step={batch.global_step};")
        averaging_s = self.averager.after_step(batch.global_step, len(ids), batch.step_samples)
        digest = None
        every = self.setup.check_replicas_every
        if averaging_s is not None and self.averager.replicas_agree and every and (batch.global_step + 1) % every == 0:
            digest = self.averager.digest()
        self.outbox.send(StepReport(self.setup.local_rank, batch.epoch, batch.step, batch.global_step, len(ids),
                                  loss_value, wait_s, compute_s, averaging_s or 0.0, ids, digest))

    def _set_learning_rate(self, global_step: int) -> None:
        lr = self.setup.lr
        if self.setup.schedule == "cosine":
            lr *= 0.5 * (1 + math.cos(math.pi * global_step / self.setup.total_steps))
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def val_batch(self, batch: Batch) -> None:
        images, labels, _ = self.loader.take(batch.slot, self.outbox)
        if not len(labels):
            return
        self.model.eval()
        with torch.no_grad():
            logits = self.model(images)
            loss_sum = F.cross_entropy(logits, labels, reduction="sum").item()
            correct = (logits.argmax(1) == labels).sum().item()
        self.val_totals += torch.tensor([loss_sum, correct, len(labels)], dtype=torch.float64)

    def val_end(self, message: ValEnd) -> None:
        totals = self.val_totals.to(self.device)
        dist.all_reduce(totals)
        loss_sum, correct, count = totals.tolist()
        self.val_totals.zero_()
        if self.setup.rank == 0 and count:
            self.outbox.send(ValReport(message.epoch, loss_sum / count, correct / count, int(count)))

    def save(self, message: Save) -> None:
        """Rank 0 writes the whole checkpoint, every replica's state included: on several machines only the first
        has the run folder's checkpoints, so resuming needs nothing from the others' disks."""
        states = _collect_on_rank0(checkpoint.to_cpu(self._rank_state()), self.setup.rank, self.setup.world_size)
        files = {}
        if self.setup.rank == 0:
            files[checkpoint.MODEL_FILE] = checkpoint.save_tensors(message.folder / checkpoint.MODEL_FILE,
                                                                   self.model.state_dict())
            for rank, state in enumerate(states):
                name = checkpoint.rank_file(rank)
                files[name] = checkpoint.save_tensors(message.folder / name, state)
        self.outbox.send(Saved(self.setup.local_rank, message.global_step, files))

    def _rank_state(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                 "pending": torch.tensor(self.averager.pending, dtype=torch.int64)}
        if self.averager.pending[1] or not self.averager.replicas_agree:  # replicas differ: keep this one's own
            state["model"] = self.model.state_dict()
        if self.averager.outer is not None:
            state["outer"] = self.averager.outer.state_dict()
        if self.averager.delayed is not None:
            state["delayed"] = self.averager.delayed.state_dict()
        return state

    def _restore(self, folder: Path) -> None:
        """Rank 0 reads the checkpoint and hands every replica the averaged model and its own state."""
        states = None
        if self.setup.rank == 0:
            self.model.load_state_dict(checkpoint.load_verified(folder / checkpoint.MODEL_FILE))
            states = [checkpoint.load_verified(folder / checkpoint.rank_file(rank))
                      for rank in range(self.setup.world_size)]
        _broadcast_initial_state(self.averager)
        state = _hand_out_from_rank0(states, self.setup.rank, self.setup.world_size)
        if "model" in state:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        self.averager.pending = tuple(state["pending"].tolist())
        if self.averager.outer is not None:
            self.averager.outer.load_state_dict(state["outer"])
        if self.averager.delayed is not None:
            self.averager.delayed.load_state_dict(state["delayed"])

    def finish(self, message: Finish) -> None:
        self.averager.settle()
        digest = self.averager.digest()
        if self.setup.rank == 0:
            checkpoint.save_tensors(message.model_path, self.model.state_dict())
        self.outbox.send(Finished(self.setup.local_rank, digest, self.first_wait_s or 0.0))


class DeviceLoader:
    """Copies a slot to the device and hands the slot back before any compute; normalizes on the device."""

    def __init__(self, ring: SlotRing, device: torch.device) -> None:
        self.ring = ring
        self.device = device
        shape = ring.images.shape[1:]
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
        self.inv_std = 1 / (torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255)
        # On CUDA the slot is copied into pinned memory so the host-to-device copy can run asynchronously.
        self.staging = torch.empty(shape, dtype=torch.uint8).pin_memory() if device.type == "cuda" else None

    def take(self, slot: int | None, outbox) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        if slot is None:
            return torch.empty(0), torch.empty(0, dtype=torch.int64), np.zeros(0, dtype=np.int64)
        count = int(self.ring.counts[slot])
        ids = self.ring.ids[slot, :count].copy()
        labels = torch.from_numpy(self.ring.labels[slot, :count].copy())
        pixels = self.ring.images[slot, :count]
        if self.staging is not None:
            host = self.staging[:count]
            np.copyto(host.numpy(), pixels)  # beat Tensor.copy_ in bench pipeline --transport
            outbox.send(SlotFree(slot))
            images = host.to(self.device, non_blocking=True).permute(0, 3, 1, 2).float()
            labels = labels.to(self.device, non_blocking=True)
        else:
            images = torch.from_numpy(pixels).permute(0, 3, 1, 2).float()  # the copy out of the slot, NCHW float
            outbox.send(SlotFree(slot))
        return images.sub_(self.mean).mul_(self.inv_std), labels, ids


def _next_message(ready, stop, watch: ParentWatch):
    while True:
        if stop.is_set() or watch.parent_gone():
            raise Stopped
        try:
            return ready.get(timeout=POLL_S)
        except queue.Empty:
            continue


# Replica states travel by broadcasts: after gloo's gather or all_gather of a few hundred KB, its threads kept
# the CPU busy and every later training step ran 2x slower on 2 cores (measured); broadcast leaves no such trace.

def _collect_on_rank0(mine: dict, rank: int, world: int) -> list[dict] | None:
    """Every replica's state, in rank order, on rank 0 (None elsewhere): one broadcast per rank."""
    collected = []
    for source in range(world):
        box = [mine if source == rank else None]
        dist.broadcast_object_list(box, src=source)
        if rank == 0:
            collected.append(box[0])
    return collected if rank == 0 else None


def _hand_out_from_rank0(states: list[dict] | None, rank: int, world: int) -> dict:
    """Rank 0's `states[r]` on rank r: one broadcast per rank."""
    mine = None
    for target in range(world):
        box = [states[target] if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if target == rank:
            mine = box[0]
    return mine


def _make_optimizer(model: torch.nn.Module, setup: ConsumerSetup) -> torch.optim.Optimizer:
    if setup.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=setup.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=setup.lr, momentum=setup.momentum,
                           weight_decay=setup.weight_decay)


def _join_group(setup: ConsumerSetup) -> None:
    timeout = timedelta(seconds=setup.collective_timeout_s)
    store = dist.TCPStore(setup.store_host, setup.store_port, setup.world_size, is_master=False, timeout=timeout)
    backend = "nccl" if setup.device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=store, rank=setup.rank, world_size=setup.world_size, timeout=timeout)


def _broadcast_initial_state(averager: Averager) -> None:
    """Every replica starts from rank 0's initialization."""
    for tensor in [*averager.float_buckets, *averager.int_tensors]:
        dist.broadcast(tensor, src=0)

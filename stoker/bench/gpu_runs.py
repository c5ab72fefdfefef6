"""The three measurements of `stoker bench gpu` (see `stoker.bench.gpu`): ceiling, stoker, DataLoader."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from stoker.bench.pipeline import TorchvisionStyleDataset
from stoker.common.devices import available_cores
from stoker.data.dataset import scan_image_folder
from stoker.pipeline.feed import MEAN, STD
from stoker.training import accel
from stoker.training.models import build_model

WARMUP_STEPS = 5  # cuDNN's algorithm search and the allocator settle in these


def measure(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for model in args.models.split(","):
        row = {"model": model, "ceiling": time_ceiling(model, args), "stoker": time_stoker(folder, model, args),
               "dataloader": time_dataloader(folder, model, args)}
        row["stoker_vs_ceiling"] = round(row["stoker"]["samples_per_s"] / row["ceiling"]["samples_per_s"], 3)
        row["stoker_vs_dataloader"] = round(row["stoker"]["samples_per_s"] / row["dataloader"]["samples_per_s"], 3)
        rows.append(row)
    return {"device": _device_name(args.device), "image_size": args.image_size, "batch_size": args.batch_size,
            "precision": args.precision, "channels_last": args.channels_last == "true", "workers": args.workers,
            "rows": rows}


class _Trainer:
    """What each measurement trains: the model on the device, in the precision and memory format asked for,
    SGD (fused on GPUs), input normalized on the device."""

    def __init__(self, model: str, args: argparse.Namespace, num_classes: int) -> None:
        self.device = torch.device(args.device)
        accel.configure_backends(deterministic=False)
        self.memory_format = torch.channels_last if args.channels_last == "true" else torch.contiguous_format
        self.model = build_model(model, num_classes).to(self.device).to(memory_format=self.memory_format)  # type: ignore[call-overload]  # stub omits memory_format
        self.precision = accel.MixedPrecision(args.precision, self.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9,
                                         **accel.fused_option(torch.optim.SGD, self.device))
        self.mean = torch.tensor(MEAN, device=self.device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(STD, device=self.device).view(1, 3, 1, 1) * 255

    def step(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One step on uint8 NCHW pixels already on the device; the loss stays there."""
        images = ((pixels.float() - self.mean) / self.std).contiguous(memory_format=self.memory_format)
        self.optimizer.zero_grad(set_to_none=True)
        with self.precision.autocast():
            loss = F.cross_entropy(self.model(images), labels)
        self.precision.backward_and_step(loss, self.optimizer)
        return loss.detach()

    def finish(self, loss: torch.Tensor) -> None:
        """Wait for the device to finish everything enqueued (reading the loss does)."""
        loss.item()


def time_ceiling(model: str, args: argparse.Namespace) -> dict[str, float]:
    trainer = _Trainer(model, args, num_classes=1)
    generator = torch.Generator().manual_seed(0)
    size = args.image_size
    pixels = torch.randint(0, 256, (args.batch_size, 3, size, size), dtype=torch.uint8, generator=generator)
    pixels, labels = pixels.to(trainer.device), torch.zeros(args.batch_size, dtype=torch.int64, device=trainer.device)
    for _ in range(WARMUP_STEPS):
        loss = trainer.step(pixels, labels)
    trainer.finish(loss)
    started = time.perf_counter()
    for _ in range(args.steps):
        loss = trainer.step(pixels, labels)
    trainer.finish(loss)
    wall = time.perf_counter() - started
    return {"samples_per_s": round(args.steps * args.batch_size / wall, 1), "input_stall": 0.0}


def time_stoker(folder: Path, model: str, args: argparse.Namespace) -> dict[str, Any]:
    import stoker

    devices = "cuda:0" if args.device == "cuda" else "cpu:1"
    with tempfile.TemporaryDirectory(prefix="stoker-bench-gpu-run-") as out:
        summary = stoker.train(data=folder, val_fraction=0.0, model=model, devices=devices, producers="auto",
                               max_producers=args.workers, initial_producers=args.workers,
                               batch_size=args.batch_size, image_size=args.image_size, epochs=args.epochs,
                               precision=args.precision, channels_last=args.channels_last == "true",
                               out=Path(out) / "run", report=False, show_progress=False)
        if summary["status"] != "completed":
            raise RuntimeError(f"stoker train {summary['status']}: {summary.get('error')}")
        figures = steady_figures(Path(out) / "run" / "metrics.jsonl")
    return {**figures, "producers_final": summary["producers_final"], "gpu_memory": summary.get("gpu_memory")}


def steady_figures(metrics: Path) -> dict[str, float]:
    """Samples/s and input stall after the first WARMUP_STEPS steps, as the ceiling and the DataLoader are timed,
    from the consumer's own step timings: on a GPU they are the device's timeline (compute, averaging, and the idle
    gap before each step), so their sum is the device's wall time for those steps."""
    steps = [record for record in map(json.loads, metrics.read_text().splitlines()) if record["event"] == "step"]
    timed = sorted(steps, key=lambda record: record["global_step"])[WARMUP_STEPS:]
    wall = sum(r["wait_s"] + r["compute_s"] + r["averaging_s"] for r in timed)
    if not timed or wall <= 0:
        raise RuntimeError(f"stoker ran {len(steps)} steps: too few to time after {WARMUP_STEPS} warm-up steps "
                           "(raise --images or --epochs)")
    return {"samples_per_s": round(sum(r["samples"] for r in timed) / wall, 1),
            "input_stall": round(sum(r["wait_s"] for r in timed) / wall, 4)}


def time_dataloader(folder: Path, model: str, args: argparse.Namespace) -> dict[str, float]:
    from torch.utils.data import DataLoader, Dataset

    index = scan_image_folder(folder)
    trainer = _Trainer(model, args, num_classes=len(index.classes))
    dataset = TorchvisionStyleDataset(index.paths, index.labels, args.image_size, to_float=False)
    # DataLoader reads any object with __getitem__ and __len__; the stub asks for a Dataset
    loader: DataLoader[Any] = DataLoader(cast("Dataset[Any]", dataset), batch_size=args.batch_size, shuffle=True,
                                         num_workers=args.workers, pin_memory=args.device == "cuda",
                                         persistent_workers=True, drop_last=True)
    batches = _forever(loader)
    try:
        for _ in range(WARMUP_STEPS):
            loss = trainer.step(*_to_device(next(batches), trainer.device))
        trainer.finish(loss)
        waited, started = 0.0, time.perf_counter()
        for _ in range(args.steps):
            asked = time.perf_counter()
            batch = next(batches)
            waited += time.perf_counter() - asked
            loss = trainer.step(*_to_device(batch, trainer.device))
        trainer.finish(loss)
        wall = time.perf_counter() - started
    finally:
        batches.close()
        del loader  # persistent workers end with their loader
    return {"samples_per_s": round(args.steps * args.batch_size / wall, 1), "input_stall": round(waited / wall, 4)}


def _forever(loader) -> Generator:
    while True:
        yield from loader


def _to_device(batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    pixels, labels = batch
    return pixels.to(device, non_blocking=True), labels.to(device, non_blocking=True)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else f"cpu ({available_cores()} cores)"

"""`stoker bench sync --train`: real training, stoker against DistributedDataParallel at equal N = 2.

Data: scikit-learn's handwritten digits written as 32x32 PNG files (ImageFolder, a fifth held out). stoker runs
`stoker train` with default settings on 2 CPU consumers, averaging during backward (the default) and, for
reference, after the optimizer's step. DDP trains the same model from the same initialization with the same
optimizer, schedule, batch per rank and 2 ranks, one thread per rank as stoker's consumers have on 2 cores, and
does what stoker does at each epoch's end as PyTorch's ImageNet example does: a validation pass and a checkpoint.
It is fed twice: by a DataLoader reading the same files with stoker's own decoder (`load_into`: the same pixels
and the same work per image as stoker's producers; its best worker count and bucket size, see DDP_FEEDS) and from
the images decoded once into memory (no input cost at all: the bound). Samples per second over the second half of
each run's steps, all ranks, each step credited the samples it trained; repeats interleaved, medians and the spread."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image

from stoker.bench.autoscale import steady_rate
from stoker.bench.group import run_group
from stoker.bench.runs import completed_run
from stoker.data.index import read_file
from stoker.data.pixels.imaging import load_into

WORLD = 2
STOKER_RUNS = {"stoker": True, "stoker_after_step": False}  # name: average_in_backward
# name: (feed, DataLoader workers per rank, gradient bucket MB): DDP at its best here. The rank's own thread decodes
# fastest (medians of 3, samples/s with 0, 1 and 2 workers per rank: 2,449, 2,287, 2,217). The model's 0.38 MB fit
# DDP's default first bucket whole, so its all_reduce could not start before backward ended; 0.25 MB buckets, the
# size of stoker's groups, let it overlap (medians of 4: 2,452 with the default, 2,648 at 0.1 MB, 2,708 at 0.25).
DDP_FEEDS = {"ddp_loader": ("loader", 0, 0.25), "ddp_memory": ("memory", 0, 0.25)}
MODEL = "stoker.bench.sync:small_cnn"
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 5e-4  # stoker's defaults
MEAN = torch.tensor((0.485, 0.456, 0.406)).view(1, 3, 1, 1) * 255
STD = torch.tensor((0.229, 0.224, 0.225)).view(1, 3, 1, 1) * 255


def run_training(args: argparse.Namespace) -> int:
    import stoker

    runs: dict[str, list[float]] = {name: [] for name in (*STOKER_RUNS, *DDP_FEEDS)}
    averaging: dict[str, list[float]] = {name: [] for name in STOKER_RUNS}
    accuracy: dict[str, list[float]] = {name: [] for name in ("stoker", *DDP_FEEDS)}
    with tempfile.TemporaryDirectory(prefix="stoker-bench-") as scratch:
        root = Path(scratch)
        train, val = write_digits(root / "digits")
        variants = [*STOKER_RUNS, *DDP_FEEDS]
        for repeat in range(args.repeats):
            # Interleaved, each repeat starting one variant later: drift in the machine's speed and any cost of
            # following another run hit every variant alike.
            for name in variants[repeat % len(variants):] + variants[:repeat % len(variants)]:
                folder = root / f"{name}-{repeat}"
                if name in STOKER_RUNS:
                    summary = stoker.train(data=train, val=val, devices=f"cpu:{WORLD}", model=MODEL, augment="none",
                                           image_size=32, batch_size=args.batch_size, epochs=args.epochs, seed=0,
                                           average_in_backward=STOKER_RUNS[name], out=folder, show_progress=False,
                                           report=False)
                    completed_run(summary, name)
                    runs[name].append(steady_rate(folder))
                    averaging[name].append(statistics.mean(summary["averaging_fraction"]))
                    if name == "stoker":
                        accuracy[name].append(summary["val_accuracy"])
                    continue
                folder.mkdir()
                rate, val_accuracy = run_group(_ddp_train, WORLD, (str(train), str(val), str(folder),
                                                                   args.batch_size, args.epochs, *DDP_FEEDS[name]),
                                               timeout_s=600)
                runs[name].append(rate)
                accuracy[name].append(val_accuracy)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    result = {"model": MODEL, "consumers": WORLD, "batch_size": args.batch_size, "epochs": args.epochs,
              "repeats": args.repeats, "ddp_settings": {name: dict(zip(("feed", "workers", "bucket_mb"), value))
                                 for name, value in DDP_FEEDS.items()}, "samples_per_s": medians,
              "all_runs": runs, "averaging_fraction": {k: statistics.median(v) for k, v in averaging.items()},
              "val_accuracy": {k: statistics.median(v) for k, v in accuracy.items()},
              # Repeat i of every variant ran in one block: its ratios are paired, and their spread is the noise.
              "paired_ratios": {baseline: [round(a / b, 3) for a, b in zip(runs["stoker"], runs[baseline])]
                                for baseline in DDP_FEEDS},
              "stoker_over_ddp_loader": round(medians["stoker"] / medians["ddp_loader"], 3),
              "stoker_over_ddp_memory": round(medians["stoker"] / medians["ddp_memory"], 3),
              "after_step_over_ddp_loader": round(medians["stoker_after_step"] / medians["ddp_loader"], 3)}
    print_training(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def write_digits(folder: Path) -> tuple[Path, Path]:
    """scikit-learn's digits as 32x32 grayscale PNGs in ImageFolder layout: (train, val)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    order = np.random.default_rng(0).permutation(len(bunch.target))
    for position, index in enumerate(order):
        split = "val" if position < len(order) // 5 else "train"
        pixels = (bunch.images[index] * (255 / 16)).round().astype(np.uint8)
        target = folder / split / str(bunch.target[index])
        target.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels, mode="L").resize((32, 32), Image.Resampling.NEAREST).save(target / f"{index:04d}.png")
    return folder / "train", folder / "val"


def _ddp_train(rank: int, world: int, train: str, val: str, folder: str, batch_size: int, epochs: int,
               feed: str, workers: int, bucket_mb: float) -> tuple[float, float]:
    """One rank of the DDP run, written as PyTorch's ImageNet example trains: DistributedSampler, every epoch a
    validation pass over this rank's part of the validation set and a checkpoint written by rank 0.
    Returns (samples/s over the second half of the steps, validation accuracy at the end)."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data.distributed import DistributedSampler

    from stoker.data.formats.folders import scan_image_folder
    from stoker.training.models import build_model

    train_index = scan_image_folder(Path(train))
    val_index = scan_image_folder(Path(val), train_index.classes)
    train_files = _Files(train_index)
    sampler: DistributedSampler = DistributedSampler(train_files, world, rank, shuffle=True, seed=0, drop_last=True)
    bounds = np.linspace(0, len(val_index.labels), world + 1).round().astype(int)
    train_batches = _Batches(train_files, sampler, batch_size, feed, workers)
    val_batches = _Batches(_Files(val_index), range(bounds[rank], bounds[rank + 1]), batch_size, feed, workers)
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model(MODEL, len(train_index.classes)), bucket_cap_mb=bucket_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    total = len(train_batches) * epochs
    stamps: list[tuple[float, int]] = []  # (when a step ended, the samples every rank trained in it)
    step, accuracy = 0, 0.0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        for images, labels in train_batches:
            for group in optimizer.param_groups:
                group["lr"] = LR * 0.5 * (1 + math.cos(math.pi * step / total))
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(_normalized(images)), labels).backward()
            optimizer.step()
            step += 1
            stamps.append((time.perf_counter(), len(labels) * world))  # each epoch ends with a short batch
        accuracy = _validate(model, val_batches)
        if rank == 0:
            torch.save({"epoch": epoch + 1, "model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                       Path(folder) / "checkpoint.pt")
    dist.barrier()
    late = stamps[len(stamps) // 2:]  # as `steady_rate` counts stoker's: the samples after the first stamp
    return round(sum(samples for _, samples in late[1:]) / (late[-1][0] - late[0][0]), 2), accuracy


class _Files(torch.utils.data.Dataset):
    """The image files decoded as stoker's producers decode them (`load_into`, augment "none"): the same pixels
    and the same work per image, normalized on the rank as stoker's consumers normalize."""

    def __init__(self, index, image_size: int = 32) -> None:
        self.paths, self.labels, self.image_size = index.paths, index.labels, image_size

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, sample: int) -> tuple[torch.Tensor, int]:
        image = np.empty((self.image_size, self.image_size, 3), np.uint8)
        load_into(read_file(self.paths[sample]), image, "none", None)
        return torch.from_numpy(image), int(self.labels[sample])


class _Batches:
    """Batches of `files` in the order of `order` (a sampler or a range), each epoch: from a DataLoader ("loader";
    with workers, persistent and prefetching), or from images decoded once into memory ("memory", no input cost
    at all)."""

    def __init__(self, files: _Files, order, batch_size: int, feed: str, workers: int) -> None:
        self.order, self.batch_size = order, batch_size
        if feed == "loader":
            background: dict[str, Any] = {"persistent_workers": True, "prefetch_factor": 4} if workers else {}
            self.loader: torch.utils.data.DataLoader | None = torch.utils.data.DataLoader(
                files, batch_size, sampler=order, num_workers=workers, **background)
        else:
            self.loader = None
            decoded = [files[sample] for sample in range(len(files))]
            self.images = torch.stack([image for image, _ in decoded])
            self.labels = torch.as_tensor([label for _, label in decoded], dtype=torch.int64)

    def __len__(self) -> int:
        return math.ceil(len(self.order) / self.batch_size)

    def __iter__(self):
        if self.loader is not None:
            yield from self.loader
            return
        order = torch.as_tensor(list(self.order), dtype=torch.int64)
        for chosen in order.split(self.batch_size):
            yield self.images[chosen], self.labels[chosen]


def _normalized(images: torch.Tensor) -> torch.Tensor:
    return (images.permute(0, 3, 1, 2).float() - MEAN) / STD


def _validate(model: torch.nn.Module, batches: _Batches) -> float:
    """Accuracy over every rank's part of the validation set."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for images, labels in batches:
            totals += torch.tensor([(model(_normalized(images)).argmax(1) == labels).sum().item(), len(labels)])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def print_training(result: dict[str, Any]) -> None:
    rates, shares, accuracy = result["samples_per_s"], result["averaging_fraction"], result["val_accuracy"]
    print(f"real training: {result['model']}, {result['consumers']} CPU consumers / ranks, batch "
          f"{result['batch_size']}, {result['epochs']} epochs, median of {result['repeats']}")
    print(f"  stoker, averaging during backward (default)  {rates['stoker']:9.1f} samples/s   averaging "
          f"{shares['stoker']:.1%} of the time, val accuracy {accuracy['stoker']:.1%}")
    print(f"  stoker, averaging after the step            {rates['stoker_after_step']:9.1f} samples/s   averaging "
          f"{shares['stoker_after_step']:.1%} of the time")
    print(f"  DDP, DataLoader on the same files            {rates['ddp_loader']:9.1f} samples/s   val accuracy "
          f"{accuracy['ddp_loader']:.1%}")
    print(f"  DDP, images decoded once into memory         {rates['ddp_memory']:9.1f} samples/s   val accuracy "
          f"{accuracy['ddp_memory']:.1%}")
    paired = {name: f"{min(values):.2f}-{max(values):.2f}" for name, values in result["paired_ratios"].items()}
    print(f"  stoker / DDP with a DataLoader: {result['stoker_over_ddp_loader']:.3f} (repeat by repeat "
          f"{paired['ddp_loader']}; after the step: {result['after_step_over_ddp_loader']:.3f}); stoker / DDP from "
          f"memory: {result['stoker_over_ddp_memory']:.3f} (repeat by repeat {paired['ddp_memory']})")

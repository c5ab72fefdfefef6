"""`stoker bench sync --train`: real training, stoker against DistributedDataParallel at equal N = 2.

Data: scikit-learn's handwritten digits written as 32x32 PNG files (ImageFolder, a fifth held out). stoker runs
`stoker train` with default settings on 2 CPU consumers, averaging during backward (the default) and, for
reference, after the optimizer's step. DDP trains the same model from the same initialization with the same
optimizer, schedule, batch per rank and 2 ranks on the same images, decoded once into memory, with one thread per
rank as stoker's consumers have on 2 cores. Samples per second over the second half of each run's steps, all
ranks; repeats interleaved, medians.
"""

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

WORLD = 2
MODEL = "stoker.bench.sync:small_cnn"
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 5e-4  # stoker's defaults
MEAN = torch.tensor((0.485, 0.456, 0.406)).view(1, 3, 1, 1) * 255
STD = torch.tensor((0.229, 0.224, 0.225)).view(1, 3, 1, 1) * 255


def run_training(args: argparse.Namespace) -> int:
    import stoker

    runs: dict[str, list[float]] = {"stoker": [], "stoker_after_step": [], "ddp": []}
    averaging: dict[str, list[float]] = {"stoker": [], "stoker_after_step": []}
    accuracy: list[float] = []
    with tempfile.TemporaryDirectory(prefix="stoker-bench-") as scratch:
        root = Path(scratch)
        train, val = write_digits(root / "digits")
        for repeat in range(args.repeats):  # interleaved: drift in the machine's speed hits all three alike
            for name, in_backward in (("stoker", True), ("stoker_after_step", False)):
                out = root / f"{name}-{repeat}"
                summary = stoker.train(data=train, val=val, devices=f"cpu:{WORLD}", model=MODEL, augment="none",
                                       image_size=32, batch_size=args.batch_size, epochs=args.epochs, seed=0,
                                       average_in_backward=in_backward, out=out, show_progress=False, report=False)
                if summary["status"] != "completed":
                    raise RuntimeError(f"{name}: {summary.get('error')}")
                runs[name].append(steady_rate(out))
                averaging[name].append(statistics.mean(summary["averaging_fraction"]))
                if in_backward:
                    accuracy.append(summary["val_accuracy"])
            runs["ddp"].append(run_group(_ddp_train, WORLD, (str(train), args.batch_size, args.epochs),
                                         timeout_s=600))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    result = {"model": MODEL, "consumers": WORLD, "batch_size": args.batch_size, "epochs": args.epochs,
              "repeats": args.repeats, "samples_per_s": medians, "all_runs": runs,
              "averaging_fraction": {k: statistics.median(v) for k, v in averaging.items()},
              "stoker_val_accuracy": statistics.median(accuracy),
              "stoker_over_ddp": round(medians["stoker"] / medians["ddp"], 3),
              "after_step_over_ddp": round(medians["stoker_after_step"] / medians["ddp"], 3)}
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
        Image.fromarray(pixels, mode="L").resize((32, 32), Image.NEAREST).save(target / f"{index:04d}.png")
    return folder / "train", folder / "val"


def _ddp_train(rank: int, world: int, train: str, batch_size: int, epochs: int) -> float:
    from torch.nn.parallel import DistributedDataParallel

    from stoker.dataset import scan_image_folder
    from stoker.models import build_model

    index = scan_image_folder(Path(train))
    images = torch.stack([torch.from_numpy(np.array(Image.open(p).convert("RGB"))) for p in index.paths])
    labels = torch.as_tensor(np.asarray(index.labels), dtype=torch.int64)
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model(MODEL, len(index.classes)))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    steps_per_epoch = len(labels) // (batch_size * world)
    total = steps_per_epoch * epochs
    stamps, step = [], 0
    for epoch in range(epochs):
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
        for position in range(steps_per_epoch):
            chosen = order[(position * world + rank) * batch_size:(position * world + rank + 1) * batch_size]
            batch = (images[chosen].permute(0, 3, 1, 2).float() - MEAN) / STD
            for group in optimizer.param_groups:
                group["lr"] = LR * 0.5 * (1 + math.cos(math.pi * step / total))
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(batch), labels[chosen]).backward()
            optimizer.step()
            step += 1
            stamps.append(time.perf_counter())
    dist.barrier()
    late = stamps[len(stamps) // 2:]
    return round((len(late) - 1) * batch_size * world / (late[-1] - late[0]), 2)


def print_training(result: dict[str, Any]) -> None:
    rates, shares = result["samples_per_s"], result["averaging_fraction"]
    print(f"real training: {result['model']}, {result['consumers']} CPU consumers / ranks, batch "
          f"{result['batch_size']}, {result['epochs']} epochs, median of {result['repeats']}")
    print(f"  stoker, averaging during backward (default)  {rates['stoker']:9.1f} samples/s   averaging "
          f"{shares['stoker']:.1%} of the time")
    print(f"  stoker, averaging after the step            {rates['stoker_after_step']:9.1f} samples/s   averaging "
          f"{shares['stoker_after_step']:.1%} of the time")
    print(f"  DistributedDataParallel                     {rates['ddp']:9.1f} samples/s")
    print(f"  stoker / DDP: {result['stoker_over_ddp']:.3f} (after the step: {result['after_step_over_ddp']:.3f}); "
          f"stoker's val accuracy {result['stoker_val_accuracy']:.1%}")

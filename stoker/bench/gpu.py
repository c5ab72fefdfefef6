"""`stoker bench gpu`: the first measurement on a GPU, in one command.

It writes ImageNet-like JPEGs (500x375, quality 90, as `bench pipeline --generate`), then for each model, at one
resolution and precision, on one device:
  ceiling     stoker's own training step (the consumer's flat-bucket model, memory format, normalization, precision
              and fused SGD) on one batch resident on the device: no input at all, the most the device can do
  stoker      `stoker train` with producers on every core but the consumer's (--producers auto), one consumer,
              timed over its first epoch after 5 warm-up steps (no checkpoint inside the window)
  dataloader  torch's DataLoader at its steady state (a sampler spanning the whole measurement: no epoch refill in
              it), pin_memory=True, non-blocking copies, persistent workers, as many worker processes as stoker's
              producers, normalization on the device as stoker does; once with the Pillow recipe (decode,
              RandomResizedCrop, flip) and once with stoker's own decoder, so the ratio separates pipeline design
              from decoder speed
All are timed with the same device events (the consumer's StepClock: input stall is the device's idle time while
the loop was blocked for its batch), each run in a process of its own (GPU memory given back between runs), in
--repeats interleaved repeats; the table shows medians. `--device cpu` with tiny sizes runs the same code on a
machine without a GPU (the test suite does).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stoker.common.devices import available_cores

SET = "500x375"  # about ImageNet's average picture


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("gpu", help="stoker against the device's ceiling and torch's DataLoader, one GPU")
    parser.add_argument("--device", default="auto", help="cuda | cpu | auto (cuda where there is one)")
    parser.add_argument("--models", default="resnet50,resnet18", help="comma-separated built-in models")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--channels-last", choices=["true", "false"], default="true")
    parser.add_argument("--images", type=int, default=12800,
                        help="JPEGs to generate: stoker is timed over one epoch of them, after 5 warm-up steps")
    parser.add_argument("--steps", type=int, default=40, help="timed steps for the ceiling and the DataLoader")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every run (medians shown)")
    parser.add_argument("--workers", type=int, default=max(1, available_cores() - 1),
                        help="stoker's producers at most = DataLoader workers (default: every core but one)")
    parser.add_argument("--data", type=Path, help="a folder written by `bench pipeline --generate` (skip writing)")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from stoker.bench.gpu_runs import measure  # torch: here, so that `stoker bench --help` does not wait for it
    from stoker.bench.pipeline import generate, photographs_available
    from stoker.common.devices import check_torch_sees_the_gpus

    try:  # what would fail late or mislead, before any image is written
        if args.device != "cpu":
            check_torch_sees_the_gpus()  # not ResNet-50 on the CPU for hours
        if args.data is None:
            photographs_available()
    except ValueError as error:
        print(f"stoker: error: {error}", file=sys.stderr)
        return 2
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.data is not None:
        return _report(measure(args.data / SET, args), args)
    with tempfile.TemporaryDirectory(prefix="stoker-bench-gpu-") as scratch:
        started = time.perf_counter()
        generate(Path(scratch), args.images, 0)
        print(f"wrote {args.images} JPEGs in {time.perf_counter() - started:.0f} s")
        return _report(measure(Path(scratch) / SET, args), args)


def _report(result: dict[str, Any], args: argparse.Namespace) -> int:
    print(f"{result['device']}, {result['image_size']} px, batch {result['batch_size']}, {result['precision']}, "
          f"channels_last={result['channels_last']}, {result['workers']} workers/producers")
    print(f"medians of {result['repeats']} interleaved repeats, each run in its own process")
    print(f"{'model':10} {'ceiling/s':>10} {'stoker/s':>10} {'stall':>6} {'DL Pillow/s':>12} {'stall':>6} "
          f"{'DL stoker-dec/s':>16} {'stall':>6} {'stoker/ceiling':>15} {'stoker/DL':>10} {'same decoder':>13}")
    for row in result["rows"]:
        pillow, same = row["dataloader_pillow"], row["dataloader_stoker_decoder"]
        print(f"{row['model']:10} {row['ceiling']['samples_per_s']:>10.1f} {row['stoker']['samples_per_s']:>10.1f} "
              f"{row['stoker']['input_stall']:>6.1%} {pillow['samples_per_s']:>12.1f} {pillow['input_stall']:>6.1%} "
              f"{same['samples_per_s']:>16.1f} {same['input_stall']:>6.1%} {row['stoker_vs_ceiling']:>15.2f} "
              f"{row['stoker_vs_dataloader']:>10.2f} {row['stoker_vs_dataloader_same_decoder']:>13.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0

"""`stoker bench gpu`: the first measurement on a GPU, in one command.

It writes ImageNet-like JPEGs (500x375, quality 90, as `bench pipeline --generate`), then for each model, at one
resolution and precision, on one device:
  ceiling     stoker's own training step (the consumer's flat-bucket model, memory format, normalization, precision
              and fused SGD) on one batch resident on the device: no input at all, the most the device can do
  stoker      `stoker train` with producers on every core but the consumer's (--producers auto), one consumer,
              timed inside its first epoch (no checkpoint inside the window)
  dataloader  torch's DataLoader at its steady state (a sampler spanning the whole measurement: no epoch refill in
              it), pin_memory=True, non-blocking copies, persistent workers, as many worker processes as stoker's
              producers, normalization on the device as stoker does; once with the Pillow recipe (decode,
              RandomResizedCrop, flip) and once with stoker's own decoder, so the ratio separates pipeline design
              from decoder speed
Every system with input is timed from its steady state: after 5 warm-up steps it keeps stepping until one step's
`next()` blocks (its wait for the batch is over 5% of a warm-up step and over 1 ms: whatever was queued before the
clock started is gone), at most 4 x workers steps, then --steps steps are timed; the figures say how many steps
were skipped. All are timed with the same device events (the consumer's StepClock: input stall is the device's
idle time while the loop was blocked for its batch; host, its idle time for the host), each run in a process of
its own (GPU memory given back between runs), in --repeats interleaved repeats; the table shows medians.
`--device cpu` with tiny sizes runs the same code on a machine without a GPU (the test suite does).
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
RUN_KINDS = ("ceiling", "stoker", "dataloader_pillow", "dataloader_stoker_decoder")  # gpu_runs.KINDS, without torch


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("gpu", help="stoker against the device's ceiling and torch's DataLoader, one GPU")
    parser.add_argument("--device", default="auto", help="cuda | cpu | auto (cuda where there is one)")
    parser.add_argument("--models", default="resnet50,resnet18", help="comma-separated built-in models")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--channels-last", choices=["true", "false"], default="true")
    parser.add_argument("--images", type=int,
                        help="JPEGs to generate (default: enough for stoker's first epoch to hold the warm-up, the "
                             "most steps skipped and --steps timed steps)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps of every run (its steady-state window)")
    parser.add_argument("--steps-ahead", type=int, default=3, choices=range(1, 9), metavar="N",
                        help="steps the host may run ahead of the GPU, in stoker and in the other runs' step "
                             "(stoker's --steps-ahead; the first GPU runs compare 2 and 3)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every run (medians shown)")
    parser.add_argument("--workers", type=int, default=max(1, available_cores() - 1),
                        help="stoker's producers at most = DataLoader workers (default: every core but one)")
    parser.add_argument("--data", type=Path, help="a folder written by `bench pipeline --generate` or by an earlier "
                        "--data run (skip writing); where it holds no images yet, the JPEGs are written there and kept")
    parser.add_argument("--runs", default=",".join(RUN_KINDS),
                        help="comma-separated runs to measure (default: all of them)")
    parser.add_argument("--json", type=Path,
                        help="write the figures to this file (rewritten as each run ends, every run so far under "
                             "'runs')")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from stoker.bench.gpu_runs import measure  # torch: here, so that `stoker bench --help` does not wait for it
    from stoker.bench.photos import photographs_available
    from stoker.common.devices import check_torch_sees_the_gpus

    try:  # what would fail late or mislead, before any image is written
        kinds = _kinds(args.runs)
        if args.device != "cpu":
            check_torch_sees_the_gpus()  # not ResNet-50 on the CPU for hours
        if args.data is None:
            photographs_available()
    except ValueError as error:
        print(f"stoker: error: {error}", file=sys.stderr)
        return 2
    skipped = _runs_shm_cannot_hold(args, kinds)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.images is None:
        from stoker.bench.gpu_runs import images_needed

        args.images = images_needed(args)
    if args.data is not None:
        if not (args.data / SET).is_dir():
            _write(args.data, args.images)
        return _report(measure(args.data / SET, args, kinds, skipped, lambda result: _save(result, args)), args)
    with tempfile.TemporaryDirectory(prefix="stoker-bench-gpu-") as scratch:
        _write(Path(scratch), args.images)
        return _report(measure(Path(scratch) / SET, args, kinds, skipped, lambda result: _save(result, args)), args)


def _write(folder: Path, images: int) -> None:
    """The JPEGs, written in a process per core."""
    from stoker.bench.pipeline import generate

    started = time.perf_counter()
    generate(folder, images, 0, processes=available_cores())
    print(f"wrote {images} JPEGs in {time.perf_counter() - started:.0f} s", flush=True)


def _kinds(runs: str) -> tuple[str, ...]:
    kinds = tuple(kind.strip() for kind in runs.split(",") if kind.strip())
    unknown = [kind for kind in kinds if kind not in RUN_KINDS]
    if unknown or not kinds:
        raise ValueError(f"--runs {runs!r}: expected a comma-separated choice of {', '.join(RUN_KINDS)}")
    return kinds


def _runs_shm_cannot_hold(args: argparse.Namespace, kinds: tuple[str, ...]) -> dict[str, str]:
    """Said first: a /dev/shm too small for stoker's ring (Docker's default 64 MB holds no ring at batch 128,
    224 px) skips the stoker run, with the size needed and the fix; the other runs are still measured."""
    from stoker.common.config import FeedSettings
    from stoker.pipeline.engine import check_ring_space

    if "stoker" not in kinds:
        return {}
    try:
        check_ring_space(FeedSettings().slots_per_consumer, args.batch_size, args.image_size, args.workers)
    except ValueError as error:
        print(f"stoker: warning: {error}. The stoker run is skipped; the others are measured.", file=sys.stderr,
              flush=True)
        return {"stoker": f"skipped: {error}"}
    return {}


def _save(result: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def _report(result: dict[str, Any], args: argparse.Namespace) -> int:
    """The table of medians; exit status 1 when a run failed (its cells read 'failed', its error is below)."""
    print(f"{result['device']}, {result['image_size']} px, batch {result['batch_size']}, {result['precision']}, "
          f"channels_last={result['channels_last']}, {result['workers']} workers/producers, "
          f"{result['steps_ahead']} steps ahead")
    print(f"medians of {result['repeats']} interleaved repeats, each run in its own process, {result['steps']} timed "
          f"steps from the steady state (skip: steps skipped to reach it; host: the device's idle share for the host)")
    print(f"{'model':10} {'ceiling/s':>10} {'stoker/s':>10} {'stall':>6} {'host':>6} {'skip':>5} {'DL Pillow/s':>12} "
          f"{'stall':>6} {'host':>6} {'skip':>5} {'DL stoker-dec/s':>16} {'stall':>6} {'skip':>5} "
          f"{'stoker/ceiling':>15} {'stoker/DL':>10} {'same decoder':>13}")
    for row in result["rows"]:
        ceiling, stoker, pillow, same = (row.get(kind, {}) for kind in RUN_KINDS)
        print(f"{row['model']:10} {_rate(ceiling):>10} {_rate(stoker):>10} {_share(stoker, 'input_stall'):>6} "
              f"{_share(stoker, 'host'):>6} {_skip(stoker):>5} {_rate(pillow):>12} {_share(pillow, 'input_stall'):>6} "
              f"{_share(pillow, 'host'):>6} {_skip(pillow):>5} {_rate(same):>16} {_share(same, 'input_stall'):>6} "
              f"{_skip(same):>5} {_times(row['stoker_vs_ceiling']):>15} {_times(row['stoker_vs_dataloader']):>10} "
              f"{_times(row['stoker_vs_dataloader_same_decoder']):>13}")
    failed = [run for run in result["runs"] if "error" in run]
    for run in failed:
        print(f"{run['model']} {run['kind']} (repeat {run['repeat']}) failed: {run['error']}")
    _save(result, args)
    return 1 if failed else 0


def _rate(figures: dict[str, Any]) -> str:
    return "-" if not figures else "failed" if "error" in figures else f"{figures['samples_per_s']:.1f}"


def _share(figures: dict[str, Any], name: str) -> str:
    return "-" if not figures or "error" in figures or name not in figures else f"{figures[name]:.1%}"


def _skip(figures: dict[str, Any]) -> str:
    return "-" if not figures or "error" in figures or "skipped_steps" not in figures \
        else str(figures["skipped_steps"])


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"

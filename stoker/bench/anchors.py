"""`stoker bench anchors`: stoker beside DALI's CPU pipeline, FFCV and torch's DataLoader, same files, same work.

Every feed makes uint8 batches of RandomResizedCrop(224, scale 0.08-1, ratio 3/4-4/3) + random horizontal flip from
the same JPEGs, with 2 workers, and this benchmark's consumer only takes the batches (no model: the input is the
limit). Feeds, each in its own process started afresh for every run:
  stoker             stoker's producers into its shared-memory ring, the batch copied out as a GPU consumer does
  stoker_packed      the same over the folder packed by `stoker pack` (its defaults: the same pixels, each JPEG
                     with a restart marker after every MCU, so that a crop entropy-decodes only its own MCUs)
  dataloader_pillow  DataLoader, torchvision's recipe written with Pillow (bench pipeline's TorchvisionStyleDataset)
  dataloader_stoker  DataLoader whose workers decode with stoker's own `load_into` (bench loader's dataset)
  dali               NVIDIA DALI's CPU pipeline (device_id=None): readers.file, decoders.image_random_crop (decodes
                     only the region the crop covers), resize, flip; num_threads = workers
  ffcv               FFCV's Loader over a .beton holding the same JPEG bytes: RandomResizedCropRGBImageDecoder (whole
                     decode, OpenCV crop and resize) + RandomHorizontalFlip; num_workers = workers
  ffcv_raw50         the same with half the images stored as raw pixels (FFCV's `proportion` write mode)
DALI and FFCV are not stoker's dependencies: where one cannot be imported its rows say why. Runs alternate (each
repeat starts one feed later) and medians are reported, with the CPU seconds per image of the feed's whole process
tree (the consumer, its threads, its workers or producers) over the timed batches beside images/s.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stoker.bench.loader import tree_cpu_s
from stoker.bench.runs import run_child

FEEDS = ("stoker", "stoker_packed", "dataloader_pillow", "dataloader_stoker", "dali", "ffcv", "ffcv_raw50")
NEEDS = {"dali": "nvidia.dali", "ffcv": "ffcv", "ffcv_raw50": "ffcv"}
INSTALL = {"dali": "pip install nvidia-dali-cuda120",
           "ffcv": "pip install ffcv==1.0.2 (builds with Debian's pkg-config libopencv-dev libturbojpeg0-dev)"}
RUN_TIMEOUT_S = 600  # a run's limit, and 20 ms more for each image its warm-up epochs decode (50 images/s)
WARMUP_S_PER_IMAGE = 0.02


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("anchors", help="stoker beside DALI's CPU pipeline, FFCV and DataLoader, same files")
    parser.add_argument("--data", type=Path, metavar="DIR", help="an ImageFolder of JPEGs (default: generate "
                        "--images ImageNet-like JPEGs into a temporary folder)")
    parser.add_argument("--images", type=int, default=2000, help="ImageNet-like JPEGs to generate")
    parser.add_argument("--feeds", default=",".join(FEEDS), help="comma-separated, of " + ", ".join(FEEDS))
    parser.add_argument("--workers", type=int, default=2, help="producers, DataLoader workers, DALI or FFCV threads")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--images-per-run", type=int, default=2048, help="images timed per run, after warm-up")
    parser.add_argument("--warmup-epochs", type=int, default=1, help="epochs each feed runs before it is timed "
                        "(default 1: a long run's steady state, files in the page cache and stoker's loaded marks "
                        "set; 0: a few batches, the first epoch timed)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, metavar="FILE")
    parser.add_argument("--feed", help=argparse.SUPPRESS)  # internal: one run of one feed
    parser.add_argument("--beton", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pack", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.feed:
        return run_feed(args)
    feeds = [f for f in args.feeds.split(",") if f]
    unknown = sorted(set(feeds) - set(FEEDS))
    if unknown:
        raise SystemExit(f"--feeds: unknown {', '.join(unknown)}; expected some of {', '.join(FEEDS)}")
    with tempfile.TemporaryDirectory(prefix="stoker-bench-anchors-") as scratch:
        folder = args.data or _generate(Path(scratch), args.images)
        result = measure(folder, Path(scratch), feeds, args)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _generate(scratch: Path, images: int) -> Path:
    from stoker.bench.photos import NAME, make_imagenet_like

    make_imagenet_like(scratch / NAME, images)
    return scratch / NAME


def unavailable(feed: str) -> str | None:
    """Why a feed cannot run here, or None."""
    module = NEEDS.get(feed)
    if module is None:
        return None
    try:
        found = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        found = None
    if found is None:
        return f"{module} is not installed ({INSTALL[feed.split('_')[0]]})"
    return None


def measure(folder: Path, scratch: Path, feeds: list[str], args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    skipped = {feed: why for feed in feeds if (why := unavailable(feed))}
    running = [feed for feed in feeds if feed not in skipped]
    copies = {feed: scratch / f"{feed}.beton" for feed in running if feed.startswith("ffcv")}  # each feed's own format
    copies.update({feed: scratch / "stoker-pack" for feed in running if feed == "stoker_packed"})
    images = _count(folder)
    limit_s = RUN_TIMEOUT_S + WARMUP_S_PER_IMAGE * args.warmup_epochs * images
    for feed, copy in copies.items():
        launch(folder, feed, args, copy, limit_s, write=True)
    runs: dict[str, list[dict[str, float]]] = {feed: [] for feed in running}
    for repeat in range(args.repeats):
        shift = repeat % max(1, len(running))
        for feed in running[shift:] + running[:shift]:  # alternating: drift in the machine hits every feed alike
            runs[feed].append(launch(folder, feed, args, copies.get(feed), limit_s))
            print(f"{feed}: {runs[feed][-1]}", file=sys.stderr)
    medians = {feed: {key: round(statistics.median(r[key] for r in rows), 3) for key in rows[0]}
               for feed, rows in runs.items()}
    return {"command": "stoker bench anchors " + " ".join(sys.argv[3:]), "cores": os.cpu_count(),
            "workers": args.workers, "batch_size": args.batch_size, "image_size": args.image_size,
            "images": images, "images_per_run": args.images_per_run, "repeats": args.repeats,
            "warmup_epochs": args.warmup_epochs,
            "medians": medians, "runs": runs, "unavailable": skipped, "load_average_before": load_before,
            "load_average_after": os.getloadavg()}


def _count(folder: Path) -> int:
    from stoker.data.formats.folders import scan_image_folder

    return len(scan_image_folder(folder).paths)


def launch(folder: Path, feed: str, args: argparse.Namespace, copy: Path | None, limit_s: float,
           write: bool = False) -> dict[str, float]:
    """One run of one feed in a fresh process, stopped after `limit_s`: {img_s, cpu_ms_per_image}; with write,
    the feed's own copy of the folder is written at `copy`: FFCV's .beton, or stoker's pack."""
    with tempfile.TemporaryDirectory(prefix="stoker-anchor-run-") as out:
        result = Path(out) / "result.json"
        command = [sys.executable, "-m", "stoker", "bench", "anchors", "--feed", feed, "--data", str(folder),
                   "--workers", str(args.workers), "--batch-size", str(args.batch_size), "--image-size",
                   str(args.image_size), "--images-per-run", str(args.images_per_run), "--result", str(result),
                   "--warmup-epochs", str(args.warmup_epochs),
                   *([_copy_flag(feed), str(copy)] if copy else []), *(["--images", "0"] if write else [])]
        completed = run_child(command, timeout_s=limit_s)
        if completed.returncode != 0:
            raise RuntimeError(f"bench anchors: {feed} exited {completed.returncode}: {completed.stderr[-3000:]}")
        return json.loads(result.read_text()) if not write else {}


def _copy_flag(feed: str) -> str:
    return "--pack" if feed == "stoker_packed" else "--beton"


def run_feed(args: argparse.Namespace) -> int:
    """In the feed's own process: warm up, then time --images-per-run images and this process tree's CPU."""
    from stoker.bench import anchor_feeds

    if args.images == 0:  # internal: write the feed's own copy only
        if args.feed == "stoker_packed":
            anchor_feeds.write_pack(args.data, args.pack)
        else:
            anchor_feeds.write_beton(args.data, args.beton, raw_half=args.feed == "ffcv_raw50")
        return 0
    batches = anchor_feeds.make(args)
    try:
        images, warmup = 0, anchor_feeds.warmup_images(args)
        while images < warmup:
            images += next(batches)
        images, cpu_before, started = 0, tree_cpu_s(), time.perf_counter()
        while images < args.images_per_run:
            images += next(batches)
        elapsed, cpu = time.perf_counter() - started, tree_cpu_s() - cpu_before
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
    args.result.write_text(json.dumps({"img_s": images / elapsed, "cpu_ms_per_image": 1000 * cpu / images}))
    return 0


def best_stoker(medians: dict[str, dict[str, float]]) -> dict[str, float] | None:
    """The row of stoker's faster configuration (the folder's files, or its pack), which the others are set against."""
    rows = [medians[feed] for feed in ("stoker", "stoker_packed") if feed in medians]
    return max(rows, key=lambda row: row["img_s"]) if rows else None


def print_table(result: dict[str, Any]) -> None:
    print(f"{result['images']} JPEGs, RandomResizedCrop {result['image_size']} + flip, {result['workers']} workers, "
          f"batch {result['batch_size']}, {result['images_per_run']} images per run after "
          f"{result.get('warmup_epochs', 0)} warm-up epoch(s), median of {result['repeats']}, "
          f"{result['cores']} cores; load average {result['load_average_before'][0]:.2f} before, "
          f"{result['load_average_after'][0]:.2f} after")
    medians = result["medians"]
    own = best_stoker(medians)
    print(f"  {'feed':18s} {'img/s':>8s} {'CPU ms/img':>11s} {'best stoker / this, img/s':>26s} "
          f"{'this / best stoker, CPU':>24s}")
    for feed, row in medians.items():
        rate = f"{own['img_s'] / row['img_s']:.2f}" if own else "-"
        cpu = f"{row['cpu_ms_per_image'] / own['cpu_ms_per_image']:.2f}" if own else "-"
        print(f"  {feed:18s} {row['img_s']:8.1f} {row['cpu_ms_per_image']:11.2f} {rate:>26s} {cpu:>24s}")
    for feed, why in result["unavailable"].items():
        print(f"  {feed:18s} not run: {why}")


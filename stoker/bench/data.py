"""`stoker bench data`: ImageNet-sized folders start in seconds; a producer's memory does not grow with the data.

For each size N, builds an ImageFolder of N files in 1000 classes by hard links to 64 real-photograph JPEGs at
500x375 (no disk space beyond the directory entries), then measures: the scan with no cache and from the cache,
`stoker train` from command start to its first training step (index cached, and with no cache), and at that step
the controller's RSS and each producer's USS and PSS (a mapped index is shared: RSS counts it in every process that
touches it, USS never, PSS by share). Then it packs --throughput-files images into shards and times the producers
reading the files against reading the same images from the shards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from stoker.bench.runs import stop_child
from stoker.common.procs import descendants
from stoker.data.index import load_image_folder

NUM_CLASSES = 1000
SOURCE_IMAGES = 64
FIRST_STEP_TIMEOUT_S = 300.0


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("data", help="scan, index cache, start-up time and memory at ImageNet scale; "
                              "files vs shards")
    parser.add_argument("--files", default="10000,100000,1281000", help="comma-separated folder sizes")
    parser.add_argument("--producers", type=int, default=2, help="producers of the training runs")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure (the median is shown)")
    parser.add_argument("--throughput-files", type=int, default=4000,
                        help="images of the files-vs-shards throughput comparison (each run decodes this many)")
    parser.add_argument("--scratch", type=Path, help="where to build the folders (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    sizes = [int(n) for n in args.files.split(",")]
    scratch = Path(tempfile.mkdtemp(prefix="stoker-data-", dir=args.scratch))
    try:
        sources = make_source_images(scratch / "sources")
        rows = [measure_size(scratch, sources, n, args) for n in sizes]
        throughput = measure_throughput(scratch, sources, args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print_table(rows, throughput)
    if args.json:
        args.json.write_text(json.dumps({"sizes": rows, "throughput": throughput}, indent=2) + "\n")
    return 0


def make_source_images(folder: Path) -> list[Path]:
    """A few real-photograph JPEGs at ImageNet's typical 500x375 for every file of the folders to link to."""
    from stoker.bench.pipeline import generate

    generate(folder, small=SOURCE_IMAGES, large=0)
    return sorted((folder / "500x375" / "photos").glob("*.jpg"))


def build_folder(root: Path, sources: list[Path], num_files: int) -> None:
    """num_files hard links in NUM_CLASSES class folders, named like ImageNet's files."""
    per_class = np.diff(np.linspace(0, num_files, NUM_CLASSES + 1).round().astype(int))
    made = 0
    for label, count in enumerate(per_class):
        folder = root / f"n{label:08d}"
        folder.mkdir(parents=True)
        for i in range(count):
            os.link(sources[(made + i) % len(sources)], folder / f"n{label:08d}_{i}.JPEG")
        made += count


def settle() -> None:
    """A folder changed within the cache's guard time is rescanned every time: wait it out, as a user's
    tree that was not written a moment ago."""
    from stoker.data.index import MTIME_GUARD_NS

    time.sleep(MTIME_GUARD_NS / 1e9 + 0.2)


def measure_size(scratch: Path, sources: list[Path], num_files: int, args: argparse.Namespace) -> dict[str, Any]:
    root = scratch / f"folder-{num_files}"
    started = time.perf_counter()
    build_folder(root, sources, num_files)
    build_s = time.perf_counter() - started
    settle()
    cold, cached = [], []
    for _ in range(args.repeats):
        cache = scratch / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        cold.append(_timed(lambda cache=cache: load_image_folder(root, cache=cache)))
        cached.append(_timed(lambda cache=cache: load_image_folder(root, cache=cache)))
    starts = [first_step(root, scratch, args, fresh_cache=False) for _ in range(args.repeats)]
    cold_start = first_step(root, scratch, args, fresh_cache=True)
    shutil.rmtree(root, ignore_errors=True)
    median = statistics.median
    return {"files": num_files, "build_s": round(build_s, 2), "scan_s": round(median(cold), 3),
            "from_cache_s": round(median(cached), 3),
            "first_step_s": round(median(s["first_step_s"] for s in starts), 2),
            "first_step_no_cache_s": cold_start["first_step_s"],
            "controller_rss_mb": round(median(s["controller_rss_mb"] for s in starts), 1),
            "producer_uss_mb": round(median(s["producer_uss_mb"] for s in starts), 1),
            "producer_pss_mb": round(median(s["producer_pss_mb"] for s in starts), 1),
            "producer_rss_mb": round(median(s["producer_rss_mb"] for s in starts), 1),
            "runs": {"scan_s": cold, "from_cache_s": cached, "first_step": starts}}


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def first_step(root: Path, scratch: Path, args: argparse.Namespace, fresh_cache: bool) -> dict[str, float]:
    """Start `stoker train`, wait for its first step in metrics.jsonl, read every process's memory, stop it."""
    cache, run_dir = scratch / "cache", scratch / "run"
    if fresh_cache:
        shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "stoker", "train", "--data", str(root), "--val-fraction", "0.01",
               "--image-size", "32", "--batch-size", "32", "--epochs", "1", "--devices", "cpu:1",
               "--producers", str(args.producers), "--out", str(run_dir), "--quiet", "--report", "false"]
    started = time.perf_counter()
    process = subprocess.Popen(command, env={**os.environ, "STOKER_CACHE": str(cache)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        elapsed = _wait_first_step(run_dir / "metrics.jsonl", process, started)
        memory = _family_memory(process.pid)
    except BaseException:
        stop_child(process)
        raise
    stop_child(process, group_signalled=False)  # measured: the run is stopped at once
    producers = [m for title, m in memory if title.startswith("stoker producer")]
    controller = next(m for title, m in memory if title.startswith("stoker controller"))
    return {"first_step_s": round(elapsed, 2), "controller_rss_mb": controller["Rss"],
            "producer_uss_mb": max(p["Uss"] for p in producers), "producer_pss_mb": max(p["Pss"] for p in producers),
            "producer_rss_mb": max(p["Rss"] for p in producers)}


def _wait_first_step(metrics: Path, process: subprocess.Popen, started: float) -> float:
    while time.perf_counter() - started < FIRST_STEP_TIMEOUT_S:
        if process.poll() is not None:
            assert process.stderr is not None, "started with stderr=PIPE"
            raise RuntimeError(f"stoker train exited {process.returncode}: {process.stderr.read()[-2000:]}")
        try:
            if '"event": "step"' in metrics.read_text():
                return time.perf_counter() - started
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"no training step within {FIRST_STEP_TIMEOUT_S:.0f} s")


def _family_memory(root_pid: int) -> list[tuple[str, dict[str, float]]]:
    """(title, {Rss, Pss, Uss} in MB) of the process and its descendants, from /proc/PID/smaps_rollup."""
    family = {root_pid, *descendants(root_pid)}
    return [(_title(pid), _rollup(pid)) for pid in sorted(family) if _title(pid).startswith("stoker")]


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _rollup(pid: int) -> dict[str, float]:
    fields: dict[str, float] = {}
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) / 1024
    uss = fields.get("Private_Clean", 0.0) + fields.get("Private_Dirty", 0.0)
    return {"Rss": round(fields["Rss"], 1), "Pss": round(fields["Pss"], 1), "Uss": round(uss, 1)}


def measure_throughput(scratch: Path, sources: list[Path], args: argparse.Namespace) -> dict[str, Any]:
    """Producers decoding the same images from files and from shards, interleaved runs, medians."""
    from stoker.bench.pipeline import time_stoker
    from stoker.data.formats.pack import Shrink, pack
    from stoker.data.formats.shards import load_shards

    root = scratch / "throughput"
    build_folder(root, sources, args.throughput_files)
    shards = pack(root, scratch / "shards", shard_size=64 * 10**6, shrink=Shrink(keep_bytes=True))  # the format alone
    files = load_image_folder(root, cache=scratch / "cache")
    packed = load_shards([str(p) for p in shards], cache=scratch / "cache")
    feed = argparse.Namespace(workers=args.producers, batch_size=64, image_size=224,
                              images_per_run=args.throughput_files)
    runs: dict[str, list[float]] = {"files": [], "shards": []}
    for _ in range(args.repeats):
        runs["files"].append(time_stoker(None, None, feed, source=files))
        runs["shards"].append(time_stoker(None, None, feed, source=packed))
    medians = {k: round(statistics.median(v), 1) for k, v in runs.items()}
    return {"images": args.throughput_files, "producers": args.producers, "files_img_s": medians["files"],
            "shards_img_s": medians["shards"], "shards_over_files": round(medians["shards"] / medians["files"], 3),
            "runs": runs}


def print_table(rows: list[dict[str, Any]], throughput: dict[str, Any]) -> None:
    header = ("files", "scan s", "from cache s", "first step s", "first step, no cache s", "controller RSS MB",
              "producer USS MB", "producer PSS MB", "producer RSS MB")
    keys = ("files", "scan_s", "from_cache_s", "first_step_s", "first_step_no_cache_s", "controller_rss_mb",
            "producer_uss_mb", "producer_pss_mb", "producer_rss_mb")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    print(f"\nthroughput on {throughput['images']} images, {throughput['producers']} producers: files "
          f"{throughput['files_img_s']} img/s, shards {throughput['shards_img_s']} img/s "
          f"(shards / files {throughput['shards_over_files']})")

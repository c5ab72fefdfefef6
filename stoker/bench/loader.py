"""`stoker bench loader`: stoker.Loader against torch's DataLoader in the same input-bound 2-rank DDP loop.

The loop is a user's torchrun script (gloo, a model with almost no compute, 500x375 JPEGs, RandomResizedCrop 224 and
flip). Three feeds, each in its best form: `loader` (stoker.Loader), `dataloader_pillow` (the torchvision recipe) and
`dataloader_stoker` (workers decoding with stoker's `load_into`), DataLoader with persistent workers at the fastest
worker count of a sweep in the same run. `--steps` times the steady rate, `--epochs E` whole runs, start-up included.
Repeats are interleaved; beside samples/s it reports every process's CPU time per sample, the steadier figure on a
machine that others load."""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from stoker.bench.runs import stop_children
from stoker.common.procs import descendants, stat_fields

FEEDS = ("loader", "dataloader_pillow", "dataloader_stoker")


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("loader", help="stoker.Loader against DataLoader in an input-bound 2-rank DDP loop")
    parser.add_argument("--data", type=Path, metavar="DIR", help="a folder of `stoker bench pipeline --generate` "
                        "(default: generate 500x375 JPEGs into a temporary folder)")
    parser.add_argument("--images", type=int, default=512, help="JPEGs to generate")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per rank and run")
    parser.add_argument("--warmup", type=int, default=8, help="steps per rank before timing starts")
    parser.add_argument("--epochs", type=int, help="time whole runs of this many epochs, start-up included, instead "
                        "of --steps after --warmup")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="1,2,3", help="DataLoader workers per rank to sweep")
    parser.add_argument("--json", type=Path, metavar="FILE")
    parser.add_argument("--rank-feed", help=argparse.SUPPRESS)  # internal: one rank of one run
    parser.add_argument("--rank-workers", type=int, default=0, help=argparse.SUPPRESS)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.rank_feed:
        return rank_main(args)
    if args.epochs is not None and args.epochs < 1:
        raise SystemExit(f"--epochs={args.epochs}: expected 1 or more")
    with tempfile.TemporaryDirectory(prefix="stoker-bench-loader-") as scratch:
        folder = args.data or _generate(Path(scratch), args.images)
        result = measure(folder, args)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _generate(scratch: Path, images: int) -> Path:
    from stoker.bench.pipeline import generate

    generate(scratch, images, 0)
    return scratch / "500x375"


def measure(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    sweep = [int(w) for w in args.workers.split(",")]
    best = {}
    for feed in ("dataloader_pillow", "dataloader_stoker"):  # each DataLoader's best worker count, measured here
        rates = {w: launch(folder, feed, w, args)[0] for w in sweep}
        best[feed] = max(rates, key=lambda w: rates[w])
        print(f"{feed}: workers per rank {rates} -> {best[feed]}", file=sys.stderr)
    runs: dict[str, list[float]] = {feed: [] for feed in FEEDS}
    cpu: dict[str, list[float]] = {feed: [] for feed in FEEDS}
    for repeat in range(args.repeats):
        order = FEEDS[repeat % len(FEEDS):] + FEEDS[:repeat % len(FEEDS)]
        for feed in order:
            rate, cpu_ms = launch(folder, feed, best.get(feed, 0), args)
            runs[feed].append(rate)
            cpu[feed].append(cpu_ms)
    medians = {feed: statistics.median(rates) for feed, rates in runs.items()}
    cpu_medians = {feed: statistics.median(values) for feed, values in cpu.items()}
    return {"command": " ".join(sys.argv), "cores": os.cpu_count(), "ranks": args.ranks,
            "batch_size": args.batch_size, "image_size": args.image_size, "images": _count_images(folder),
            "shape": _shape(args), "steps": None if args.epochs else args.steps, "epochs": args.epochs,
            "best_workers": best, "samples_per_s": runs, "median_samples_per_s": medians,
            "cpu_ms_per_sample": cpu, "median_cpu_ms_per_sample": cpu_medians, "load_average": os.getloadavg(),
            "loader_vs_dataloader_pillow": medians["loader"] / medians["dataloader_pillow"],
            "loader_vs_dataloader_stoker": medians["loader"] / medians["dataloader_stoker"]}


def _shape(args: argparse.Namespace) -> str:
    if args.epochs is not None:
        return f"whole runs of {args.epochs} epoch(s), start-up and epoch boundaries included"
    return f"{args.steps} steps per rank after {args.warmup} of warm-up, within one epoch"


def _count_images(folder: Path) -> int:
    from stoker.data.formats.folders import scan_image_folder

    return len(scan_image_folder(folder).paths)


def launch(folder: Path, feed: str, workers: int, args: argparse.Namespace) -> tuple[float, float]:
    """One run: `ranks` processes as torchrun starts them; (samples per second over all ranks on rank 0's clock,
    CPU milliseconds per sample of every process of the run over the timed steps or the whole run)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="stoker-bench-rank-") as out:
        processes = []
        for rank in range(args.ranks):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(args.ranks), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(args.ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            command = [sys.executable, "-m", "stoker", "bench", "loader", "--data", str(folder), "--rank-feed",
                       feed, "--rank-workers", str(workers), "--batch-size", str(args.batch_size), "--image-size",
                       str(args.image_size), "--steps", str(args.steps), "--warmup", str(args.warmup), "--json",
                       f"{out}/{rank}.json", *(["--epochs", str(args.epochs)] if args.epochs else [])]
            processes.append(subprocess.Popen(command, env=env))
        try:
            for process in processes:
                if process.wait(timeout=600) != 0:
                    raise RuntimeError(f"bench loader: a rank of {feed} exited {process.returncode}")
        except BaseException as error:  # a rank failed or timed out: its peers wait in a collective; none is left
            stop_children(processes, group_signalled=isinstance(error, KeyboardInterrupt))
            raise
        records = [json.loads(Path(f"{out}/{rank}.json").read_text()) for rank in range(args.ranks)]
        samples = sum(r["samples"] for r in records)
        return records[0]["samples_per_s"], 1000 * sum(r["cpu_s"] for r in records) / samples


# ---- one rank ------------------------------------------------------------------------------------------------------

class StokerDecodeDataset:
    """DataLoader workers decoding with stoker's `load_into` (libjpeg-turbo reduced decode, OpenCV resize)."""

    def __init__(self, paths: list[str], labels: np.ndarray, size: int) -> None:
        self.paths, self.labels, self.size = paths, labels, size
        self.rng = np.random.default_rng()

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        import torch

        from stoker.data.pixels.imaging import load_into

        out = np.empty((self.size, self.size, 3), np.uint8)
        load_into(Path(self.paths[index]).read_bytes(), out, "standard", self.rng)
        return torch.from_numpy(out), int(self.labels[index])


def rank_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 8, stride=8), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    whole = args.epochs is not None
    if whole:  # the feed's making, its start and every epoch boundary are timed
        dist.barrier()
        timed_from, cpu_from = time.perf_counter(), tree_cpu_s()
    batches, close = _feed(args)
    samples = 0
    try:
        for step, (images, labels) in enumerate(batches):
            if not whole and step == args.warmup:
                dist.barrier()
                timed_from, cpu_from = time.perf_counter(), tree_cpu_s()
            if images is None or (not whole and step == args.warmup + args.steps):
                cpu_s = tree_cpu_s() - cpu_from
                break
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
            samples += len(labels) if whole or step >= args.warmup else 0
        seconds = time.perf_counter() - timed_from
    finally:
        close()
    rate = samples * dist.get_world_size() / seconds
    Path(args.json).write_text(json.dumps({"samples_per_s": rate, "cpu_s": cpu_s, "samples": samples}))
    dist.destroy_process_group()
    return 0


def tree_cpu_s() -> float:
    """CPU seconds so far of this process and its descendants: the live ones from /proc with what their own
    reaped children used (a producer the zygote forked and reaped after its retirement counts in the zygote's),
    and this process's reaped children from the kernel's count for waited-for children."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    tick = os.sysconf("SC_CLK_TCK")
    for pid in descendants(os.getpid()):
        fields = stat_fields(pid)
        if fields is None:  # exited since
            continue
        # utime, stime, cutime, cstime (fields 14-17 of proc(5))
        total += sum(int(value) for value in fields[11:15]) / tick
    return total


def _feed(args: argparse.Namespace) -> tuple[Any, Any]:
    """(an endless iterator of (float images, labels), its close)."""
    import torch

    if args.rank_feed == "loader":
        import stoker

        loader = stoker.Loader(args.data, batch_size=args.batch_size, image_size=args.image_size, device="cpu",
                               drop_last=True)  # as the DataLoaders: the same samples every epoch
        return _epochs(loader, epochs=args.epochs), loader.close
    from torch.utils.data import DataLoader, DistributedSampler

    from stoker.data.formats.folders import scan_image_folder
    from stoker.training.to_device import MEAN, STD, normalize_pixels

    index = scan_image_folder(args.data)
    if args.rank_feed == "dataloader_pillow":
        from stoker.bench.pipeline import TorchvisionStyleDataset

        dataset: Any = TorchvisionStyleDataset(index.paths, index.labels, args.image_size, to_float=True)
    else:
        dataset = StokerDecodeDataset(list(index.paths), index.labels, args.image_size)
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)
    workers = args.rank_workers
    feed: DataLoader[Any] = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=workers,
                                       persistent_workers=workers > 0, pin_memory=torch.cuda.is_available(),
                                       drop_last=True, prefetch_factor=2 if workers else None)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
    inv_std = 1 / (torch.tensor(STD).view(1, 3, 1, 1) * 255)

    def normalized() -> Any:
        for images, labels in _epochs(feed, sampler, args.epochs):
            if images is not None and images.dtype == torch.uint8:  # stoker's decoder: uint8 NHWC, normalized
                # here by the Loader's own code into the Loader's default memory format (channels_last), so only the
                # feeds differ
                images = normalize_pixels(images, mean, inv_std, torch.channels_last)
            yield images, labels
    return normalized(), lambda: None


def _epochs(loader: Any, sampler: Any = None, epochs: int | None = None) -> Any:
    """Batches of one epoch after another: endless, or `epochs` of them and then (None, None)."""
    epoch = 0
    while epochs is None or epoch < epochs:
        (sampler or loader).set_epoch(epoch)
        yield from loader
        epoch += 1
    yield None, None


def print_table(result: dict[str, Any]) -> None:
    print(f"input-bound {result['ranks']}-rank DDP loop, {result['images']} images, batch {result['batch_size']} "
          f"per rank, RandomResizedCrop {result['image_size']}, {result['shape']}, medians of "
          f"{len(result['samples_per_s']['loader'])} repeats")
    for feed in FEEDS:
        runs = ", ".join(f"{r:.0f}" for r in result["samples_per_s"][feed])
        workers = result["best_workers"].get(feed)
        note = f" (best workers per rank: {workers})" if workers is not None else ""
        print(f"  {feed:18s} {result['median_samples_per_s'][feed]:8.1f} samples/s  [{runs}]  "
              f"{result['median_cpu_ms_per_sample'][feed]:.2f} CPU ms/sample{note}")
    print(f"  Loader / DataLoader (Pillow recipe):   {result['loader_vs_dataloader_pillow']:.2f}x")
    print(f"  Loader / DataLoader (stoker's decoder): {result['loader_vs_dataloader_stoker']:.2f}x")
    cpu = result["median_cpu_ms_per_sample"]
    print(f"  CPU per sample, DataLoader / Loader: Pillow recipe {cpu['dataloader_pillow'] / cpu['loader']:.2f}x, "
          f"stoker's decoder {cpu['dataloader_stoker'] / cpu['loader']:.2f}x")

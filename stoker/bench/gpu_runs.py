"""The measurements of `stoker bench gpu` (see `stoker.bench.gpu`): ceiling, stoker, and DataLoader with two
decoders, each timed with the same device events (`StepClock`), each in a process of its own (GPU memory is given
back between runs: a 24-40 GB card does not keep the ceiling's cached blocks while stoker trains), in interleaved
repeats whose medians are reported."""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from stoker.bench.runs import completed_run
from stoker.common.devices import available_cores
from stoker.common.procs import executor_processes

WARMUP_STEPS = 5  # cuDNN's algorithm search and the allocator settle in these
KINDS = ("ceiling", "stoker", "dataloader_pillow", "dataloader_stoker_decoder")
PREFETCH = 2  # DataLoader's default prefetch_factor
# Steady state. A system with input queued before the clock started (the DataLoader's `prefetch_factor x workers`
# batches, dispatched at `iter()` and ready while step 0 autotunes; stoker's ring) reads faster than it can produce
# until that backlog is gone. So after the warm-up every system keeps stepping until one step's input blocks: its
# wait for the batch is longer than BLOCKED_SHARE of a step (the median warm-up step after the first, wait
# included), and at least BLOCKED_MIN_S (handing over a batch that is ready takes less). That step opens the timed
# window. At most `max_skipped(workers)` steps are skipped (a system that never waits has no backlog to drain).
BLOCKED_SHARE = 0.05
BLOCKED_MIN_S = 0.001

log = logging.getLogger(__name__)


def measure(folder: Path, args: argparse.Namespace, kinds: Sequence[str] = KINDS,
            skipped: dict[str, str] | None = None,
            saved: Callable[[dict[str, Any]], None] = lambda result: None) -> dict[str, Any]:
    """Every model's row. `skipped`: kinds that cannot run here, with why (reported as failed, not run).
    `saved(result)` is called as each run ends, with every run so far under "runs": a check cut short by its time
    limit still has the figures it measured."""
    result: dict[str, Any] = {
        "device": _device_name(args.device), "image_size": args.image_size, "batch_size": args.batch_size,
        "precision": args.precision, "channels_last": args.channels_last == "true", "workers": args.workers,
        "repeats": args.repeats, "steps": getattr(args, "steps", None),
        "steps_ahead": steps_ahead(args), "rows": [], "runs": []}
    for model in args.models.split(","):
        result["rows"].append(_measure_model(folder, model, args, kinds, skipped or {}, result, saved))
        saved(result)
    return result


def _measure_model(folder: Path, model: str, args: argparse.Namespace, kinds: Sequence[str],
                   skipped: dict[str, str], result: dict[str, Any],
                   saved: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Each repeat runs every kind once, starting one kind later than the repeat before, each in a fresh process.
    A run that fails is recorded with its error; the others still run."""
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for repeat in range(args.repeats):
        for position in range(len(kinds)):
            kind = kinds[(position + repeat) % len(kinds)]
            run = {"error": skipped[kind]} if kind in skipped else _run_or_error(kind, folder, model, args)
            runs[kind].append(run)
            result["runs"].append({"model": model, "kind": kind, "repeat": repeat, **run})
            saved(result)
    row: dict[str, Any] = {"model": model}
    for kind, results in runs.items():
        row[kind] = _medians(results)
    row["stoker_vs_ceiling"] = _ratio(row.get("stoker"), row.get("ceiling"))
    row["stoker_vs_dataloader"] = _ratio(row.get("stoker"), row.get("dataloader_pillow"))
    row["stoker_vs_dataloader_same_decoder"] = _ratio(row.get("stoker"), row.get("dataloader_stoker_decoder"))
    if "dataloader_pillow" in row:
        row["dataloader"] = row["dataloader_pillow"]  # the column earlier reports had
    return row


def _medians(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians of a kind's runs that ended with figures; its first error when none did."""
    measured = [r for r in results if "error" not in r]
    if not measured:
        return {"error": results[0]["error"]}
    figures: dict[str, Any] = {key: statistics.median(r[key] for r in measured)
                               for key in ("samples_per_s", "input_stall", "host", "skipped_steps")
                               if all(key in r for r in measured)}
    figures["repeats"] = [r["samples_per_s"] for r in measured]
    return figures


def _ratio(rate: dict[str, Any] | None, other: dict[str, Any] | None) -> float | None:
    if rate is None or other is None or "error" in rate or "error" in other:
        return None
    return round(rate["samples_per_s"] / other["samples_per_s"], 3)


def _run_or_error(kind: str, folder: Path, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The run's figures, or {"error": why} when it failed (a process that died, a bus error in a worker)."""
    try:
        return _in_own_process(kind, folder, model, args)
    except Exception as error:  # noqa: BLE001 - the bench reports it and measures the other runs
        log.warning("bench gpu: the %s run of %s failed: %s", kind, model, error)
        return {"error": f"{type(error).__name__}: {error}"}


def _in_own_process(kind: str, folder: Path, model: str, args: argparse.Namespace) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=1, mp_context=context)
    try:
        return pool.submit(run_one, kind, folder, model, vars(args)).result()
    except BaseException:  # interrupted: the run's process never saw the signal, and shutdown would wait for it
        for process in executor_processes(pool):
            process.terminate()  # its stoker.train stops at the prepared steps, as on SIGTERM
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def blocked_threshold_s(step_s: float) -> float:
    """The wait for a batch above which its `next()` counts as blocked (see BLOCKED_SHARE)."""
    return max(BLOCKED_MIN_S, BLOCKED_SHARE * step_s)


def max_skipped(workers: int) -> int:
    """The most steps skipped looking for the steady state: twice the most batches a DataLoader prefetches."""
    return 2 * PREFETCH * workers


def images_needed(args: argparse.Namespace) -> int:
    """JPEGs enough for stoker's first epoch to hold its warm-up, the most steps skipped, and the timed window."""
    return (WARMUP_STEPS + max_skipped(args.workers) + args.steps) * args.batch_size


def run_one(kind: str, folder: Path, model: str, settings: dict[str, Any]) -> dict[str, Any]:
    """One measurement, in the process it was sent to."""
    args = argparse.Namespace(**settings)
    if kind == "ceiling":
        return time_ceiling(model, args)
    if kind == "stoker":
        return time_stoker(folder, model, args)
    return time_dataloader(folder, model, args, decoder="pillow" if kind == "dataloader_pillow" else "stoker")


class _Step:
    """stoker's consumer step: the model with its state in the averager's flat buckets (NCHW weights), the input
    normalized on the device by the consumer's own `feed.normalize_pixels` in the memory format asked for, the
    consumer's precision and its fused SGD; timed with the consumer's `StepClock` events."""

    def __init__(self, model: str, args: argparse.Namespace, num_classes: int) -> None:
        from stoker.training import accel
        from stoker.training.averager import Averager
        from stoker.training.models import build_model
        from stoker.training.streams import ops_for
        from stoker.training.timing import StepClock
        from stoker.training.to_device import MEAN, STD, normalization_constants, normalize_pixels

        self.device = torch.device(args.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        accel.configure_backends(deterministic=False)
        self.model = build_model(model, num_classes).to(self.device)
        Averager(self.model, 1, 1)  # re-points the state into flat buckets, as the consumer's
        self.precision = accel.MixedPrecision(args.precision, self.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9,
                                         **accel.fused_option(torch.optim.SGD, self.device))
        self.ops = ops_for(self.device)
        # the feed's own normalization (no ring needed for that)
        memory_format = torch.channels_last if args.channels_last == "true" else torch.contiguous_format
        mean_255, inv_std_255 = (c.to(self.device) for c in normalization_constants(MEAN, STD))
        self.normalize: Callable[[torch.Tensor], torch.Tensor] = lambda pixels: normalize_pixels(
            pixels, mean_255, inv_std_255, memory_format)
        self.clock = StepClock(self.ops, steps_ahead(args))  # as deep as the consumer's (`--steps-ahead`)
        self.marks: list[Any] = []

    def step(self, pixels: torch.Tensor, labels: torch.Tensor, host_wait_s: float,
             to_device: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """One step on uint8 NHWC `pixels` (on the device, or brought there by `to_device`)."""
        self.clock.begin(host_wait_s)
        if to_device is not None:
            pixels, labels = to_device()
        self.clock.fed()
        images = self.normalize(pixels)
        self.optimizer.zero_grad(set_to_none=True)
        with self.precision.autocast():
            loss = F.cross_entropy(self.model(images), labels)
        self.precision.backward_and_step(loss, self.optimizer)
        self.clock.computed()
        self.marks.append(self.clock.end(averaged=False))

    def figures(self, batch_size: int, first: int = WARMUP_STEPS) -> dict[str, float]:
        """Samples/s, input stall and host share over the steps from `first` on, from the device timeline (idle
        gap before each step, split into input wait and host time, and its compute), as stoker's are read from
        its step events."""
        times = [self.clock.seconds(marks) for marks in self.marks[first:]]
        return _window_figures([{"samples": batch_size, "wait_s": t.wait_s, "host_s": t.host_s,
                                 "compute_s": t.compute_s, "averaging_s": t.averaging_s} for t in times])


def _window_figures(steps: list[dict[str, Any]]) -> dict[str, float]:
    """A timed window's figures from its steps' timings (the device's wall time is their sum)."""
    wall = sum(r["wait_s"] + r.get("host_s", 0.0) + r["compute_s"] + r["averaging_s"] for r in steps)
    if not steps or wall <= 0:
        raise RuntimeError("no timed steps")
    return {"samples_per_s": round(sum(r["samples"] for r in steps) / wall, 1),
            "input_stall": round(sum(r["wait_s"] for r in steps) / wall, 4),
            "host": round(sum(r.get("host_s", 0.0) for r in steps) / wall, 4), "steps": len(steps)}


def time_ceiling(model: str, args: argparse.Namespace) -> dict[str, float]:
    """The device's most: stoker's own step on one batch resident on the device (no input at all)."""
    trainer = _Step(model, args, num_classes=10)
    generator = torch.Generator().manual_seed(0)
    size = args.image_size
    pixels = torch.randint(0, 256, (args.batch_size, size, size, 3), dtype=torch.uint8, generator=generator)
    pixels = pixels.to(trainer.device)
    labels = torch.arange(args.batch_size, device=trainer.device) % 10
    for _ in range(WARMUP_STEPS + args.steps):
        trainer.step(pixels, labels, host_wait_s=0.0)
    return {**trainer.figures(args.batch_size), "skipped_steps": 0}  # no input: nothing queued to drain


def time_stoker(folder: Path, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """`stoker train`, timed over its first epoch only: no checkpoint inside the window (a Save ends each epoch,
    and while it runs the ring refills, so the steps after it would cost no wait)."""
    import stoker

    devices = "cuda:0" if args.device == "cuda" else "cpu:1"
    with tempfile.TemporaryDirectory(prefix="stoker-bench-gpu-run-") as out:
        summary = stoker.train(data=folder, val_fraction=0.0, model=model, devices=devices, producers="auto",
                               max_producers=args.workers, initial_producers=args.workers,
                               batch_size=args.batch_size, image_size=args.image_size, epochs=1,
                               steps_ahead=steps_ahead(args),
                               precision=args.precision, channels_last=args.channels_last == "true",
                               out=Path(out) / "run", report=False, show_progress=False)
        completed_run(summary, "stoker train")
        figures = steady_figures(Path(out) / "run" / "metrics.jsonl", args.steps, max_skipped(args.workers))
    return {**figures, "producers_final": summary["producers_final"]}


def steady_figures(metrics: Path, steps: int, most_skipped: int) -> dict[str, Any]:
    """Samples/s, input stall and host share of `steps` steps of epoch 0 from its steady state (after the
    WARMUP_STEPS, from the first step whose input wait counts as blocked, or after `most_skipped` steps), from the
    consumer's own step timings: on a GPU they are the device's timeline (compute, averaging, and the idle gap
    before each step, input wait and host time), so their sum is the device's wall time for those steps.
    A step's wait here is the device's idle time for input (on the CPU, the loop's whole wait)."""
    records = [record for record in map(json.loads, metrics.read_text().splitlines())
               if record["event"] == "step" and record["epoch"] == 0]
    ordered = sorted(records, key=lambda record: record["global_step"])
    warm = ordered[1:WARMUP_STEPS]
    threshold = blocked_threshold_s(statistics.median(
        r["wait_s"] + r.get("host_s", 0.0) + r["compute_s"] + r["averaging_s"] for r in warm) if warm else 0.0)
    skipped = 0
    while WARMUP_STEPS + skipped < len(ordered) and skipped < most_skipped \
            and ordered[WARMUP_STEPS + skipped]["wait_s"] <= threshold:
        skipped += 1
    timed = ordered[WARMUP_STEPS + skipped:WARMUP_STEPS + skipped + steps]
    if len(timed) < steps:
        raise RuntimeError(f"stoker ran {len(ordered)} steps in its first epoch: too few to time {steps} steps after "
                           f"{WARMUP_STEPS} warm-up steps and {skipped} skipped to its steady state (raise --images "
                           f"to {(WARMUP_STEPS + most_skipped + steps)} batches' worth)")
    return {**_window_figures(timed), "skipped_steps": skipped}


def time_dataloader(folder: Path, model: str, args: argparse.Namespace, decoder: str) -> dict[str, float]:
    """torch's DataLoader at its steady state: a sampler spanning the whole measurement (no epoch refill inside
    it), workers = stoker's producers, pinned memory, non-blocking copies; decoding with Pillow (torchvision's
    recipe) or with stoker's own decoder, so the ratio separates pipeline design from decoder speed."""
    from torch.utils.data import DataLoader, RandomSampler

    from stoker.data.formats.folders import scan_image_folder

    index = scan_image_folder(folder)
    trainer = _Step(model, args, num_classes=len(index.classes))
    dataset = _dataset(index, args.image_size, decoder)
    most_skipped = max_skipped(args.workers)
    total = WARMUP_STEPS + most_skipped + args.steps
    sampler = RandomSampler(dataset, num_samples=(total + PREFETCH * args.workers) * args.batch_size,
                            generator=torch.Generator().manual_seed(0))
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=trainer.device.type == "cuda", persistent_workers=True, drop_last=True,
                        prefetch_factor=PREFETCH, worker_init_fn=_seed_worker)
    iterator = iter(loader)
    try:
        step_s = [_loop_step(iterator, trainer)[1] for _ in range(WARMUP_STEPS)]
        skipped = _to_steady_state(iterator, trainer, blocked_threshold_s(statistics.median(step_s[1:] or step_s)),
                                   most_skipped)
        for _ in range(args.steps - 1):  # the step that blocked opened the window
            _loop_step(iterator, trainer)
        return {**trainer.figures(args.batch_size, first=WARMUP_STEPS + skipped), "skipped_steps": skipped}
    finally:
        iterator._shutdown_workers()  # type: ignore[attr-defined]  # now: the next run is timed


def _loop_step(iterator: Iterator, trainer: _Step) -> tuple[float, float]:
    """One step on the next batch: (the wait for it, the whole loop iteration) in seconds, on the host's clock."""
    asked = time.perf_counter()
    waited, (pixels, labels) = _timed_next(iterator)
    trainer.step(pixels, labels, host_wait_s=waited, to_device=_copier(pixels, labels, trainer.device))
    return waited, time.perf_counter() - asked


def _to_steady_state(iterator: Iterator, trainer: _Step, threshold_s: float, most_skipped: int) -> int:
    """Step until a batch's `next()` waits longer than `threshold_s` (the prefetched backlog is gone), at most
    `most_skipped` steps before that one; that step is the timed window's first. Returns the steps skipped."""
    skipped = 0
    while _loop_step(iterator, trainer)[0] <= threshold_s and skipped < most_skipped:
        skipped += 1
    return skipped


def _timed_next(iterator: Iterator) -> tuple[float, Any]:

    asked = time.perf_counter()
    batch = next(iterator)
    return time.perf_counter() - asked, batch


def _dataset(index, image_size: int, decoder: str):
    from stoker.bench.pipeline import TorchvisionStyleDataset

    if decoder == "pillow":
        return _NHWC(TorchvisionStyleDataset(index.paths, index.labels, image_size, to_float=False))
    return _StokerDecoded(index.paths, index.labels, image_size)


class _NHWC:
    """Pillow's CHW uint8 as NHWC, the layout stoker's slots hold, so the device-side work is the same."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        pixels, label = self.dataset[index]
        return pixels.permute(1, 2, 0).contiguous(), label


class _StokerDecoded:
    """Decode, RandomResizedCrop and flip as stoker's producers do (`load_into`: reduced-size libjpeg-turbo, OpenCV
    resize)."""

    def __init__(self, paths, labels, image_size: int) -> None:
        self.paths, self.labels, self.image_size = list(paths), np.asarray(labels), image_size
        self.rng = np.random.default_rng()

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        from stoker.data.pixels.imaging import load_into

        image = np.empty((self.image_size, self.image_size, 3), np.uint8)
        load_into(Path(self.paths[index]).read_bytes(), image, "standard", self.rng)
        return torch.from_numpy(image), int(self.labels[index])


def _seed_worker(worker_id: int) -> None:
    """Each worker its own random crops: forked workers would all share the parent's generator state."""
    info = torch.utils.data.get_worker_info()
    if info is None:
        return
    target = getattr(info.dataset, "dataset", info.dataset)
    if hasattr(target, "rng"):
        target.rng = np.random.default_rng([info.seed % (1 << 32), worker_id])


def _copier(pixels: torch.Tensor, labels: torch.Tensor, device: torch.device
            ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """The batch's host-to-device copy, enqueued inside the step (after the clock's begin, as stoker's is)."""
    return lambda: (pixels.to(device, non_blocking=True), labels.to(device, non_blocking=True))


def steps_ahead(args: argparse.Namespace) -> int:
    """`--steps-ahead` (stoker's default where the caller gave none)."""
    from stoker.common.config import DeviceSettings

    return getattr(args, "steps_ahead", None) or DeviceSettings().steps_ahead


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else f"cpu ({available_cores()} cores)"

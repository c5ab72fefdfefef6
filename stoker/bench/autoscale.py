"""`stoker bench autoscale`: fixed producer counts against `--producers auto`, workload by workload, in one run.

Workloads a-d (input-bound photos, a compute-heavy CPU consumer, simulated latency, a simulated GPU consumer), e
(reads waiting 25 ms: input capacity must follow the producers, not the slots), f, g, h (held-out shapes, whole
runs across epochs) and s (short input-bound runs: start-up is much of them). Auto runs with its defaults (no
--max-producers); throughput is taken over the second half of each run's steps, so auto's warm-up shows in
`settle_s`, and with `--repeats R` every configuration runs R times, interleaved, and the median counts. Each
workload and its figures: docs/benchmarks.md."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stoker.bench.runs import completed_run
from stoker.common import faults
from stoker.common.waiting import waiting
from stoker.data.formats import builtin_data
from stoker.observe.metrics import read_events

WORKLOADS = ("a", "b", "c", "d", "e", "f", "g", "h", "s", "i")
LATENCY_COUNTS = (4, 16)
HELD_OUT_COUNTS = (1, 2, 4, 8, 16, 32)  # the best fixed count is taken over these
SHORT_COUNTS = (1, 2, 3, 4)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    data: str  # "photos" or "textures"
    settings: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    counts: tuple[int, ...] | None = None  # the fixed counts to run; None: 1 to --max-fixed


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("autoscale", help="fixed producer counts against --producers auto, four workloads")
    parser.add_argument("--workloads", default="a,b,c,d", help="which of a-h, s and i to run")
    parser.add_argument("--max-fixed", type=int, default=4, help="fixed M is swept from 1 to this")
    parser.add_argument("--counts", help="fixed counts to run instead, comma-separated (e: 4,16)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration (median counts)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every workload's epochs")
    parser.add_argument("--photos", type=int, default=96, help="2000x1500 JPEGs for workloads a and d")
    parser.add_argument("--read-latency-ms", type=float, default=40.0, help="c: wait added to every file read")
    parser.add_argument("--step-ms", type=float, default=100.0, help="c, d: time every step holds its device")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.set_defaults(run=run)


def tiny_model(num_classes: int):
    """Almost no compute: the consumer's cost is taking the batch, so input is the bottleneck."""
    from torch import nn  # here: `stoker bench --help` must not wait for torch

    return nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(48, num_classes))


def workloads(args: argparse.Namespace) -> dict[str, Workload]:
    def epochs(count: int) -> int:
        return max(1, round(count * args.scale))

    photos = dict(model=f"{__name__}:tiny_model", image_size=224, batch_size=32, augment="standard")
    return {
        "a": Workload("a", "input-bound: 2000x1500 JPEGs, light CPU consumer", "photos",
                      {**photos, "epochs": epochs(30)}),
        "b": Workload("b", "compute-heavy CPU consumer (resnet14, 32 px textures)", "textures",
                      dict(model="resnet14", image_size=32, batch_size=32, epochs=epochs(3))),
        "c": Workload("c", f"simulated latency: reads wait {args.read_latency_ms:g} ms, steps {args.step_ms:g} ms",
                      "small-textures", dict(model="resnet8", image_size=32, batch_size=8, epochs=epochs(14)),
                      {faults.READ_LATENCY_ENV: str(args.read_latency_ms), faults.STEP_TIME_ENV: str(args.step_ms)}),
        "d": Workload("d", f"simulated GPU consumer: 2000x1500 JPEGs, each step a {args.step_ms:g} ms sleep",
                      "photos", {**photos, "epochs": epochs(30)}, {faults.STEP_TIME_ENV: str(args.step_ms)}),
        "e": Workload("e", "latency: reads wait 25 ms, 500x375 JPEGs, light CPU consumer, 64 px", "small-photos",
                      {**photos, "image_size": 64, "epochs": epochs(2)}, {faults.READ_LATENCY_ENV: "25"},
                      LATENCY_COUNTS),
        # Held out: runs that reviewers measured and the workloads above did not foresee (short, across epochs).
        "f": Workload("f", "held out: reads wait 25 ms, 3 epochs of 2,000 500x375 JPEGs, light CPU consumer, 64 px",
                      "photos-2000", {**photos, "image_size": 64, "epochs": epochs(3)}, {faults.READ_LATENCY_ENV: "25"},
                      HELD_OUT_COUNTS),
        "g": Workload("g", "held out: 2000x1500 JPEGs, light CPU consumer, 12 short epochs", "photos",
                      {**photos, "epochs": epochs(12)}, counts=HELD_OUT_COUNTS),
        "h": Workload("h", "held out: a new user's run: 500x375 JPEGs at 128 px, resnet8, 8 epochs", "photos-600",
                      dict(model="resnet8", image_size=128, batch_size=32, augment="standard", epochs=epochs(8)),
                      counts=HELD_OUT_COUNTS),
        # Short input-bound runs: a few seconds of training each on a quiet machine, so auto's start-up is much of it.
        "s": Workload("s", "short: 2 epochs of 2,000 500x375 JPEGs at 224 px, light CPU consumer", "photos-2000",
                      {**photos, "epochs": epochs(2)}, counts=SHORT_COUNTS),
        "i": Workload("i", "short: 2 epochs of 2,000 ImageNet-like JPEGs at 224 px, light CPU consumer",
                      "imagenet-like-2000", {**photos, "epochs": epochs(2)}, counts=SHORT_COUNTS),
    }


def run(args: argparse.Namespace) -> int:
    chosen = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(WORKLOADS))
    if unknown or not chosen:
        raise SystemExit(f"--workloads={args.workloads!r}: expected a comma-separated subset of "
                         f"{','.join(WORKLOADS)}")
    if args.counts is not None and not _parse_counts(args.counts):
        raise SystemExit(f"--counts={args.counts!r}: expected comma-separated producer counts of 1 or more")
    if args.photos < 40 and {"a", "d", "g"} & set(chosen):
        raise SystemExit(f"--photos={args.photos}: workloads a, d and g train batches of 32, expected at least 40")
    table = workloads(args)
    with tempfile.TemporaryDirectory(prefix="stoker-bench-") as scratch:
        root = Path(scratch)
        data = _make_data(root, {table[name].data for name in chosen}, args.photos)
        results = [measure(table[name], data[table[name].data], root / name, args) for name in chosen]
    result = {"cores": os.cpu_count(), "max_fixed": args.max_fixed, "repeats": args.repeats, "workloads": results}
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _parse_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        return ()
    return counts if counts and min(counts) >= 1 else ()


def _make_data(root: Path, kinds: set[str], photos: int) -> dict[str, Path]:
    from stoker.bench.photos import NAME as IMAGENET_LIKE
    from stoker.bench.photos import make_imagenet_like
    from stoker.bench.pipeline import generate

    made = {}
    if "photos" in kinds:
        generate(root / "photos", small=0, large=photos)
        made["photos"] = root / "photos" / "2000x1500"
    if "small-photos" in kinds:
        generate(root / "small-photos", small=640, large=0)  # the 640: 608 train, 19 steps an epoch
        made["small-photos"] = root / "small-photos" / "500x375"
    for kind, count in (("photos-2000", 2000), ("photos-600", 600)):
        if kind in kinds:
            generate(root / kind, small=count, large=0)
            made[kind] = root / kind / "500x375"
    if "imagenet-like-2000" in kinds:
        made["imagenet-like-2000"] = root / IMAGENET_LIKE
        make_imagenet_like(made["imagenet-like-2000"], 2000)
    if "textures" in kinds:
        builtin_data.generate(root / "textures", train_per_class=60, val_per_class=2)
        made["textures"] = root / "textures" / "train"
    if "small-textures" in kinds:
        builtin_data.generate(root / "small", train_per_class=12, val_per_class=2)
        made["small-textures"] = root / "small" / "train"
    return made


def measure(workload: Workload, data: Path, scratch: Path, args: argparse.Namespace) -> dict[str, Any]:
    import stoker

    fixed_counts = (_parse_counts(args.counts) if args.counts else None) or workload.counts \
        or tuple(range(1, args.max_fixed + 1))
    configurations: list[int | str] = [*fixed_counts, "auto"]
    rates: dict[int | str, list[float]] = {m: [] for m in configurations}
    whole: dict[int | str, list[float]] = {m: [] for m in configurations}
    verdicts: dict[int | str, list[str]] = {m: [] for m in configurations}
    summaries: dict[str, dict[str, Any]] = {}
    runs = args.repeats * len(configurations)
    with (_environment(workload.env),
          waiting(f"bench autoscale ({workload.name})", total=runs, unit="runs") as progress):
        for repeat in range(args.repeats):  # interleaved: drift in the machine's speed hits every count alike
            for producers in configurations:
                out = scratch / f"{producers}-{repeat}"
                summary = completed_run(
                    stoker.train(data=data, val_fraction=0.05, devices="cpu:1", producers=producers, seed=0,
                                 out=out, show_progress=False, report=False, **workload.settings),
                    f"workload {workload.name}, producers={producers}")
                rates[producers].append(steady_rate(out))
                whole[producers].append(round(summary["throughput_samples_per_s"], 2))
                verdicts[producers].append(summary["verdict"]["text"])
                progress.advance()
                if producers == "auto":
                    summaries[str(repeat)] = summary
    fixed: list[dict[str, Any]] = [{"producers": m, "samples_per_s": statistics.median(rates[m]), "runs": rates[m],
                                    "whole_run_samples_per_s": statistics.median(whole[m]), "verdicts": verdicts[m]}
                                   for m in configurations if m != "auto"]
    best = max(fixed, key=lambda row: row["samples_per_s"])
    best_whole = max(fixed, key=lambda row: row["whole_run_samples_per_s"])  # what a user's short run sees
    auto_rate = statistics.median(rates["auto"])
    median_run = summaries[str(_median_index(rates["auto"]))]
    return {"workload": workload.name, "description": workload.description, "settings": workload.settings,
            "env": workload.env, "fixed": fixed, "best_fixed_producers": best["producers"],
            "auto_samples_per_s": auto_rate, "auto_runs": rates["auto"],
            "auto_whole_run_samples_per_s": statistics.median(whole["auto"]), "auto_verdicts": verdicts["auto"],
            "auto_plain_need_s": median_run.get("autoscale_plain_need_s"),
            "auto_first_fork_s": median_run.get("autoscale_first_fork_s"),
            "auto_producers_final": median_run["producers_final"], "auto_producers_max": median_run["producers_max"],
            "settle_s": settle_time(median_run["producers_timeline"]),
            "auto_timeline": median_run["producers_timeline"],
            "auto_over_best": round(auto_rate / best["samples_per_s"], 3) if best["samples_per_s"] else 0.0,
            "best_fixed_whole_run_producers": best_whole["producers"],
            "auto_over_best_whole_run": round(statistics.median(whole["auto"]) / best_whole["whole_run_samples_per_s"],
                                              3) if best_whole["whole_run_samples_per_s"] else 0.0}


def _median_index(values: list[float]) -> int:
    return sorted(range(len(values)), key=values.__getitem__)[len(values) // 2]


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """The simulated delays reach producers and consumers through their environment."""
    saved = {key: os.environ.get(key) for key in (faults.READ_LATENCY_ENV, faults.STEP_TIME_ENV)}
    for key in saved:
        os.environ.pop(key, None)
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def steady_rate(run_dir: Path) -> float:
    """Samples per second over the second half of the run's training steps."""
    steps = read_events(run_dir / "metrics.jsonl")["step"]
    late = steps[len(steps) // 2:]
    span = late[-1]["t"] - late[0]["t"]
    return round(sum(r["samples"] for r in late[1:]) / span, 2) if span > 0 else 0.0


def settle_time(timeline: list[dict[str, Any]]) -> float:
    """When auto made its last change: from then on it ran at its final count."""
    return timeline[-1]["t"] if len(timeline) > 1 else 0.0


def print_table(result: dict[str, Any]) -> None:
    for workload in result["workloads"]:
        print(f"\n({workload['workload']}) {workload['description']}")
        print(f"{'producers':>10} {'samples/s':>10} {'whole run':>10}")
        for row in workload["fixed"]:
            print(f"{row['producers']:>10} {row['samples_per_s']:>10.1f} {row['whole_run_samples_per_s']:>10.1f}")
        start = workload["auto_timeline"][0]["producers"]
        print(f"{'auto':>10} {workload['auto_samples_per_s']:>10.1f} {workload['auto_whole_run_samples_per_s']:>10.1f}"
              f"   ({start} -> {workload['auto_producers_final']} producers, at most {workload['auto_producers_max']}, "
              f"last change at {workload['settle_s']:.1f} s; plain need at {workload['auto_plain_need_s']} s, "
              f"first fork at {workload['auto_first_fork_s']} s)")
        fixed = workload["fixed"]
        print(f"whole run: auto / best fixed (M={workload['best_fixed_whole_run_producers']}): "
              f"{workload['auto_over_best_whole_run']:.3f}")
        print(f"auto / best fixed (M={workload['best_fixed_producers']}): {workload['auto_over_best']:.3f}"
              + (f"; M={fixed[-1]['producers']} / M={fixed[0]['producers']}: "
                 f"{fixed[-1]['samples_per_s'] / max(1e-9, fixed[0]['samples_per_s']):.2f}x" if len(fixed) > 1 else ""))
        for row in fixed:
            for verdict in row["verdicts"]:
                print(f"  M={row['producers']}: {verdict}")
        for verdict in workload["auto_verdicts"]:
            print(f"  auto: {verdict}")

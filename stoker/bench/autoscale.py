"""`stoker bench autoscale`: fixed M = 1..budget against `--producers auto` on one slow-input workload, one run.

The workload makes input the bottleneck the way remote storage does: every file read waits `--read-latency-ms`,
and every training step holds its consumer `--step-ms` (a stand-in for device time). Throughput is measured on the
second half of each run's steps, the same way for every run, so auto's warm-up shows in `settle_s`, not in the
steady-state ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from stoker import builtin_data, faults
from stoker.metrics import read_events
from stoker.waiting import waiting


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("autoscale", help="fixed producer counts against --producers auto, slow input")
    parser.add_argument("--read-latency-ms", type=float, default=40.0, help="wait added to every file read")
    parser.add_argument("--step-ms", type=float, default=100.0, help="time every training step holds its device")
    parser.add_argument("--max-producers", type=int, default=6, help="budget: fixed M is swept from 1 to this")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import stoker

    os.environ[faults.READ_LATENCY_ENV] = str(args.read_latency_ms)
    os.environ[faults.STEP_TIME_ENV] = str(args.step_ms)
    with tempfile.TemporaryDirectory(prefix="stoker-bench-") as scratch:
        root = Path(scratch)
        builtin_data.generate(root / "data", train_per_class=12, val_per_class=2)
        common = dict(data=root / "data" / "train", val=root / "data" / "val", devices="cpu:1", image_size=32,
                      batch_size=args.batch_size, epochs=args.epochs, seed=0, show_progress=False, report=False)
        fixed = []
        with waiting("bench autoscale", total=args.max_producers + 1, unit="runs") as progress:
            for producers in range(1, args.max_producers + 1):
                out = root / f"fixed-{producers}"
                stoker.train(producers=producers, out=out, **common)
                fixed.append({"producers": producers, "samples_per_s": steady_rate(out)})
                progress.advance()
            out = root / "auto"
            summary = stoker.train(producers="auto", max_producers=args.max_producers, out=out, **common)
            auto_rate = steady_rate(out)
    best = max(fixed, key=lambda row: row["samples_per_s"])
    result = {
        "workload": {"read_latency_ms": args.read_latency_ms, "step_ms": args.step_ms,
                     "batch_size": args.batch_size, "epochs": args.epochs, "cores": os.cpu_count()},
        "fixed": fixed,
        "best_fixed_producers": best["producers"],
        "auto_samples_per_s": auto_rate,
        "auto_producers_final": summary["producers_final"],
        "settle_s": settle_time(summary["producers_timeline"]),
    }
    result["auto_over_best"] = round(result["auto_samples_per_s"] / best["samples_per_s"], 3)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


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
    print(f"{'producers':>10} {'samples/s':>10}")
    for row in result["fixed"]:
        print(f"{row['producers']:>10} {row['samples_per_s']:>10.1f}")
    print(f"{'auto':>10} {result['auto_samples_per_s']:>10.1f}   (ended with {result['auto_producers_final']} "
          f"producers, settled after {result['settle_s']:.1f} s)")
    print(f"auto / best fixed (M={result['best_fixed_producers']}): {result['auto_over_best']:.3f}")

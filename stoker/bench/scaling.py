"""`stoker bench scaling`: speed-up with N consumers on simulated devices, and a cost model for larger clusters.

Each run is a real `stoker train`: controller, producers decoding real JPEGs, slot ring, queues, gloo averaging.
Only the device is simulated: every training step holds its consumer `--step-ms` in a sleep that leaves the CPU
free, as a GPU kernel would, while the model carries `--params` real parameters that are really averaged. Every
consumer runs the same number of steps (weak scaling, as with one batch per GPU), so speed-up is the ratio of
throughputs. A bare all_reduce of the same bytes among the same number of processes is timed in the same run, so
stoker's own overhead per step is what is left: wall - device time - all_reduce / H. `--overlap` also runs every
N > 1 point with `--overlap-averaging`, where the all_reduce hides under the next steps' device time.

`--model-only` runs nothing: it predicts speed-up from `--step-ms` and a ring all-reduce cost model,
2(N-1)/N x bytes / bandwidth + 2(N-1) x latency, for cluster sizes this machine cannot hold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stoker.bench.group import run_group
from stoker.common import faults
from stoker.common.waiting import waiting
from stoker.data.formats import builtin_data
from stoker.observe.metrics import read_events

if TYPE_CHECKING:  # torch is imported where it runs: `stoker bench scaling --help` need not wait for it
    from torch import nn

PARAMS_ENV = "STOKER_SIMULATED_PARAMS"
BATCH_SIZE = 16
IMAGE_SIZE = 32


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("scaling", help="speed-up with N consumers on simulated devices; cost model")
    parser.add_argument("--devices", type=_int_list, default=[1, 2, 4, 8], help="consumer counts, e.g. 1,2,4,8")
    parser.add_argument("--sync-every", type=_int_list, default=[1, 8], help="averaging periods H, e.g. 1,8")
    parser.add_argument("--params", type=lambda v: int(float(v)), default=1_000_000, help="model parameters")
    parser.add_argument("--step-ms", type=float, default=200.0, help="simulated device time per step")
    parser.add_argument("--steps", type=int, default=32, help="steps per consumer per run (the last half timed)")
    parser.add_argument("--producers", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=1, help="runs per point; the median-throughput one is shown")
    parser.add_argument("--overlap", action="store_true", help="also run each N > 1 point with overlapped averaging")
    parser.add_argument("--model-only", action="store_true", help="predict with the cost model; run nothing")
    parser.add_argument("--bandwidth", type=float, default=10.0, help="--model-only: link bandwidth, GB/s")
    parser.add_argument("--latency-us", type=float, default=10.0, help="--model-only: per-message latency")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--plot", type=Path, help="write speed-up against N as a PNG")
    parser.set_defaults(run=run)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    result = predict(args) if args.model_only else measure(args)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(result, args.plot)
    return 0


# ---- the simulated device ------------------------------------------------------------------------------------

def simulated_model(num_classes: int) -> nn.Module:
    """A tiny classifier plus parameters that make the model `STOKER_SIMULATED_PARAMS` large: they take no part
    in the forward pass (the device time is the sleep) but are averaged like any other."""
    from stoker.bench.simulated import SimulatedModel

    return SimulatedModel(num_classes, int(os.environ.get(PARAMS_ENV, "1000000")))


# ---- measured runs -------------------------------------------------------------------------------------------

def measure(args: argparse.Namespace) -> dict[str, Any]:
    os.environ[faults.STEP_TIME_ENV] = str(args.step_ms)
    os.environ[PARAMS_ENV] = str(args.params)
    runs = []
    with tempfile.TemporaryDirectory(prefix="stoker-scaling-") as scratch:
        root = Path(scratch)
        per_class = -(-max(args.devices) * BATCH_SIZE * args.steps // 10)
        builtin_data.generate(root / "all", train_per_class=per_class, val_per_class=1)
        modes = [False, True] if args.overlap else [False]
        grid = [(n, h, overlap) for n in sorted(set(args.devices)) for h in (args.sync_every if n > 1 else [1])
                for overlap in (modes if n > 1 else [False])]
        bare = {n: bare_allreduce_ms(n, args.params) for n in sorted(set(args.devices)) if n > 1}
        with waiting("bench scaling", total=len(grid) * args.repeats, unit="runs") as progress:
            for devices, sync_every, overlap in grid:
                data = _subset(root, devices * BATCH_SIZE * args.steps)
                rows = []
                for repeat in range(args.repeats):
                    rows.append(_one_run(root / f"run-{devices}-{sync_every}-{overlap}-{repeat}", data,
                                         root / "all" / "val", devices, sync_every, overlap, bare.get(devices, 0.0),
                                         args))
                    progress.advance()
                runs.append(sorted(rows, key=lambda row: row["samples_per_s"])[len(rows) // 2])
    base = next(r for r in runs if r["devices"] == 1)["samples_per_s"]
    for row in runs:
        row["speedup"] = round(row["samples_per_s"] / base, 3)
        row["efficiency"] = round(row["speedup"] / row["devices"], 3)
    return {"runs": runs, "bare_allreduce_ms": bare, "batch_size": BATCH_SIZE, "image_size": IMAGE_SIZE,
            "repeats": args.repeats, "cores": os.cpu_count()}


def _one_run(out: Path, data: Path, val: Path, devices: int, sync_every: int, overlap: bool, allreduce_ms: float,
             args: argparse.Namespace) -> dict[str, Any]:
    import stoker

    summary = stoker.train(data=data, val=val, devices=f"cpu:{devices}", model=f"{__name__}:simulated_model",
                           image_size=IMAGE_SIZE, batch_size=BATCH_SIZE, epochs=1, sync_every=sync_every,
                           overlap_averaging=overlap, producers=args.producers, max_producers=args.producers,
                           seed=0, out=out, show_progress=False, report=False)
    return {"devices": devices, "sync_every": sync_every, "overlap": overlap, "params": args.params,
            "step_ms": args.step_ms, "status": summary["status"],
            **steady_state(out / "metrics.jsonl", devices, allreduce_ms, sync_every)}


def _subset(root: Path, images: int) -> Path:
    """An ImageFolder of exactly `images` training files (classes in turn), as hard links: every step of the run
    is a full batch on every consumer."""
    target = root / f"train-{images}"
    if not target.exists():
        files = sorted((root / "all" / "train").glob("*/*"), key=lambda path: (path.stem, path.parent.name))
        for source in files[:images]:
            link = target / source.parent.name / source.name
            link.parent.mkdir(parents=True, exist_ok=True)
            os.link(source, link)
    return target


def steady_state(metrics: Path, devices: int, allreduce_ms: float, sync_every: int) -> dict[str, Any]:
    """Throughput and the per-step split over the second half of the run's steps. Device time is the measured
    step: the sleep plus the small model's forward, backward and optimizer step, which a GPU would run."""
    steps = read_events(metrics)["step"]
    last_step = max(r["global_step"] for r in steps)
    late = [r for r in steps if r["global_step"] >= last_step // 2]
    rank0 = [r for r in late if r["rank"] == 0]
    wall_ms = 1000 * (rank0[-1]["t"] - rank0[0]["t"]) / max(1, len(rank0) - 1)
    split = {key: 1000 * statistics.fmean(r[key] for r in late) for key in ("compute_s", "wait_s", "averaging_s")}
    other = wall_ms - split["compute_s"] - split["wait_s"] - split["averaging_s"]
    overhead = wall_ms - split["compute_s"] - allreduce_ms / sync_every
    return {"samples_per_s": round(devices * BATCH_SIZE * 1000 / wall_ms, 2), "wall_ms": round(wall_ms, 2),
            "device_ms": round(split["compute_s"], 2), "input_wait_ms": round(split["wait_s"], 2),
            "averaging_ms": round(split["averaging_s"], 2), "other_ms": round(other, 2),
            "overhead_fraction": round(overhead / wall_ms, 4),
            "input_stall_fraction": round(split["wait_s"] / wall_ms, 4)}


def bare_allreduce_ms(processes: int, params: int, repeats: int = 20) -> float:
    """Median time of one all_reduce of `params` float32 among `processes` gloo processes, nothing else."""
    return run_group(_time_allreduce, processes, (params, repeats), timeout_s=120)


def _time_allreduce(rank: int, world: int, params: int, repeats: int) -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.ones(params)
    times = []
    for _ in range(repeats + 2):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - started)
    return round(1000 * statistics.median(times[2:]), 3)


# ---- cost model ----------------------------------------------------------------------------------------------

def ring_allreduce_ms(devices: int, nbytes: float, bandwidth_gb_s: float, latency_us: float) -> float:
    if devices == 1:
        return 0.0
    transfer = 2 * (devices - 1) / devices * nbytes / (bandwidth_gb_s * 1e9)
    return 1000 * (transfer + 2 * (devices - 1) * latency_us * 1e-6)


def predict(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for devices in args.devices:
        for sync_every in args.sync_every:
            cost = ring_allreduce_ms(devices, 4 * args.params, args.bandwidth, args.latency_us)
            wall = args.step_ms + cost / sync_every
            speedup = devices * args.step_ms / wall
            runs.append({"devices": devices, "sync_every": sync_every, "params": args.params,
                         "step_ms": args.step_ms, "allreduce_ms": round(cost, 3), "wall_ms": round(wall, 3),
                         "speedup": round(speedup, 2), "efficiency": round(speedup / devices, 4),
                         "overhead_fraction": round(1 - args.step_ms / wall, 4), "input_stall_fraction": 0.0})
    return {"runs": runs, "model": {"bandwidth_gb_s": args.bandwidth, "latency_us": args.latency_us,
                                    "formula": "2(N-1)/N x bytes / bandwidth + 2(N-1) x latency"}}


# ---- output --------------------------------------------------------------------------------------------------

def print_table(result: dict[str, Any]) -> None:
    measured = "model" not in result
    header = f"{'N':>5} {'H':>3} {'averaging':>10} {'speed-up':>9} {'effic.':>7} {'step ms':>8}"
    if measured:
        header += f" {'device':>7} {'input':>6} {'averag.':>8} {'other':>6} {'overhead':>9}"
    else:
        header += f" {'allreduce ms':>13}"
    print(header)
    for row in result["runs"]:
        mode = "overlapped" if row.get("overlap") else "blocking"
        line = (f"{row['devices']:>5} {row['sync_every']:>3} {mode:>10} {row['speedup']:>9.2f} "
                f"{row['efficiency']:>7.1%} {row['wall_ms']:>8.1f}")
        if measured:
            line += (f" {row['device_ms']:>7.1f} {row['input_wait_ms']:>6.1f} {row['averaging_ms']:>8.1f} "
                     f"{row['other_ms']:>6.1f} {row['overhead_fraction']:>9.2%}")
            if row["input_stall_fraction"] > 0.05:
                line += "  input-starved"
        else:
            line += f" {row['allreduce_ms']:>13.2f}"
        print(line)
    if measured:
        bare = ", ".join(f"N={n}: {ms:.2f} ms" for n, ms in result["bare_allreduce_ms"].items())
        print(f"bare all_reduce of the same bytes, measured alone: {bare}")
        print("overhead = wall - device time - bare all_reduce / H, as a share of the step")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 4))
    counts = sorted({r["devices"] for r in result["runs"]})
    axes.plot(counts, counts, "k--", label="ideal")
    for sync_every, overlap in sorted({(r["sync_every"], r.get("overlap", False)) for r in result["runs"]
                                       if r["devices"] > 1}):
        rows = sorted((r for r in result["runs"] if r["devices"] == 1 or (
            r["sync_every"] == sync_every and r.get("overlap", False) == overlap)), key=lambda r: r["devices"])
        label = f"--sync-every {sync_every}" + (", overlapped" if overlap else "")
        axes.plot([r["devices"] for r in rows], [r["speedup"] for r in rows], "o-", label=label)
    axes.set_xlabel("consumers N")
    axes.set_ylabel("speed-up over N=1")
    axes.set_title("stoker scaling" + (" (cost model)" if "model" in result else " (simulated devices)"))
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

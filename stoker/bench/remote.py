"""`stoker bench remote`: training from shards streamed over HTTP with added round-trip latency, against the same
shards on local disk, side by side in one run.

The built-in texture set is packed into 8 shards and served by nginx on loopback. Each `--latencies` round trip is
added by one of two stand-ins for a network (this kernel has no netem), each run as its own row:
- `proxy`: a proxy in front of nginx holds every request for the round trip. It is a Python process on the cores
  training uses: its CPU is a cost a real network does not put on the training machine;
- `reader`: every request waits the round trip before it is sent (`STOKER_READ_LATENCY_MS`, a timer in the
  producer's request client), then goes to nginx directly: no CPU but the requests' own.
A row of plain HTTP (no latency added, no stand-in) shows what the requests themselves cost. Each repeat runs
`stoker train` once per row, in turn (each repeat starting one row later), with the producer count auto picks; the
table shows the median throughput from the first step on (summary.json's, validation excluded), streamed / local,
and the range over the runs of the most producers auto ran in each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from stoker.bench import servers
from stoker.bench.runs import run_child
from stoker.common import faults
from stoker.data.formats import builtin_data

SHARDS = 8
STAND_INS = ("proxy", "reader")


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("remote", help="shards over HTTP with added latency against local disk")
    parser.add_argument("--latencies", type=_latencies, default=[25.0, 100.0],
                        help="added round trips in ms, comma-separated (default 25,100)")
    parser.add_argument("--stand-ins", type=_stand_ins, default=list(STAND_INS),
                        help="what adds the latency: proxy (a process in front of the server), reader (a wait before "
                             "each request); comma-separated (default both)")
    parser.add_argument("--repeats", type=_positive, default=3, help="runs of each (median counts)")
    parser.add_argument("--per-class", type=_positive, default=300, help="training images per class (10 classes)")
    parser.add_argument("--epochs", type=_positive, default=2)
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.set_defaults(run=run)


def _latencies(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated milliseconds, got {text!r}") from None
    if not values or any(not (0 < value < math.inf) for value in values):
        raise argparse.ArgumentTypeError(f"expected round trips above 0 ms, got {text!r}")
    return list(dict.fromkeys(values))


def _stand_ins(text: str) -> list[str]:
    values = [part for part in text.split(",") if part]
    if not values or set(values) - set(STAND_INS):
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(STAND_INS)}, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="stoker-bench-remote-") as scratch, contextlib.ExitStack() as servers_up:
        root = Path(scratch)
        pattern = _pack(root, args.per_class)
        web = servers_up.enter_context(servers.nginx(root))
        proxies = {ms: servers_up.enter_context(servers.latency_proxy(web.port, ms)) for ms in args.latencies} \
            if "proxy" in args.stand_ins else {}
        sources = _sources(root, pattern, web.url, proxies, args.latencies, args.stand_ins)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sources}
        names, order = list(sources), []
        for repeat in range(args.repeats):
            # Each repeat starts one row later: no row always runs first, on a machine just quiet, or last.
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                data, env = sources[name]
                result = _train(root, data, env, args.epochs, f"{name}-{repeat}")
                runs[name].append(result)
                order.append(name)
                print(f"  {name:>18}  run {repeat + 1}: {result['samples_per_s']:8.1f} samples/s, "
                      f"at most {result['producers_max']} producers", flush=True)
    rows = _rows(runs)
    _print(rows)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "runs": runs, "epochs": args.epochs,
                                         "images": 10 * args.per_class, "latencies_ms": args.latencies,
                                         "stand_ins": args.stand_ins, "repeats": args.repeats, "order": order,
                                         "commit": _commit()}, indent=2))
    return 0


def _commit() -> str | None:
    """The code measured, where it is a git checkout."""
    try:
        return subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _sources(root: Path, pattern: str, web: str, proxies: dict[float, servers.Server], latencies: list[float],
             stand_ins: list[str]) -> dict[str, tuple[str, dict[str, str]]]:
    """Each row's --data and the environment it runs in (no row inherits a wait set in the caller's shell)."""
    url = f"/train/{pattern}"
    none = {faults.READ_LATENCY_ENV: "0"}
    sources: dict[str, tuple[str, dict[str, str]]] = {"local": (str(root / "train" / pattern), none),
                                                      "HTTP": (web + url, none)}
    for ms in latencies:
        if "proxy" in stand_ins:
            sources[f"{ms:g} ms (proxy)"] = (proxies[ms].url + url, none)
        if "reader" in stand_ins:
            sources[f"{ms:g} ms (reader)"] = (web + url, {faults.READ_LATENCY_ENV: f"{ms:g}"})
    return sources


def _pack(root: Path, per_class: int) -> str:
    """The built-in textures packed into SHARDS shards; the brace pattern that names them."""
    builtin_data.generate(root / "folder", train_per_class=per_class, val_per_class=10)
    # Each image is a header, its bytes in 512-byte blocks, and a .cls member (a header and a block).
    tar_bytes = sum(1536 + -(-p.stat().st_size // 512) * 512 for p in (root / "folder" / "train").rglob("*.jpg"))
    _stoker("pack", str(root / "folder" / "train"), str(root / "train"), "--shard-size",
            str(-(-tar_bytes // SHARDS) + 512))
    names = sorted(p.name for p in (root / "train").glob("*.tar"))
    return f"shard-{{{names[0][6:12]}..{names[-1][6:12]}}}.tar"


def _train(root: Path, data: str, env: dict[str, str], epochs: int, name: str) -> dict[str, Any]:
    out = root / "runs" / name
    _stoker("train", "--data", data, "--val-fraction", "0", "--image-size", "32", "--epochs", str(epochs),
            "--out", str(out), "--quiet", "--report", "false", env={"STOKER_CACHE": str(root / "cache"), **env})
    summary = json.loads((out / "summary.json").read_text())
    return {"samples_per_s": float(summary["throughput_samples_per_s"]), "producers_max": int(summary["producers_max"])}


def _stoker(*args: str, env: dict[str, str] | None = None) -> None:
    result = run_child([sys.executable, "-m", "stoker", *args], env={**os.environ, **(env or {})})
    if result.returncode != 0:
        raise RuntimeError(f"stoker {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}")


def _rows(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    local = statistics.median(run["samples_per_s"] for run in runs["local"])
    rows = []
    for name, results in runs.items():
        rate = statistics.median(run["samples_per_s"] for run in results)
        counts = [run["producers_max"] for run in results]
        rows.append({"source": name, "samples_per_s": round(rate, 1),
                     "over_local": round(rate / local, 3) if local else 0.0,
                     "producers_max": [min(counts), max(counts)]})  # each run's most, over the runs
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'source':>18}  {'samples/s':>10}  {'/ local':>8}  {'producers':>9}")
    for row in rows:
        fewest, most = row["producers_max"]
        print(f"{row['source']:>18}  {row['samples_per_s']:>10.1f}  {row['over_local']:>8.3f}  "
              f"{f'{fewest}-{most}' if fewest != most else str(most):>9}")

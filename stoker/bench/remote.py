"""`stoker bench remote`: training from shards streamed over HTTP with added round-trip latency, against the same
shards on local disk, side by side in one run.

The built-in texture set is packed into 8 shards and served by nginx on loopback. Each `--latencies` round trip is
added by one of two stand-ins for a network (this kernel has no netem), each run as its own row:
- `proxy`: a proxy in front of nginx holds every request for the round trip. It is a Python process on the cores
  training uses: its CPU is a cost a real network does not put on the training machine;
- `reader`: every request waits the round trip in the thread that sends it (`STOKER_READ_LATENCY_MS`), then goes
  to nginx directly: no CPU but the requests' own.
A row of plain HTTP (no latency added, no stand-in) shows what the requests themselves cost. Each repeat runs
`stoker train` once per row, in turn, with the producer count auto picks; the table shows the median whole-run
throughput (summary.json's, validation excluded), streamed / local and the most producers auto ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from stoker.bench import servers
from stoker.common import faults
from stoker.data import builtin_data

SHARDS = 8
STAND_INS = ("proxy", "reader")


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("remote", help="shards over HTTP with added latency against local disk")
    parser.add_argument("--latencies", default="25,100", help="added round trips in ms, comma-separated")
    parser.add_argument("--stand-ins", default=",".join(STAND_INS),
                        help="what adds the latency: proxy (a process in front of the server), reader (a wait before "
                             "each request); comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each (median counts)")
    parser.add_argument("--per-class", type=int, default=300, help="training images per class (10 classes)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    latencies = [float(x) for x in args.latencies.split(",") if x]
    stand_ins = [x for x in args.stand_ins.split(",") if x]
    if unknown := set(stand_ins) - set(STAND_INS):
        raise SystemExit(f"--stand-ins: {', '.join(sorted(unknown))}: expected some of {', '.join(STAND_INS)}")
    with tempfile.TemporaryDirectory(prefix="stoker-bench-remote-") as scratch:
        root = Path(scratch)
        pattern = _pack(root, args.per_class)
        runs: dict[str, list[dict[str, float]]] = {}
        with servers.nginx(root) as web:
            proxies = {ms: servers.latency_proxy(web.port, ms) for ms in latencies} if "proxy" in stand_ins else {}
            try:
                sources = _sources(root, pattern, web.url, proxies, latencies, stand_ins)
                for repeat in range(args.repeats):
                    for name, (data, env) in sources.items():
                        result = _train(root, data, env, args.epochs, f"{name}-{repeat}")
                        runs.setdefault(name, []).append(result)
                        print(f"  {name:>18}  run {repeat + 1}: {result['samples_per_s']:8.1f} samples/s, "
                              f"at most {result['producers_max']:.0f} producers", flush=True)
            finally:
                for proxy in proxies.values():
                    proxy.close()
    rows = _rows(runs)
    _print(rows)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "runs": runs, "epochs": args.epochs,
                                         "images": 10 * args.per_class}, indent=2))
    return 0


def _sources(root: Path, pattern: str, web: str, proxies: dict[float, servers.Server], latencies: list[float],
             stand_ins: list[str]) -> dict[str, tuple[str, dict[str, str]]]:
    """Each row's --data and the environment it runs in."""
    url = f"/train/{pattern}"
    sources: dict[str, tuple[str, dict[str, str]]] = {"local": (str(root / "train" / pattern), {}),
                                                      "HTTP": (web + url, {})}
    for ms in latencies:
        if "proxy" in stand_ins:
            sources[f"{ms:g} ms (proxy)"] = (proxies[ms].url + url, {})
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


def _train(root: Path, data: str, env: dict[str, str], epochs: int, name: str) -> dict[str, float]:
    out = root / "runs" / name
    _stoker("train", "--data", data, "--val-fraction", "0", "--image-size", "32", "--epochs", str(epochs),
            "--out", str(out), "--quiet", "--report", "false", env={"STOKER_CACHE": str(root / "cache"), **env})
    summary = json.loads((out / "summary.json").read_text())
    return {"samples_per_s": float(summary["throughput_samples_per_s"]),
            "producers_max": float(summary["producers_max"])}


def _stoker(*args: str, env: dict[str, str] | None = None) -> None:
    result = subprocess.run([sys.executable, "-m", "stoker", *args], capture_output=True, text=True,
                            env={**os.environ, **(env or {})})
    if result.returncode != 0:
        raise RuntimeError(f"stoker {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}")


def _rows(runs: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    local = statistics.median(run["samples_per_s"] for run in runs["local"])
    rows = []
    for name, results in runs.items():
        rate = statistics.median(run["samples_per_s"] for run in results)
        rows.append({"source": name, "samples_per_s": round(rate, 1),
                     "over_local": round(rate / local, 3) if local else 0.0,
                     "producers_max": max(int(run["producers_max"]) for run in results)})
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'source':>18}  {'samples/s':>10}  {'/ local':>8}  {'producers':>9}")
    for row in rows:
        print(f"{row['source']:>18}  {row['samples_per_s']:>10.1f}  {row['over_local']:>8.3f}  "
              f"{row['producers_max']:>9}")

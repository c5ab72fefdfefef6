"""`stoker bench remote`: training from shards streamed over HTTP with added round-trip latency, against the same
shards on local disk, side by side in one run.

The built-in texture set is packed into 8 shards and served by nginx on loopback; a proxy in front of it adds each
`--latencies` round trip (this kernel has no netem). Each repeat runs `stoker train` once from local disk and once
through each proxy, in turn, with the producer count auto picks; the table shows the median whole-run throughput
(summary.json's, validation excluded) and streamed / local.
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
from stoker.data import builtin_data

SHARDS = 8


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("remote", help="shards over HTTP with added latency against local disk")
    parser.add_argument("--latencies", default="25,100", help="added round trips in ms, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each (median counts)")
    parser.add_argument("--per-class", type=int, default=300, help="training images per class (10 classes)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    latencies = [float(x) for x in args.latencies.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="stoker-bench-remote-") as scratch:
        root = Path(scratch)
        pattern = _pack(root, args.per_class)
        rates: dict[str, list[float]] = {}
        with servers.nginx(root) as web:
            proxies = {ms: servers.latency_proxy(web.port, ms) for ms in latencies}
            try:
                for repeat in range(args.repeats):
                    sources = {"local": str(root / "train" / pattern)}
                    sources.update({f"{ms:g} ms": f"{proxy.url}/train/{pattern}" for ms, proxy in proxies.items()})
                    for name, data in sources.items():
                        rate = _train(root, data, args.epochs, f"{name}-{repeat}")
                        rates.setdefault(name, []).append(rate)
                        print(f"  {name:>8}  run {repeat + 1}: {rate:8.1f} samples/s", flush=True)
            finally:
                for proxy in proxies.values():
                    proxy.close()
    rows = _rows(rates)
    _print(rows)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "runs": rates, "epochs": args.epochs,
                                         "images": 10 * args.per_class}, indent=2))
    return 0


def _pack(root: Path, per_class: int) -> str:
    """The built-in textures packed into SHARDS shards; the brace pattern that names them."""
    builtin_data.generate(root / "folder", train_per_class=per_class, val_per_class=10)
    # Each image is a header, its bytes in 512-byte blocks, and a .cls member (a header and a block).
    tar_bytes = sum(1536 + -(-p.stat().st_size // 512) * 512 for p in (root / "folder" / "train").rglob("*.jpg"))
    _stoker("pack", str(root / "folder" / "train"), str(root / "train"), "--shard-size",
            str(-(-tar_bytes // SHARDS) + 512))
    names = sorted(p.name for p in (root / "train").glob("*.tar"))
    return f"shard-{{{names[0][6:12]}..{names[-1][6:12]}}}.tar"


def _train(root: Path, data: str, epochs: int, name: str) -> float:
    out = root / "runs" / name
    _stoker("train", "--data", data, "--val-fraction", "0", "--image-size", "32", "--epochs", str(epochs),
            "--out", str(out), "--quiet",
            "--report", "false", env={"STOKER_CACHE": str(root / "cache")})
    return float(json.loads((out / "summary.json").read_text())["throughput_samples_per_s"])


def _stoker(*args: str, env: dict[str, str] | None = None) -> None:
    result = subprocess.run([sys.executable, "-m", "stoker", *args], capture_output=True, text=True,
                            env={**os.environ, **(env or {})})
    if result.returncode != 0:
        raise RuntimeError(f"stoker {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}")


def _rows(rates: dict[str, list[float]]) -> list[dict[str, Any]]:
    local = statistics.median(rates["local"])
    return [{"source": name, "samples_per_s": round(statistics.median(runs), 1),
             "over_local": round(statistics.median(runs) / local, 3) if local else 0.0} for name, runs in rates.items()]


def _print(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'source':>10}  {'samples/s':>10}  {'/ local':>8}")
    for row in rows:
        print(f"{row['source']:>10}  {row['samples_per_s']:>10.1f}  {row['over_local']:>8.3f}")

"""`stoker bench start`: how long a producer takes from its start to its first part done, forked from the zygote
against spawned as a new interpreter (what every producer was before the zygote), side by side in one run.

The zygote is started once before the timings, as a run starts it with its first producer: what is timed is a
producer the autoscaler adds. For each count N, N producers are started at once (the autoscaler's jump) into a
real ring, each given one part of `--batch-size` built-in JPEGs as soon as it exists, and timed from the first
start to each one's part done. Both ways alternate within every repeat; the table shows medians over the repeats
of the median and the slowest producer, and the ratio spawn / zygote.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from stoker.common import zygote
from stoker.common.procs import CONTEXT, Mailbox
from stoker.data.formats import builtin_data
from stoker.data.index import load_image_folder
from stoker.pipeline.plan import BatchPlan
from stoker.pipeline.pool import ProducerPool, StartMethod
from stoker.pipeline.producer import Part, PartDone, ProducerSetup, Source
from stoker.pipeline.ring import SlotRing

METHODS: tuple[StartMethod, ...] = ("spawn", "zygote")


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("start", help="producer start to first part done: the zygote against spawn")
    parser.add_argument("--counts", default="1,4,16", help="producers started at once, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each (median counts)")
    parser.add_argument("--batch-size", type=int, default=8, help="images in each producer's first part")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    counts = [int(c) for c in args.counts.split(",")]
    with tempfile.TemporaryDirectory(prefix="stoker-bench-start-") as scratch:
        builtin_data.generate(Path(scratch), train_per_class=8, val_per_class=1)
        index = load_image_folder(Path(scratch) / "train")
        source = Source(tuple(index.paths), np.asarray(index.labels))
        runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
        with zygote.PRODUCERS.acquire():  # started once, as in a run: these are the producers the autoscaler adds
            for _ in range(args.repeats):
                for count in counts:
                    for method in METHODS:
                        runs.setdefault((method, count), []).append(
                            time_starts(source, count, args.batch_size, method))
    rows = [_row(count, runs) for count in counts]
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({"repeats": args.repeats, "rows": rows}, indent=2) + "\n")
    return 0


def time_starts(source: Source, count: int, batch_size: int, method: StartMethod) -> tuple[float, float]:
    """(median, slowest) seconds from the first start to a producer's first part done, over `count` producers."""
    ring = SlotRing.create(count, batch_size, 32, count, samples=(len(source.labels), 0))
    mailbox, stop = Mailbox(), CONTEXT.Event()
    setup = ProducerSetup(ring.spec, source, None, "standard", 0)
    pool = ProducerPool(setup, ring, mailbox, stop, count, producer_timeout_s=60, start_method=method)
    try:
        started = time.perf_counter()
        for slot in range(count):
            pool.grow()
            ids = np.arange(slot * batch_size, (slot + 1) * batch_size) % len(source.labels)
            pool.assign(Part(slot, BatchPlan("train", 0, slot, 0, ids, batch_size), slot, {}))
        done: list[float] = []
        while len(done) < count:
            messages = mailbox.receive(timeout_s=60)
            if not messages:
                raise RuntimeError(f"{count - len(done)} of {count} producers did not finish a part in 60 s")
            for message in messages:
                if not isinstance(message, PartDone):
                    raise RuntimeError(f"a producer failed: {message}")
                pool.finished(message)
                done.append(time.perf_counter() - started)
        return statistics.median(done), max(done)
    finally:
        stop.set()
        pool.close()
        mailbox.close()
        ring.close()


def _row(count: int, runs: dict[tuple[str, int], list[tuple[float, float]]]) -> dict[str, Any]:
    row: dict[str, Any] = {"producers": count}
    for method in METHODS:
        row[f"{method}_median_s"] = round(statistics.median(m for m, _ in runs[(method, count)]), 4)
        row[f"{method}_slowest_s"] = round(statistics.median(s for _, s in runs[(method, count)]), 4)
    row["ratio_median"] = round(row["spawn_median_s"] / row["zygote_median_s"], 1)
    row["ratio_slowest"] = round(row["spawn_slowest_s"] / row["zygote_slowest_s"], 1)
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'producers':>9}  {'spawn median':>12}  {'zygote median':>13}  {'ratio':>6}  {'spawn slowest':>13}  "
          f"{'zygote slowest':>14}  {'ratio':>6}")
    for row in rows:
        print(f"{row['producers']:>9}  {row['spawn_median_s']:>11.3f}s  {row['zygote_median_s']:>12.3f}s  "
              f"{row['ratio_median']:>5.1f}x  {row['spawn_slowest_s']:>12.3f}s  {row['zygote_slowest_s']:>13.3f}s  "
              f"{row['ratio_slowest']:>5.1f}x")

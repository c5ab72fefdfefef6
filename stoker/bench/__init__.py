"""`stoker bench ...`: benchmarks that print a table and write --json FILE."""

from __future__ import annotations

import argparse


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    from stoker.bench import (
        anchors,
        autoscale,
        data,
        decode,
        elastic,
        finetune,
        gpu,
        loader,
        pipeline,
        remote,
        scaling,
        soak,
        start,
        sync,
    )

    bench = commands.add_parser("bench", help="benchmarks (each prints a table and writes --json FILE)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    anchors.add_parser(kinds)
    autoscale.add_parser(kinds)
    data.add_parser(kinds)
    decode.add_parser(kinds)
    elastic.add_parser(kinds)
    finetune.add_parser(kinds)
    gpu.add_parser(kinds)
    loader.add_parser(kinds)
    pipeline.add_parser(kinds)
    remote.add_parser(kinds)
    start.add_parser(kinds)
    scaling.add_parser(kinds)
    soak.add_parser(kinds)
    sync.add_parser(kinds)

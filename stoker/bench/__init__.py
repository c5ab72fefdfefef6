"""`stoker bench ...`: benchmarks that print a table and write --json FILE."""

from __future__ import annotations

import argparse
import signal
import subprocess
from collections.abc import Sequence
from typing import Any


class RunInterrupted(KeyboardInterrupt):
    """A run the benchmark started was stopped by Ctrl-C or SIGTERM, which reach its controller first."""

    signal_name = "the signal that stopped its run"


def stop_child(process: subprocess.Popen, grace_s: float = 60.0) -> None:
    """Stop a stoker command the benchmark started as SIGTERM stops it, through its own cleanup (SIGINT may be
    ignored: a background job's children inherit that); killed where it has not ended after `grace_s`."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_child(command: Sequence[str], timeout_s: float | None = None,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run` of a stoker command, its stdout discarded and its stderr kept as text; on a timeout or an
    interrupt it is stopped by `stop_child`, where `subprocess.run` kills it (a SIGKILLed run leaves its shared
    memory to the next start's sweep)."""
    with subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as process:
        try:
            _, stderr = process.communicate(timeout=timeout_s)
        except BaseException:
            stop_child(process)
            raise
    return subprocess.CompletedProcess(command, process.returncode, None, stderr)


def completed_run(summary: dict[str, Any], what: str) -> dict[str, Any]:
    """A run's summary where it completed. An interrupted one stops the benchmark as the signal stops any command;
    a failed one stops it with its error in one line (exit 1)."""
    if summary["status"] == "interrupted":
        raise RunInterrupted()
    if summary["status"] != "completed":
        raise SystemExit(f"stoker bench: {what}: its run ended {summary['status']}: {summary.get('error')}")
    return summary


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

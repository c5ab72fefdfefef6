"""How a benchmark runs stoker: a child command stopped through its own cleanup, and a run's summary taken only
where the run completed."""

from __future__ import annotations

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

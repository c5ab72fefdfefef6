"""How a benchmark runs stoker: a child command stopped through its own cleanup, and a run's summary taken only
where the run completed."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any


class RunInterrupted(KeyboardInterrupt):
    """A run the benchmark started was stopped by Ctrl-C or SIGTERM, which reach its controller first."""

    signal_name = "the signal that stopped its run"


class RunFailed(RuntimeError):
    """A run the benchmark started ended failed; the command says so in one line (exit 1)."""


# A child's way out, within a scheduler's grace (Slurm's KillWait and Kubernetes' are 30 s, docker stop's 10 s): a
# moment to end on the signal that reached its whole group, SIGTERM (a stoker train: the prepared steps and a
# checkpoint), SIGTERM again (stop now), then SIGKILL.
STOP_STEPS = ((2.0, signal.SIGTERM), (5.0, signal.SIGTERM), (8.0, signal.SIGKILL))


def stop_child(process: subprocess.Popen, group_signalled: bool = True) -> None:
    """Stop a stoker command the benchmark started through its own cleanup (SIGTERM: SIGINT may be ignored, as a
    background job's children inherit it), killed where it has not ended by STOP_STEPS' last; killed at once if
    this process is told to stop meanwhile. `group_signalled`: the benchmark is being stopped, so the child may
    have had the same signal and gets STOP_STEPS' first moment to end on it; otherwise its SIGTERM comes at once."""
    stop_children([process], group_signalled)


def stop_children(processes: Sequence[subprocess.Popen], group_signalled: bool = True) -> None:
    """stop_child for several at once (the ranks of one run): each step's signal goes to every one still running
    before any is waited for, so a rank blocked in a collective with the others ends with them, within STOP_STEPS'
    15 s for all together."""
    steps = STOP_STEPS if group_signalled else STOP_STEPS[1:]
    try:
        if not group_signalled:
            _signal_running(processes, signal.SIGTERM)
        for wait_s, then in steps:
            if _all_ended_within(processes, wait_s):
                return
            _signal_running(processes, then)
        for process in processes:
            process.wait()
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def _signal_running(processes: Sequence[subprocess.Popen], number: signal.Signals) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(number)


def _all_ended_within(processes: Sequence[subprocess.Popen], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
    return True


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
    a failed one raises RunFailed (a benchmark that measures the other runs catches it)."""
    if summary["status"] == "interrupted":
        raise RunInterrupted()
    if summary["status"] != "completed":
        raise RunFailed(f"{what}: its run ended {summary['status']}: {summary.get('error')}")
    return summary

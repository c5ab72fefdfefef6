"""How a benchmark stops the stoker commands it starts, and what it makes of a run that did not complete."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from stoker.bench import runs

IGNORES_SIGTERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); "
                   "time.sleep(60)")
ENDS_ON_SIGTERM = "import time; print(flush=True); time.sleep(60)"


def _started(code: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child.stdout.readline()  # its handlers are set
    return child


def test_a_child_that_ends_on_sigterm_is_not_killed(monkeypatch):
    monkeypatch.setattr(runs, "STOP_STEPS", ((0.2, signal.SIGTERM), (5.0, signal.SIGTERM), (5.0, signal.SIGKILL)))
    child = _started(ENDS_ON_SIGTERM)
    runs.stop_child(child)
    assert child.returncode == -signal.SIGTERM


def test_a_child_the_benchmark_stops_itself_gets_sigterm_at_once(monkeypatch):
    """Not stopped by a signal to the group (the benchmark is done with it): no moment waited first, and no step
    here sends SIGTERM, so only the first signal can end it so."""
    monkeypatch.setattr(runs, "STOP_STEPS", ((30.0, signal.SIGKILL), (5.0, signal.SIGKILL), (5.0, signal.SIGKILL)))
    child = _started(ENDS_ON_SIGTERM)
    runs.stop_child(child, group_signalled=False)
    assert child.returncode == -signal.SIGTERM


def test_a_child_that_ignores_sigterm_is_killed_at_the_last_step(monkeypatch):
    monkeypatch.setattr(runs, "STOP_STEPS", ((0.2, signal.SIGTERM), (0.2, signal.SIGTERM), (0.2, signal.SIGKILL)))
    child = _started(IGNORES_SIGTERM)
    runs.stop_child(child)
    assert child.returncode == -signal.SIGKILL


def test_children_stopped_together_each_end_their_own_way(monkeypatch):
    """A run's ranks: the one that ends on SIGTERM does, the one that ignores it is killed, none is left."""
    monkeypatch.setattr(runs, "STOP_STEPS", ((30.0, signal.SIGKILL), (0.2, signal.SIGTERM), (0.2, signal.SIGKILL)))
    ignoring, ending = _started(IGNORES_SIGTERM), _started(ENDS_ON_SIGTERM)
    runs.stop_children([ignoring, ending], group_signalled=False)
    assert (ignoring.returncode, ending.returncode) == (-signal.SIGKILL, -signal.SIGTERM)


def test_a_run_that_did_not_complete_stops_or_fails_the_benchmark():
    assert runs.completed_run({"status": "completed"}, "m") == {"status": "completed"}
    with pytest.raises(KeyboardInterrupt):
        runs.completed_run({"status": "interrupted"}, "m")
    with pytest.raises(runs.RunFailed, match="^workload s, producers=2: its run ended failed: disk full$"):
        runs.completed_run({"status": "failed", "error": "disk full"}, "workload s, producers=2")

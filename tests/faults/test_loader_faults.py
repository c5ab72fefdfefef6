"""stoker.Loader under faults: a producer SIGKILLed mid-epoch, Ctrl-C in the user's loop, the user's process killed.
Every test ends with no stoker process and no segment left (conftest's leaves_no_trace)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import stoker
from stoker.pipeline.ring import sweep_dead_segments

HELPERS = Path(__file__).resolve().parent.parent / "helpers"


@pytest.mark.timeout(120)
def test_producer_killed_mid_epoch_every_sample_still_once(textures):
    train, _ = textures
    seen = []
    with stoker.Loader(train, batch_size=8, image_size=32, producers=2, device="cpu") as loader:
        for step, _ in enumerate(loader):
            seen.extend(loader.batch_ids.tolist())
            if step == 3:
                victim = next(iter(loader._engine.pool.handles.values())).process
                os.kill(victim.pid, signal.SIGKILL)
        summary = loader.summary()
    assert sorted(seen) == list(range(120))
    assert summary["duplicate_samples"] == summary["missing_samples"] == 0
    assert summary["epoch_accounting"][0]["consumed"] == 120


def _start_user_loop(train: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, str(HELPERS / "loader_idle.py"), str(train)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "training", process.stderr.read()[-3000:]
    return process


@pytest.mark.timeout(120)
def test_ctrl_c_in_the_users_loop_leaves_nothing(textures):
    process = _start_user_loop(textures[0])
    process.send_signal(signal.SIGINT)
    _, errors = process.communicate(timeout=60)
    assert "KeyboardInterrupt" in errors  # the user's loop saw it; the producers and the ring went with the process


@pytest.mark.timeout(120)
def test_the_users_process_killed_leaves_no_orphan(textures):
    process = _start_user_loop(textures[0])
    process.kill()
    process.communicate(timeout=60)
    sweep_dead_segments()  # what the next start does with a segment of a dead process (the ring's lock is gone)

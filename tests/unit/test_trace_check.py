"""The leave-no-trace check sees the stoker processes and segments this test session made, and only those: with
pytest-xdist two sessions run at once, and each must neither miss its own leftovers nor blame the other's."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from stoker.pipeline.ring import NAME_PREFIX, SHM_DIR
from tests.conftest import live_segments, stoker_processes


def test_a_titled_process_of_this_session_is_seen():
    # setproctitle writes the title over the process's environment unless SPT_NOENV is set: the session's mark,
    # read from /proc/PID/environ, would be gone, and every leftover process would pass unseen.
    child = subprocess.Popen([sys.executable, "-c", "import time; from stoker.common.procs import name_process; "
                              "name_process('stoker controller'); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(pid == child.pid for pid, _ in stoker_processes()):
            time.sleep(0.1)
        assert any(pid == child.pid for pid, _ in stoker_processes())
    finally:
        child.kill()
        child.wait(10)


@pytest.mark.serial  # plants a dead creator's segment: another session's check would see it too
def test_another_sessions_process_is_not_this_sessions_but_a_dead_creators_segment_is_a_leak():
    other = subprocess.Popen([sys.executable, "-c", "import time, setproctitle; "
                              "setproctitle.setproctitle('stoker consumer 7'); time.sleep(30)"],
                             env={k: v for k, v in os.environ.items() if k != "STOKER_TEST_SESSION"})
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    leaked = os.path.join(SHM_DIR, f"{NAME_PREFIX}{int(dead.stdout)}_0badf00d")
    theirs = os.path.join(SHM_DIR, f"{NAME_PREFIX}{other.pid}_0c0ffee0")
    try:
        time.sleep(1.0)
        for path in (leaked, theirs):
            with open(path, "wb") as handle:
                handle.write(b"\0" * 64)
        assert all(pid != other.pid for pid, _ in stoker_processes())
        segments = live_segments()
        assert os.path.basename(leaked) in segments and os.path.basename(theirs) not in segments, segments
    finally:
        other.kill()
        other.wait(10)
        for path in (leaked, theirs):
            if os.path.exists(path):
                os.remove(path)

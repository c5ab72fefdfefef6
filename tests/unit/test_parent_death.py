"""A child whose parent dies before the child asks the kernel to die with it still leaves, and knows the parent is
gone: the pack's workers and the producers ask only once their imports are done, which takes seconds under load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.conftest import ROOT


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_child_whose_parent_died_while_it_started_exits_and_sees_the_parent_gone(tmp_path):
    report, output = tmp_path / "watch", tmp_path / "output"
    with output.open("w") as sink:  # a file, not a pipe: the child holds what it inherits, and a pipe would wait
        parent = subprocess.run([sys.executable, "-m", "tests.helpers.orphans", str(report)], cwd=ROOT,
                                stdout=sink, stderr=subprocess.STDOUT, timeout=60)
    assert parent.returncode == -signal.SIGKILL, output.read_text()
    child = int(output.read_text().split()[0])
    try:
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the orphan outlived its parent"
        assert report.read_text() == "True"  # a ParentWatch made after the death still sees it
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)

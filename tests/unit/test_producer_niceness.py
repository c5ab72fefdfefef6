"""A producer runs below the consumers from the moment it exists: its imports, half a second of a core each, must
not take the cores from the consumers when auto starts several at once."""

from __future__ import annotations

import os
import subprocess
import sys

from stoker.pipeline.producer import PRODUCER_NICENESS, nice_producer


def test_a_new_process_is_niced_once_however_often_it_is_asked():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        before = os.getpriority(os.PRIO_PROCESS, child.pid)
        nice_producer(child.pid)  # by the pool, right after the start
        nice_producer(child.pid)  # by the producer itself: not nicer still
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == max(before, PRODUCER_NICENESS)
    finally:
        child.kill()
        child.wait(timeout=10)
    nice_producer(child.pid)  # gone: nothing to do, no error

"""`stoker bench loader`'s CPU count: a child's CPU time counts while it runs (from /proc) and after it was reaped
(the kernel's count for waited-for children), as a producer's or a DataLoader worker's does."""

from __future__ import annotations

import subprocess
import sys

from stoker.bench.loader import tree_cpu_s

BURN = ("import time\nwhile time.process_time() < 0.3: pass\nprint('burnt', flush=True)\n"
        "import sys\nsys.stdin.read()")  # burns 0.3 s of CPU, then waits (alive) until its stdin closes


def test_a_childs_cpu_counts_alive_and_after_it_was_reaped():
    before = tree_cpu_s()
    child = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "burnt\n"
    alive = tree_cpu_s() - before
    child.communicate(timeout=60)
    reaped = tree_cpu_s() - before
    assert 0.25 <= alive < 5, alive  # /proc counts in clock ticks (10 ms)
    assert alive <= reaped < alive + 1, (alive, reaped)

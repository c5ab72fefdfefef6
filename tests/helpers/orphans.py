"""A child that takes its parent's death before it asks to die with it: the race a child still importing loses."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

from stoker.common.procs import ParentWatch, exit_with_parent


def late_child(report: str) -> None:
    parent = mp.parent_process()
    assert parent is not None
    while os.getppid() == parent.pid:  # until we are re-parented: the parent is dead
        time.sleep(0.01)
    with open(report, "w") as handle:
        handle.write(str(ParentWatch().parent_gone()))
    exit_with_parent()
    time.sleep(60)  # what a pack worker does in effect: waits for work that will never come


def start_and_die(report: str) -> None:
    """The parent: starts `late_child`, says its pid, and is killed as the OOM killer would."""
    from stoker.common.procs import CONTEXT

    child = CONTEXT.Process(target=late_child, args=(report,))
    child.start()
    print(child.pid, flush=True)
    os.kill(os.getpid(), 9)


if __name__ == "__main__":
    start_and_die(sys.argv[1])

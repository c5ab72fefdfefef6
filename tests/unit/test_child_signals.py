"""Children start with SIGINT and SIGTERM blocked, the first one too: multiprocessing starts its resource tracker at
the first child's start and then unblocks both signals in the starting thread, whatever the mask was."""

from __future__ import annotations

import signal
import subprocess
import sys

# In a fresh interpreter: the test process's own tracker may already run. Each child writes its blocked-signal mask
# (SigBlk of /proc/self/status, in hex) when its target runs, before anything of its own unblocks them.
PROBE = """
from stoker.common.procs import CONTEXT, start

def report(writer):
    writer.send(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("SigBlk")))

if __name__ == "__main__":
    pipes = [CONTEXT.Pipe(duplex=False) for _ in range(2)]  # pipes, not a queue: its lock would start the tracker
    children = [start(report, (writer,), f"stoker producer {n}") for n, (_, writer) in enumerate(pipes)]
    print(*(reader.recv() for reader, _ in pipes))
    for child in children:
        child.join(30)
"""


def test_the_first_child_started_is_born_with_sigint_and_sigterm_blocked(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for mask in result.stdout.split():
        blocked = int(mask, 16)
        for signal_number in (signal.SIGINT, signal.SIGTERM):
            assert blocked & (1 << (signal_number - 1)), (mask, signal_number)

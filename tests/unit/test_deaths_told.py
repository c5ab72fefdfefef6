"""What the run says of a consumer's death (issue 53, item 1: "exited with code 0" and "0 consumer(s) left" beside
consumers_at_end 1)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from stoker.common.procs import CONTEXT, StokerRunError
from stoker.run.consumer_group import told_death
from stoker.run.membership import Membership


def _exit_quietly() -> None:
    """What a consumer does after it sent its ConsumerFailed: it returns, and its process exits with code 0."""


def _sleep() -> None:
    time.sleep(60)


def test_a_consumer_that_reported_its_error_failed_and_a_killed_one_was_killed():
    quiet, killed = CONTEXT.Process(target=_exit_quietly), CONTEXT.Process(target=_sleep)
    quiet.start(), killed.start()
    os.kill(killed.pid, signal.SIGKILL)
    quiet.join(120), killed.join(120)  # spawned: seconds on a loaded machine
    assert told_death(0, quiet, "RuntimeError: Wait timeout\ntrace") == \
        f"consumer 0 (pid {quiet.pid}) failed: RuntimeError: Wait timeout"
    assert told_death(2, killed, "stuck: its peers gave up") == \
        f"consumer 2 (pid {killed.pid}) killed by SIGKILL: stuck: its peers gave up"
    assert told_death(2, killed, None) == f"consumer 2 (pid {killed.pid}) killed by SIGKILL"


def test_a_death_below_min_consumers_counts_the_consumers_it_leaves():
    membership = Membership(["cpu"] * 3, mp.Value("i", 0), min_consumers=2, sync_every=1, timeout_s=60,
                            started=time.monotonic())
    assert membership.lose(1, "consumer 1 killed") is not None
    with pytest.raises(StokerRunError, match=r"1 consumer\(s\) left, fewer than min_consumers=2"):
        membership.lose(2, "consumer 2 killed")
    assert membership.members == [0]  # what summary.json's consumers_at_end reads

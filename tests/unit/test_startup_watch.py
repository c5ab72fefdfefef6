"""The controller's bound on a consumer's start-up, on a clock the test moves."""

from __future__ import annotations

import pytest

from stoker.run.startup_watch import StartupTimeout, StartupWatch
from stoker.training import startup


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_phase_may_last_twice_the_collective_timeout_and_the_one_that_outlasts_it_is_named():
    clock = Clock()
    watch = StartupWatch(collective_timeout_s=10, compile_allowance_s=600, clock=clock)
    watch.start(0)
    watch.start(1)
    clock.now += 19
    watch.check()  # the process start: 19 s of 20
    watch.reported(0, startup.STORE)
    watch.reported(1, startup.GROUP)
    clock.now += 19
    watch.check()  # each phase timed from its own start
    watch.reported(0, startup.STARTED)  # consumer 0 is ready for its first batch: no longer watched
    clock.now += 2
    with pytest.raises(StartupTimeout, match=r"consumer 1 never finished starting: it has been joining the process "
                                             r"group .* for 21 s, longer than twice --collective-timeout-s \(10 s\)"):
        watch.check()


def test_the_compile_phases_get_the_compile_allowance_on_top():
    clock = Clock()
    watch = StartupWatch(collective_timeout_s=10, compile_allowance_s=600, clock=clock)
    watch.start(0)
    watch.reported(0, startup.COMPILING)
    clock.now += 619
    watch.check()
    watch.reported(0, startup.PEERS_COMPILING)
    clock.now += 621
    with pytest.raises(StartupTimeout, match="waiting for the other consumers to compile for 621 s.*plus the "
                                             "compile allowance of 600 s"):
        watch.check()


def test_a_consumer_started_again_is_not_watched_here():
    """An elastic run's consumer started again joins at a regroup, which has its own deadline."""
    clock = Clock()
    watch = StartupWatch(collective_timeout_s=1, compile_allowance_s=0, clock=clock)
    watch.start(0)
    watch.reported(0, startup.STARTED)
    watch.reported(0, startup.STARTING)  # its restart reports as it starts
    clock.now += 100
    watch.check()

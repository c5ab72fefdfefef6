"""The live samples/s: from whole steps of every consumer, compared with the rate the steps' own counts and times
give (samples of a step over the time between a consumer's step ends, summed over consumers)."""

from __future__ import annotations

import numpy as np
import pytest

from stoker.observe.metrics import RunStats
from stoker.pipeline.messages import StepReport


def _report(rank: int, step: int, count: int) -> StepReport:
    return StepReport(rank, 0, step, step, count, 1.0, 0.0, 0.5, 0.0, np.arange(count), None)


def _run(periods: dict[int, float], counts: dict[int, int], until: float, offsets: dict[int, float]):
    """Step ends of every rank up to `until`, fed to RunStats in time order; yields (now, stats) after each."""
    stats = RunStats(num_consumers=len(periods), samples_per_epoch=10**6, steps_per_epoch=10**6)
    ends = sorted((offsets[rank] + k * period, rank, k) for rank, period in periods.items()
                  for k in range(1, int(until / period) + 1))
    for now, rank, step in ends:
        stats.record_step(_report(rank, step, counts[rank]), now)
        yield now, stats


@pytest.mark.parametrize("period", [7.0, 0.02])
def test_the_live_rate_is_the_steps_own_rate_whether_a_step_is_slower_or_faster_than_the_window(period):
    # Two ranks in lockstep, their reports 0.3 ms apart (seen at 224 px on CPU: 7 s a step, 302,243 samples/s shown
    # where 18 was true).
    true_rate = 2 * 64 / period
    shown = [stats.rate(now) for now, stats in _run({0: period, 1: period}, {0: 64, 1: 64}, 60.0,
                                                    {0: 0.0, 1: 0.0003})][4:]
    assert shown and all(rate == pytest.approx(true_rate, rel=0.02) for rate in shown)


def test_ranks_of_different_speeds_add_their_own_rates():
    true_rate = 32 / 0.5 + 64 / 3.0
    shown = [stats.rate(now) for now, stats in _run({0: 0.5, 1: 3.0}, {0: 32, 1: 64}, 40.0, {0: 0.0, 1: 0.1})][40:]
    assert all(rate == pytest.approx(true_rate, rel=0.05) for rate in shown)


def test_between_two_slow_steps_the_rate_holds_and_a_long_stall_reads_zero():
    *_, (now, stats) = _run({0: 7.0}, {0: 64}, 21.0, {0: 0.0})
    assert stats.rate(now + 6.9) == pytest.approx(64 / 7.0)  # the next step is still on its way
    assert stats.rate(now + 15.0) == 0.0  # no step for more than twice the step time: stalled


def test_the_first_step_alone_gives_no_rate():
    stats = RunStats(num_consumers=1, samples_per_epoch=100, steps_per_epoch=10)
    stats.record_step(_report(0, 0, 64), 3.0)
    assert stats.rate(3.0) == 0.0

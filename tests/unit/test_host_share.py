"""On a GPU the device's idle time splits into input wait (the consumer was blocked for its batch) and host time
(Python launches, the slot-to-pinned copy): the host share travels to the summary, the log and the verdict, and
only the input share says that more producers would help."""

from __future__ import annotations

import numpy as np
import pytest

from stoker.observe.diagnosis import TimeSplit, diagnose
from stoker.observe.metrics import RunStats, step_fields
from stoker.pipeline.autoscaler import host_share, time_shares
from stoker.pipeline.driver import WindowTotals
from stoker.pipeline.messages import StepReport


def _report(step: int, wait_s: float, host_s: float) -> StepReport:
    return StepReport(0, 0, step, step, 2, 1.0, wait_s, 0.5, 0.0, np.array([2 * step, 2 * step + 1]), None,
                      host_s=host_s)


def test_the_host_share_is_a_part_of_the_same_whole_as_the_others():
    assert time_shares(3.0, 1.0, 0.5, 10.0, host_s=2.0) == (0.3, 0.1, 0.05)
    assert host_share(3.0, 1.0, 0.5, 10.0, 2.0) == 0.2
    # Parts longer than the wall time: shares of their sum, the four together exactly 1.
    shares = (*time_shares(6.0, 1.0, 1.0, 8.0, host_s=2.0), host_share(6.0, 1.0, 1.0, 8.0, 2.0))
    assert shares == (0.6, 0.1, 0.1, 0.2)


def test_a_run_keeps_the_host_time_apart_from_the_input_wait():
    stats = RunStats(num_consumers=1, samples_per_epoch=8, steps_per_epoch=4)
    window = WindowTotals(started=9.5)
    for step, now in enumerate((10.0, 11.0, 12.0)):
        report = _report(step, wait_s=0.1, host_s=0.4)
        stats.record_step(report, now=now)
        window.add(report)
    # 2.5 s of wall time from the first step's start (9.5); the first step's waits are start-up.
    assert stats.stall_fractions() == [0.08] and stats.host_fractions() == [0.32]
    assert (window.wait_s, window.host_s) == pytest.approx((0.3, 1.2))
    assert step_fields(_report(0, 0.1, 0.4), 0)["host_s"] == 0.4


def _split(input_wait: float, host: float) -> TimeSplit:
    return TimeSplit(compute=1 - input_wait - host, input_wait=input_wait, averaging=0.0, producers=4,
                     producer_budget=15, producer_utilization=0.3, sync_every=1, host=host)


def test_a_launch_bound_gpu_reads_host_bound_not_input_bound():
    verdict = diagnose(_split(input_wait=0.12, host=0.40))
    assert verdict.kind == "host-bound"
    assert "try --compile, a larger batch, or CUDA graphs" in verdict.text and "producers" not in verdict.text


def test_input_wait_larger_than_the_host_share_still_reads_input_bound():
    assert diagnose(_split(input_wait=0.40, host=0.12)).kind == "input-bound"
    assert diagnose(_split(input_wait=0.02, host=0.05)).kind == "compute-bound"

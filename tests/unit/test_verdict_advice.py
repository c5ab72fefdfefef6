"""The verdict's producer advice agrees with its own figures (issue 25 item 5: "producers at budget (4/3, busy 82%):
give them more cores (--max-producers)" where 3 was a limit the autoscaler set after an unpaid fork, the ceiling
was 6 and the live line said 3/3)."""

from __future__ import annotations

import numpy as np

from stoker.observe.diagnosis import TimeSplit, diagnose
from stoker.pipeline.autoscale import Autoscaler
from stoker.pipeline.messages import StepReport


def _input_bound(producers: int, budget: int, ceiling: int | None) -> str:
    return diagnose(TimeSplit(compute=0.5, input_wait=0.4, averaging=0.0, producers=producers, producer_budget=budget,
                              producer_utilization=0.82, sync_every=1, producer_ceiling=ceiling)).text


def test_a_limit_below_the_ceiling_does_not_ask_for_a_higher_ceiling():
    text = _input_bound(producers=3, budget=3, ceiling=6)
    assert "--max-producers" not in text and "held at 3" in text and "ceiling is 6" in text


def test_at_the_ceiling_a_higher_ceiling_is_the_advice():
    assert "--max-producers" in _input_bound(producers=6, budget=6, ceiling=6)


def test_the_run_verdict_counts_the_producers_of_now_against_the_limit_of_now(textures, tmp_path):
    from stoker.common.config import make_config
    from stoker.pipeline.engine import Engine
    from stoker.run.controller import Controller

    train, val = textures
    controller = Controller(make_config({"data": train, "val": val, "devices": "cpu:1", "image_size": 16,
                                         "max_producers": 6, "out": tmp_path / "run"}))  # starts nothing
    # The engine's state after such a run, without its processes: the controller reads it from there.
    engine = Engine.__new__(Engine)
    engine.budget, engine.pool = 6, None
    engine.autoscaler = Autoscaler(minimum=1, budget=1, ceiling=6)
    engine.autoscaler.limit = 3  # the fork to 4 did not pay, and 4 retired
    engine.timeline = [{"producers": n} for n in (1, 2, 3, 4, 3)]
    engine.producer_busy = (8.2, 10.0)
    controller._engine = engine
    for step, now in enumerate((1.0, 2.0, 3.0)):  # half of every step spent waiting for input
        controller.stats.record_step(StepReport(0, 0, step, step, 2, 1.0, 0.5, 0.5, 0.0, np.arange(2), None), now)
    text = controller.run_verdict().text
    assert "input-bound" in text and "held at 3" in text and "--max-producers" not in text, text

"""report.png's throughput and time axis, from metrics.jsonl files written here the way a run writes them: the
drawn rate is compared with the rate the steps' own counts and times give (samples per step time, summed over
the consumers), and a resumed run's parts lie one after the other on one time axis."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from stoker.observe.report import RunRecord, throughput_series


def _segment(period: float, steps: int, count: int = 64, ranks: int = 2, start: float = 2.0) -> list[dict]:
    """The records one controller writes: its producers and start events, every rank's step reports (0.3 ms apart),
    and its summary, with `t` from its own start."""
    records = [{"event": "producers", "t": 0.01, "count": 1, "reason": "start"}, {"event": "start", "t": 0.5}]
    for k in range(1, steps + 1):
        for rank in range(ranks):
            records.append({"event": "step", "t": round(start + k * period + rank * 0.0003, 4), "rank": rank,
                            "epoch": 0, "step": k - 1, "global_step": k - 1, "samples": count, "loss": 1.0,
                            "wait_s": 0.0, "compute_s": period, "averaging_s": 0.0})
        records.append({"event": "pipeline", "t": round(start + k * period + 0.5, 4), "samples_per_s": 0.0,
                        "queue_fill": 0.5, "producers": 1})
    records.append({"event": "summary", "t": round(start + steps * period + 1.0, 4)})
    return records


def _run(tmp_path: Path, *segments: list[dict]) -> RunRecord:
    lines = [json.dumps(record) for segment in segments for record in segment]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed"}))
    return RunRecord.load(tmp_path)


def test_steps_slower_than_a_bin_draw_their_true_rate_in_every_bin(tmp_path):
    # 7 s steps of 64 samples on 2 consumers (seen: a flat 128 samples/s drawn where 18 was true).
    times, rates = throughput_series(_run(tmp_path, _segment(period=7.0, steps=6)))
    assert len(times) > 30
    assert all(rate == pytest.approx(2 * 64 / 7.0, rel=0.01) for rate in rates)


def test_a_short_run_does_not_end_in_a_dip(tmp_path):
    # 0.35 s steps: the run's last second is a partial bin that used to be divided by a whole second.
    times, rates = throughput_series(_run(tmp_path, _segment(period=0.35, steps=13)))
    assert rates[-1] == pytest.approx(2 * 64 / 0.35, rel=0.01)
    assert min(rates) == pytest.approx(2 * 64 / 0.35, rel=0.01)


def test_a_resumed_run_is_drawn_on_one_time_axis_without_double_counting(tmp_path):
    run = _run(tmp_path, _segment(period=0.5, steps=20), _segment(period=0.5, steps=20))
    first_end = 2.0 + 20 * 0.5 + 1.0  # the first part's summary
    assert run.segment_starts == [pytest.approx(first_end)]
    steps = run.events["step"]
    assert [s["t"] for s in steps] == sorted(s["t"] for s in steps)  # no line jumps back in time
    assert min(s["t"] for s in steps if s["segment"] == 1) > first_end
    times, rates = throughput_series(run)
    drawn = [rate for rate in rates if not math.isnan(rate)]
    assert all(rate == pytest.approx(2 * 64 / 0.5, rel=0.01) for rate in drawn)
    assert sum(math.isnan(rate) for rate in rates) == 1  # the line breaks once, where the second part starts
    pipeline = [p["t"] for p in run.events["pipeline"]]
    assert pipeline == sorted(pipeline)


def _finished_run(folder: Path, settings: dict) -> Path:
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in _segment(0.5, 4)) + "\n")
    (folder / "config.json").write_text(json.dumps({"out": str(folder), **settings}))
    (folder / "summary.json").write_text(json.dumps({
        "status": "completed", "throughput_samples_per_s": 256.0, "num_consumers": 2, "compute_fraction": [0.9, 0.9],
        "input_stall_fraction": [0.0, 0.0], "averaging_fraction": [0.1, 0.1], "producers_initial": 1,
        "producers_max": 2, "producers_final": 2, "val_accuracy": 0.5, "train_loss": 1.0, "wall_s": 5.0}))
    return folder


def test_comparing_two_runs_lists_the_settings_that_differ(tmp_path):
    from stoker.observe.report import RunRecord, describe

    common = {"epochs": 3, "model": "resnet8", "seed": 0}
    a = _finished_run(tmp_path / "a", {**common, "lr": 0.05, "sync_every": 1})
    b = _finished_run(tmp_path / "b", {**common, "lr": 0.1, "sync_every": 4})
    text = describe([RunRecord.load(a), RunRecord.load(b)])
    listed = text.split("settings that differ:\n", 1)[1].splitlines()
    assert [line.split()[0] for line in listed] == ["lr", "sync_every"]  # not out, which always differs
    assert listed[0].split()[1:] == ["0.05", "0.1"]


def test_a_failed_runs_report_says_it_failed_and_the_dead_consumers_bar_says_when_it_died():
    """Issue 53 (4): a failed run's report.png showed a verdict and no failure, and the dead consumer's bar looked
    as busy as the survivors'."""
    import matplotlib.pyplot as plt

    from stoker.observe.report import RunRecord, drawn

    summary = {"status": "failed", "num_consumers": 3, "compute_fraction": [0.8] * 3,
               "input_stall_fraction": [0.1] * 3, "averaging_fraction": [0.05] * 3,
               "error": "consumer 2 (pid 41) killed by SIGKILL; 0 consumer(s) left, fewer than min_consumers=1\ntrace",
               "verdict": {"text": "compute-bound: devices busy 80% of the time"},
               "consumers_lost": [{"consumer": 1, "died_s": 12.4}, {"consumer": 2, "died_s": 30.0}]}
    figure = drawn([RunRecord("run", summary, {"pipeline": [], "val": [], "step": []})])
    try:
        title = figure._suptitle.get_text()
        assert title.startswith("FAILED: consumer 2 (pid 41) killed by SIGKILL; 0 consumer(s) left") and "trace" \
            not in title and "compute-bound" in title
        split = next(axes for axes in figure.axes if axes.get_title() == "where each consumer's time went")
        assert [label.get_text() for label in split.get_yticklabels()] == [
            "consumer 0", "consumer 1 (died at 12 s)", "consumer 2 (died at 30 s)"]
    finally:
        plt.close(figure)

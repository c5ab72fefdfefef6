"""Progress on long waits: a bar with count and rate on a terminal (read through a terminal emulator), log lines
with the same numbers off it, and one closing line either way."""

from __future__ import annotations

import logging
import os
import re
import sys

import pytest

from stoker.common import waiting
from stoker.data.formats import builtin_data
from tests.helpers.terminal import run_in_terminal


@pytest.fixture
def every_update_shows(monkeypatch):
    """Log on every update and close every wait with a line, however short (the real wait is seconds)."""
    monkeypatch.setattr(waiting, "PUSH_EVERY_S", 0.0)
    monkeypatch.setattr(waiting, "LOG_EVERY_S", 0.0)
    monkeypatch.setattr(waiting, "MIN_REPORT_S", 0.0)


def test_rates_read_per_second_or_seconds_each():
    assert waiting.rate_text(31_096, 1.0, "files") == "31,096 files/s"
    assert waiting.rate_text(5, 2.0, "runs") == "2.5 runs/s"
    assert waiting.rate_text(2, 36.4, "runs") == "18.2 s each"
    assert waiting.rate_text(0, 0.0, "files") == "- files/s"


def test_off_a_terminal_log_lines_carry_the_count_and_the_rate(every_update_shows, caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="stoker")
    builtin_data.generate(tmp_path / "data", train_per_class=1, val_per_class=1)
    lines = [record.getMessage() for record in caplog.records]
    pattern = rf"generating {re.escape(str(tmp_path / 'data'))}: (\d+)/20 images in \d+\.\d s \((.+)\)$"
    counts = [int(match.group(1)) for line in lines if (match := re.match(pattern, line))]
    assert counts[:3] == [1, 2, 3] and counts[-2:] == [20, 20]  # every image, then the closing line
    assert re.search(r"\(([\d,.]+ images/s|[\d.]+ s each)\)$", lines[-1]), lines[-1]


def test_a_wait_inside_another_is_counted_apart_and_not_shown(every_update_shows, caplog):
    # A benchmark counts its runs; each run scans its files inside: the runs' count must stay a count of runs.
    caplog.set_level(logging.INFO, logger="stoker")
    with waiting.waiting("bench autoscale", total=5, unit="runs") as outer:
        with waiting.waiting("indexing /data/train", unit="files") as inner:
            inner.advance(96)
        outer.advance()
    assert outer is not inner and (outer.count, inner.count) == (1, 96)
    messages = [record.getMessage() for record in caplog.records]
    assert not any("indexing" in message for message in messages), messages
    assert messages[-1].startswith("bench autoscale: 1/5 runs in")


BAR_SCRIPT = """
import logging, time
from stoker.common.waiting import waiting
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
with waiting("scanning /data/train", total=40, unit="files") as progress:
    for index in range(40):
        time.sleep(0.03)
        progress.advance()
        if index == 20:
            logging.getLogger("stoker").warning("skipped /data/train/a/broken.jpg: truncated")
"""


def test_on_a_terminal_a_bar_with_count_and_rate_then_one_closing_line():
    seen = []

    def look(screen, _type_keys) -> None:
        seen.extend(line for line in screen if "scanning /data/train" in line and "/40 files" in line)

    terminal = run_in_terminal([sys.executable, "-c", BAR_SCRIPT], env=dict(os.environ), on_output=look)
    assert terminal.returncode == 0, terminal.text
    bars = [line for line in seen if re.search(r"\d+/40 files\s+[\d,.]+ files/s", line)]
    assert bars, seen  # the bar showed the count and the rate while it ran
    assert terminal.lines[-2:] == ["WARNING skipped /data/train/a/broken.jpg: truncated",
                                   terminal.lines[-1]], terminal.text  # the warning above the bar, not through it
    assert re.fullmatch(r"INFO scanning /data/train: 40/40 files in \d+\.\d s \([\d,.]+ files/s\)",
                        terminal.lines[-1]), terminal.text

"""`stoker bench decode` measures both decoders on each set, and its stage clocks account for its CPU time."""

from __future__ import annotations

from stoker.bench.decode import measure
from tests.conftest import photograph_jpeg


def test_every_set_is_timed_with_both_decoders_and_the_stages_add_up():
    sets = {"photos": [photograph_jpeg(0, False), photograph_jpeg(1, True)] * 3}
    rows = measure(sets, 64, 2)
    assert {(row["set"], row["decoder"]) for row in rows} == {("photos", "crop-aware"), ("photos", "whole")}
    for row in rows:
        assert row["images"] == 6 and len(row["passes"]) == 2
        assert 0 < row["stage_ms_per_image"] <= row["cpu_ms_per_image"] * 1.01

"""`stoker bench decode` measures both decoders on each set at each side, and its stage clocks account for its CPU
time."""

from __future__ import annotations

import pytest

from stoker.bench.decode import measure
from tests.conftest import photograph_jpeg


def test_every_set_is_timed_with_both_decoders_and_the_stages_add_up():
    sets = {"photos": [photograph_jpeg(0, False), photograph_jpeg(1, True)] * 3}
    rows = measure(sets, [48, 64], 2)
    assert {(row["image_size"], row["set"], row["decoder"]) for row in rows} == {
        (side, "photos", decoder) for side in (48, 64) for decoder in ("crop-aware", "whole")}
    for row in rows:
        assert row["images"] == 6 and len(row["passes"]) == 2
        assert 0 < row["stage_ms_per_image"] <= row["cpu_ms_per_image"] * 1.01
        assert row["decode_ms_per_image"] + row["resize_ms_per_image"] == pytest.approx(row["stage_ms_per_image"],
                                                                                       abs=2e-4)

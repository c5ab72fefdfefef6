"""`stoker bench decode` measures both decoders on each set at each side, and its stage clocks account for its CPU
time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from stoker.bench.decode import measure
from tests.conftest import photograph_jpeg


def test_every_set_is_timed_with_every_decoder_and_the_stages_add_up():
    sets = {"photos": [photograph_jpeg(0, False), photograph_jpeg(1, True)] * 3}
    rows = measure(sets, [48, 64], 2)
    assert {(row["image_size"], row["set"], row["decoder"]) for row in rows} == {
        (side, "photos", decoder) for side in (48, 64)
        for decoder in ("crop-aware", "crop-aware, loaded before", "whole")}
    for row in rows:
        assert row["images"] == 6 and len(row["passes"]) == 2
        assert 0 < row["stage_ms_per_image"] <= row["cpu_ms_per_image"] * 1.01
        assert row["decode_ms_per_image"] + row["resize_ms_per_image"] == pytest.approx(row["stage_ms_per_image"],
                                                                                       abs=2e-4)


def test_the_command_times_the_raw_pixel_pack_beside_the_jpeg_ones_with_their_shard_bytes(tmp_path):
    import json

    from tests.conftest import run_cli

    for index in range(4):
        folder = tmp_path / "photos" / f"class{index % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{index}.jpg").write_bytes(photograph_jpeg(index % 2, False))
    run_cli("bench", "decode", "--data", str(tmp_path / "photos"), "--max-side", "64", "--raw-max-side", "64",
            "--passes", "1", "--image-size", "32", "--json", str(tmp_path / "decode.json"))
    rows = {(row["set"], row["decoder"]): row for row in json.loads((tmp_path / "decode.json").read_text())["rows"]}
    raw = rows["--max-side 64 --raw-max-side 64", "whole"]
    assert raw["images"] == 4 and rows["original", "crop-aware"]["images"] == 4
    shards = {name: row["shard_bytes"] for (name, _), row in rows.items()}
    # 64x43 pixels: 8 KiB raw, between the small JPEGs and the original 640x427 photographs
    assert all(row["read_ms_per_image"] > 0 for row in rows.values())
    assert shards["--max-side 64"] < shards["--max-side 64 --raw-max-side 64"] < shards["original"]


def test_sigterm_stops_a_benchmark_as_ctrl_c_does_and_its_scratch_folder_goes(tmp_path):
    """A scheduler's SIGTERM: before, it killed the command at once and left its packed sets in the temp folder. The
    passes make its reads of the packed sets, in the scratch folder, last far longer than the signal takes."""
    for index in range(4):
        folder = tmp_path / "photos" / f"class{index % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{index}.jpg").write_bytes(photograph_jpeg(index % 2, False))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    environment = {**os.environ, "TMPDIR": str(scratch)}
    bench = subprocess.Popen([sys.executable, "-m", "stoker", "bench", "decode", "--data", str(tmp_path / "photos"),
                              "--max-side", "64", "--passes", "10000000", "--image-size", "32"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=environment)
    try:
        deadline = time.monotonic() + 60
        while not any(scratch.glob("stoker-bench-decode-*/*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(scratch.glob("stoker-bench-decode-*/*")), "the benchmark never made its scratch folder"
        bench.send_signal(signal.SIGTERM)
        _, stderr = bench.communicate(timeout=30)
    finally:
        bench.kill()
    assert bench.returncode == 130, stderr
    assert "stoker bench: stopped by SIGTERM" in stderr and "Traceback" not in stderr, stderr
    assert list(scratch.iterdir()) == []

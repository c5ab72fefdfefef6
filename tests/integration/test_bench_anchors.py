"""`stoker bench anchors` with tiny sizes: the feeds run end to end on generated ImageNet-like JPEGs, and an anchor
that is not installed is a row that says why, not a failure."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

from stoker.bench.pipeline import _image_sets
from tests.conftest import run_cli


def test_anchors_measures_each_feed_and_names_the_missing_ones(tmp_path):
    report = tmp_path / "anchors.json"
    result = run_cli("bench", "anchors", "--feeds", "stoker,dataloader_stoker,dali", "--images", "24",
                     "--images-per-run", "32", "--batch-size", "8", "--repeats", "1", "--json", str(report))
    figures = json.loads(report.read_text())
    assert figures["images"] == 24
    for feed in ("stoker", "dataloader_stoker"):
        (run,) = figures["runs"][feed]
        assert run["img_s"] > 0 and run["cpu_ms_per_image"] > 0
        assert figures["medians"][feed] == {key: round(value, 3) for key, value in run.items()}
    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.dali") is None:
        assert "nvidia.dali is not installed" in figures["unavailable"]["dali"]
        assert "dali" in result.stdout and "not run" in result.stdout
    else:
        assert figures["medians"]["dali"]["img_s"] > 0


def test_bench_pipeline_sets_are_named_and_photos_means_both_mosaics():
    assert _image_sets("photos,imagenet-like") == ["500x375", "2000x1500", "imagenet-like"]
    assert _image_sets("imagenet-like") == ["imagenet-like"]
    with pytest.raises(argparse.ArgumentTypeError, match="expected names of"):
        _image_sets("imagenet")

"""stoker.Loader used as people use a DataLoader, in this process on real files: a peek before the loop, a
second iterator, epochs shorter than the autoscaler's window, a bad file over several epochs, and a dataset the
producers cannot load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

import stoker
from tests.conftest import HELPERS, ROOT


def small_loader(data, **settings) -> stoker.Loader:
    return stoker.Loader(data, **{"batch_size": 8, "image_size": 16, "producers": 1, "device": "cpu", **settings})


def test_a_peek_before_the_loop_is_not_booked_as_a_duplicate(textures):
    with small_loader(textures[0]) as loader:
        first, _ = next(iter(loader))  # a look at the shapes, as one does before training
        batches = sum(1 for _ in loader)  # the epoch begins again: DataLoader's behaviour too
        summary = loader.summary()
    assert batches == len(loader) == 15
    assert summary["duplicate_samples"] == 0 and summary["missing_samples"] == 0
    assert summary["epoch_accounting"][0]["consumed"] == 120


def test_an_older_iterator_refuses_to_go_on_once_a_newer_one_began(textures):
    with small_loader(textures[0]) as loader:
        older = iter(loader)
        next(older)
        newer = iter(loader)
        next(newer)
        with pytest.raises(RuntimeError, match="newer iter"):
            next(older)
        assert 1 + sum(1 for _ in newer) == len(loader)  # the newer one is whole
        assert loader.summary()["duplicate_samples"] == 0


def test_epochs_shorter_than_a_window_are_still_measured_and_autoscaled(textures, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    with small_loader(textures[0], producers="auto", max_producers=2, metrics_file=metrics) as loader:
        for _ in range(20):  # 15 steps of 10 ms: epochs of about 0.2 s, the whole loop at least 3 s
            for _ in loader:
                time.sleep(0.01)
    events = [json.loads(line)["event"] for line in metrics.read_text().splitlines()]
    assert events.count("pipeline") >= 2 and events.count("autoscale") >= 2


def test_an_unusable_file_is_decoded_and_reported_once_and_missing_from_every_epoch(textures, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(textures[0], data)
    broken = sorted((data / sorted(os.listdir(data))[0]).iterdir())[0]
    broken.write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG")
    metrics = tmp_path / "metrics.jsonl"
    with small_loader(data, metrics_file=metrics) as loader:
        served = [sum(len(labels) for _, labels in loader) for _ in range(3)]
        summary = loader.summary()
    assert served == [119, 119, 119]
    assert [row["missing_unusable"] for row in summary["epoch_accounting"]] == [1, 1, 1]
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [e["path"] for e in events if e["event"] == "skipped"] == [str(broken.resolve())]


def test_a_dataset_the_producers_cannot_load_is_reported_at_once_with_what_to_change(tmp_path):
    environment = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, str(HELPERS / "guarded_dataset.py")], capture_output=True, text=True,
                         timeout=120, env=environment, cwd=tmp_path)
    assert run.returncode != 0
    assert "could not be loaded in a producer process" in run.stderr, run.stderr[-3000:]
    assert "outside `if __name__" in run.stderr
    assert "lost in a row" not in run.stderr  # no replacements started for an error each would repeat

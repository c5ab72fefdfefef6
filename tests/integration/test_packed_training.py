"""Shards and the scan through the real CLI: refused entries reach summary.json, and packed shards train exactly
like the folder they came from, with two consumers, across an interrupt and a resume."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.conftest import assert_same_weights, read_summary, run_cli
from tests.helpers.trees import make_unreadable_folder
from tests.integration.test_multinode import launch_machines


def common(out, *extra):
    return ["--batch-size", "8", "--image-size", "32", "--out", str(out), "--quiet", *extra]


def test_every_refused_entry_reaches_summary_and_the_log_once(textures, tmp_path):
    train, val = textures
    data = tmp_path / "data"
    shutil.copytree(train, data)
    outside = tmp_path / "outside"
    (outside / "class").mkdir(parents=True)
    (outside / "secret.jpg").write_bytes((train / "0_horizontal" / "00000.jpg").read_bytes())
    os.symlink(outside / "secret.jpg", data / "1_vertical" / "escape.jpg")
    os.symlink(outside / "class", data / "escaping_class")
    os.symlink(data / "2_diagonal", data / "2_diagonal" / "loop")
    unreadable = make_unreadable_folder(data / "3_checker")
    result = run_cli("train", "--data", str(data), "--val", str(val), "--epochs", "1", "--devices", "cpu:1",
                     "--producers", "1", *common(tmp_path / "run"), env={"STOKER_CACHE": str(tmp_path / "cache")})
    listed = {item["path"]: item["reason"] for item in read_summary(tmp_path / "run")["skipped_files"]}
    root = os.path.realpath(data)
    expected = {os.path.join(root, "1_vertical", "escape.jpg"): "leaves the data root",
                os.path.join(root, "escaping_class"): "leaves the data root",
                os.path.join(root, "2_diagonal", "loop"): "symlink loop"}
    for path, reason in expected.items():
        assert reason in listed[path]
        assert result.stderr.count(f"refused {path}:") == 1
    deep = [path for path, reason in listed.items() if reason.startswith("unreadable folder")]
    assert len(deep) == 1 and unreadable.startswith(deep[0]) and result.stderr.count(deep[0]) == 1


SETTINGS = ("--devices", "cpu:2", "--epochs", "2", "--seed", "5", "--producers", "2")


@pytest.fixture(scope="module")
def packed(textures, tmp_path_factory):
    """The texture set packed into shards, and the reference run on the folder it came from."""
    train, val = textures
    root = tmp_path_factory.mktemp("packed")
    run_cli("pack", str(train), str(root / "train"), "--shard-size", "40KB", "--workers", "1")
    run_cli("pack", str(val), str(root / "val"), "--shard-size", "40KB", "--workers", "1")
    run_cli("train", "--data", str(train), "--val", str(val), *common(root / "folder", *SETTINGS))
    return root


def test_packed_shards_train_like_the_folder_with_two_consumers_across_a_resume(packed, tmp_path):
    shards = sorted(p.name for p in (packed / "train").glob("*.tar"))
    pattern = packed / "train" / f"shard-{{{shards[0][6:12]}..{shards[-1][6:12]}}}.tar"
    stopped = run_cli("train", "--data", str(pattern), "--val", str(packed / "val"),
                      *common(tmp_path / "shards", *SETTINGS),
                      env={"STOKER_FAULT": "consumer:interrupt-parent:rank=0,step=5;"}, check=False)
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    run_cli("train", "--resume", str(tmp_path / "shards"), "--quiet")
    summary = read_summary(tmp_path / "shards")
    assert summary["status"] == "completed" and 5 < summary["start_step"] < 16  # the resume crosses an epoch end
    assert summary["duplicate_samples"] == 0 and summary["missing_samples"] == 0
    assert summary["val_accuracy"] == read_summary(packed / "folder")["val_accuracy"]
    assert_same_weights(packed / "folder", tmp_path / "shards")


def test_two_machines_on_a_folder_of_shards_train_like_one_on_the_folder(packed, tmp_path):
    results = launch_machines((packed / "train", packed / "val"), tmp_path, "--seed", "5")
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    summary = read_summary(tmp_path)
    assert summary["machines"] == 2 and summary["samples_consumed"] == [120, 120]
    assert summary["duplicate_samples"] == 0 and summary["missing_samples"] == 0
    assert_same_weights(packed / "folder", tmp_path)

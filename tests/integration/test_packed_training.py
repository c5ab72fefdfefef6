"""Shards and the scan through the real CLI: refused entries reach summary.json, and packed shards train exactly
like the folder they came from, with two consumers, across an interrupt and a resume."""

from __future__ import annotations

import os
import shutil

import torch

from tests.conftest import read_summary, run_cli
from tests.helpers.trees import make_unreadable_folder


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


def test_packed_shards_train_like_the_folder_with_two_consumers_across_a_resume(textures, tmp_path):
    train, val = textures
    run_cli("pack", str(train), str(tmp_path / "train"), "--shard-size", "40KB", "--workers", "1")
    run_cli("pack", str(val), str(tmp_path / "val"), "--shard-size", "40KB", "--workers", "1")
    shards = sorted(p.name for p in (tmp_path / "train").glob("*.tar"))
    pattern = tmp_path / "train" / f"shard-{{{shards[0][6:12]}..{shards[-1][6:12]}}}.tar"
    settings = ("--devices", "cpu:2", "--epochs", "1", "--seed", "5", "--producers", "2")
    run_cli("train", "--data", str(train), "--val", str(val), *common(tmp_path / "folder", *settings))
    stopped = run_cli("train", "--data", str(pattern), "--val", str(tmp_path / "val"),
                      *common(tmp_path / "shards", *settings),
                      env={"STOKER_FAULT": "consumer:interrupt-parent:rank=0,step=3;"}, check=False)
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    run_cli("train", "--resume", str(tmp_path / "shards"), "--quiet")
    summary = read_summary(tmp_path / "shards")
    assert summary["status"] == "completed" and summary["start_step"] > 3
    assert summary["duplicate_samples"] == 0 and summary["missing_samples"] == 0
    folder_run = read_summary(tmp_path / "folder")
    assert summary["val_accuracy"] == folder_run["val_accuracy"]
    a = torch.load(tmp_path / "folder" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "shards" / "model.pt", weights_only=True)
    for name in a:
        assert torch.equal(a[name], b[name]), name

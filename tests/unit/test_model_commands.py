"""`stoker eval` and `stoker predict`: a bad setting is one line naming it and exit 2, before the model, the images
or any process is touched (the model file given here does not even exist); a model file whose card names a
module:function runs it only when `--model` names the same one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stoker.cli import main
from tests.conftest import HELPERS, stoker_processes


def _error_of(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stoker: error: "), lines
    return lines[0]


@pytest.mark.parametrize("devices", ["cpu:0", "cpu:x", "bogus", "cuda:a"])  # IndexError, int(), "no CUDA" before
@pytest.mark.parametrize("command", ["eval", "predict"])
def test_a_bad_devices_setting_is_named_before_anything_starts(tmp_path, capsys, command, devices):
    where = ["--data", str(tmp_path)] if command == "eval" else [str(tmp_path)]
    line = _error_of(capsys, command, str(tmp_path / "absent.pt"), *where, "--devices", devices)
    assert f"devices={devices!r}: expected 'auto', 'cpu:N' (N >= 1), 'cuda' or 'cuda:I,J,...'" in line


def test_a_json_file_in_a_missing_folder_is_named_before_the_evaluation(tmp_path, capsys):
    target = tmp_path / "nonexist" / "x.json"
    line = _error_of(capsys, "eval", str(tmp_path / "absent.pt"), "--data", str(tmp_path), "--json", str(target))
    assert f"json={str(target)!r}: the folder {str(target.parent)!r} does not exist" in line


CLASSES = ("cat", "dog")


def _crafted_model_file(folder: Path) -> Path:
    """A model.pt whose card names `planted:small_cnn` with the true SHA-256 of the planted.py beside it (as the
    reviewer's named `this:nothing` with the digest of the stdlib's this.py), which leaves a marker when it runs."""
    from stoker.training.model_file import model_card, save_model
    from stoker.training.models import build_model

    (folder / "planted.py").write_text(f"open({str(folder / 'ran')!r}, 'w').close()\n"
                                       + (HELPERS / "nobn.py").read_text())
    card = model_card("planted:small_cnn", CLASSES, 16)  # found and hashed without running it
    assert card.module_sha256 and not (folder / "ran").exists()
    sys.path.insert(0, str(HELPERS))
    try:
        state = build_model("nobn:small_cnn", len(CLASSES)).state_dict()  # the same architecture
    finally:
        sys.path.remove(str(HELPERS))
    save_model(folder / "model.pt", state, card)
    for k, name in enumerate(CLASSES):
        (folder / "val" / name).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(np.full((20, 20, 3), 40 * (k + i), np.uint8)).save(folder / "val" / name / f"{i}.png")
    return folder / "model.pt"


@pytest.mark.parametrize("command", ["eval", "predict"])
def test_a_card_naming_a_module_runs_it_only_when_model_names_it(tmp_path, monkeypatch, capsys, command):
    monkeypatch.chdir(tmp_path)  # the working directory comes first on the import path
    monkeypatch.setattr(sys, "path", list(sys.path))
    model_file = _crafted_model_file(tmp_path)
    where = ["--data", "val"] if command == "eval" else ["val"]
    common = [command, str(model_file), *where, "--devices", "cpu", "--batch-size", "4", "--producers", "1"]
    for named in ([], ["--model", "resnet8"], ["--model", "planted:other"]):
        line = _error_of(capsys, *common, *named)
        assert f"{model_file}: its model is 'planted:small_cnn'" in line
        assert not (tmp_path / "ran").exists() and "planted" not in sys.modules  # nothing it names was imported
    assert "pass --model planted:small_cnn" in _error_of(capsys, *common)
    # the user names it: the SHA-256 still checked, then the user's own model runs
    assert main([*common, "--model", "planted:small_cnn", *(["--json", "-"] if command == "eval" else [])]) == 0
    assert (tmp_path / "ran").exists()
    out = capsys.readouterr().out
    if command == "eval":
        assert json.loads(out)["count"] == 6 and json.loads(out)["architecture"] == "planted:small_cnn"
    else:
        assert len(out.strip().splitlines()) == 6 + 1  # a header and a row per image
    sys.modules.pop("planted")  # (monkeypatch.delitem would put it back at teardown)


def test_the_classes_a_model_knows_reach_the_terminal_escaped(tmp_path):
    from stoker.use.evaluate import eval_index

    folder = tmp_path / "data" / "zebra"
    folder.mkdir(parents=True)
    Image.new("RGB", (16, 16)).save(folder / "a.png")
    with pytest.raises(ValueError) as refused:
        eval_index(tmp_path / "data", ("cat", "\x1b[2Jdog"))  # a card's class name that would clear the screen
    message = str(refused.value)
    assert "'zebra' are not classes of the model (it knows cat, \\x1b[2Jdog)" in message
    assert "\x1b" not in message


@pytest.mark.parametrize("command", ["eval", "predict"])
def test_sigterm_stops_eval_and_predict_as_ctrl_c_does(tmp_path, monkeypatch, command):
    """A scheduler's SIGTERM once a producer reads the images (each read slowed to 2 s: 6 images take far longer
    than the signal): one line and exit 130, the producers stopped (the autouse check), where SIGTERM killed the
    command."""
    import os
    import signal
    import subprocess
    import time

    from stoker.common import faults

    monkeypatch.chdir(tmp_path)  # the planted module is found in the working directory, as the command finds it
    monkeypatch.setattr(sys, "path", list(sys.path))
    model_file = _crafted_model_file(tmp_path)
    where = ["--data", "val"] if command == "eval" else ["val"]
    environment = {**os.environ, faults.READ_LATENCY_ENV: "2000"}
    started = subprocess.Popen([sys.executable, "-m", "stoker", command, str(model_file), *where, "--devices", "cpu",
                                "--batch-size", "2", "--producers", "1", "--model", "planted:small_cnn"],
                               cwd=tmp_path, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    try:
        deadline = time.monotonic() + 60
        while not any("producer" in title for _, title in stoker_processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any("producer" in title for _, title in stoker_processes()), "no producer started"
        time.sleep(0.5)  # its first read under way
        started.send_signal(signal.SIGTERM)
        _, stderr = started.communicate(timeout=60)
    finally:
        started.kill()
    assert started.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "stoker: interrupted" and "Traceback" not in stderr, stderr

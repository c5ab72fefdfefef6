"""`stoker eval` and `stoker predict`: a bad setting is one line naming it and exit 2, before the model, the images
or any process is touched (the model file given here does not even exist)."""

from __future__ import annotations

import pytest

from stoker.cli import main


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

"""`stoker pack` prints the flags to train on what it wrote, quoted for the shell: the printed line, split as a shell
splits it, names shards that hold every file of the folders with their labels."""

from __future__ import annotations

import contextlib
import io
import shlex

from stoker.cli import main
from stoker.data.formats.folders import scan_image_folder
from stoker.data.sources import load_source


def test_pack_prints_data_and_val_quoted_for_the_shell(textures, tmp_path):
    train, val = textures
    out = tmp_path / "shards with space"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["pack", str(train), str(out), "--val", str(val), "--shard-size", "100KB", "--workers", "1"])
    assert code == 0
    words = shlex.split(printed.getvalue().split("train with ", 1)[1])
    assert words[0] == "--data" and words[2] == "--val" and len(words) == 4
    assert "{" in words[1]  # several shards: a brace pattern, which an unquoted shell would expand
    for folder, spec in ((train, words[1]), (val, words[3])):
        expected = scan_image_folder(folder, classes=scan_image_folder(train).classes)
        packed = load_source(type(out)(spec), cache=tmp_path / "cache")
        assert len(packed) == len(expected) and packed.classes == expected.classes
        assert sorted(packed.labels.tolist()) == sorted(expected.labels.tolist())


def test_max_side_and_quality_are_checked_before_anything_is_written(textures, tmp_path, capsys):
    train, _ = textures
    for flags, said in ((["--quality", "80"], "give --max-side too"), (["--max-side", "0"], "max_side=0"),
                        (["--max-side", "64", "--quality", "101"], "quality=101")):
        assert main(["pack", str(train), str(tmp_path / "out"), *flags]) == 2
        assert said in capsys.readouterr().err and not (tmp_path / "out").exists()

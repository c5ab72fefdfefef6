"""`stoker pack` prints the flags to train on what it wrote, quoted for the shell: the printed line, split as a shell
splits it, names shards that hold every file of the folders with their labels."""

from __future__ import annotations

import contextlib
import io
import shlex
from pathlib import Path

import pytest

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


def test_pack_names_and_counts_files_that_cannot_be_decoded_and_packs_them_all_the_same(textures, tmp_path):
    """A folder with random bytes named .jpg and a JPEG cut short: each is logged with its reason and counted in
    what pack prints; all are packed (sample i of the shards stays sample i of the folder; training skips them)."""
    from tests.conftest import run_cli

    folder = tmp_path / "photos"
    for name in ("a", "b"):
        (folder / name).mkdir(parents=True)
    good = sorted((textures[0] / "0_horizontal").iterdir())[:3]
    for i, photo in enumerate(good):
        (folder / "a" / f"{i}.jpg").write_bytes(photo.read_bytes())
    (folder / "b" / "noise.jpg").write_bytes(bytes(range(256)) * 8)
    (folder / "b" / "cut.jpg").write_bytes(good[0].read_bytes()[:300])
    result = run_cli("pack", str(folder), str(tmp_path / "out"), "--workers", "1")
    assert "; 2 file(s) cannot be decoded (logged above): packed, and skipped by training; train with" in result.stdout
    for name in ("noise.jpg", "cut.jpg"):
        assert f"{folder / 'b' / name}: cannot be decoded (" in result.stderr
    assert "0.jpg: cannot" not in result.stderr
    assert len(load_source(tmp_path / "out" / "shard-000000.tar", cache=tmp_path / "cache")) == 5


def test_pack_help_says_what_its_positionals_and_shard_size_take():
    from tests.conftest import run_cli

    shown = " ".join(run_cli("pack", "--help").stdout.split())
    assert "IMAGEFOLDER the folder to pack: one subfolder per class" in shown
    assert "OUT_DIR where the shards go: a new or empty folder, or an s3://" in shown
    assert "--shard-size SIZE largest shard: bytes, or a number with K, M, G or T (decimal: 1GB = 10^9 bytes)" in shown


def test_max_side_and_quality_are_checked_before_anything_is_written(textures, tmp_path, capsys):
    train, _ = textures
    for flags, said in ((["--quality", "80"], "give --max-side too"), (["--max-side", "0"], "--max-side 0: expected"),
                        (["--max-side", "64", "--quality", "101"], "--quality 101: expected"),
                        (["--raw-max-side", "0"], "--raw-max-side 0: expected a length in pixels from 1 to 4096"),
                        (["--raw-max-side", "4097"], "--raw-max-side 4097: expected a length in pixels from 1 to"),
                        (["--raw-max-side", "64", "--quality", "80"], "give --max-side too")):
        assert main(["pack", str(train), str(tmp_path / "out"), *flags]) == 2
        assert said in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_raw_max_side_that_is_no_number_is_refused_naming_the_flag(textures, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["pack", str(textures[0]), str(tmp_path / "out"), "--raw-max-side", "64px"])
    assert stopped.value.code == 2 and not (tmp_path / "out").exists()
    assert "argument --raw-max-side: invalid int value: '64px'" in capsys.readouterr().err


def test_a_pack_interrupted_while_packing_val_says_its_training_set_is_in_place(textures, tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM once the training set is in place: the message said 'nothing was written' over a whole
    training set, which the next pack then refused to overwrite."""
    from stoker.data.formats import pack
    from stoker.data.formats.shards import PACK_INDEX_FILE

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(pack, "_pack_validation", interrupted)
    train, val = textures
    out = tmp_path / "shards"
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        code = main(["pack", str(train), str(out), "--val", str(val), "--workers", "1"])
    assert code == 130
    assert f"pack interrupted; {out} holds the whole training set, without the validation set" in said.getvalue()
    assert (out / PACK_INDEX_FILE).is_file() and not (out / "val").exists()


def test_sigterm_between_the_renames_of_an_overwrite_waits_until_the_new_pack_is_in_place(textures, tmp_path,
                                                                                         monkeypatch):
    """SIGTERM as --overwrite moves the old pack aside: before, it acted between the two renames, OUT was gone and
    the new pack removed, and the message said nothing was written."""
    import os
    import signal

    from stoker.data.formats import pack
    from stoker.data.formats.shards import PACK_INDEX_FILE

    train, _ = textures
    out = tmp_path / "shards"
    assert main(["pack", str(train), str(out), "--workers", "1"]) == 0
    renamed = []
    rename = os.rename

    def rename_with_a_signal(source, target):
        if Path(source) == out or renamed:  # the old pack's move aside (the signal comes as it is done), and after
            if not renamed:
                os.kill(os.getpid(), signal.SIGTERM)
            renamed.append(Path(target).name)
        rename(source, target)

    monkeypatch.setattr(pack.os, "rename", rename_with_a_signal)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        code = main(["pack", str(train), str(out), "--workers", "1", "--overwrite"])
    assert code == 130 and renamed == [f".shards.old-{os.getpid()}", "shards"]
    assert f"pack interrupted; {out} was complete before it stopped" in said.getvalue()
    assert (out / PACK_INDEX_FILE).is_file() and sorted(p.name for p in tmp_path.iterdir() if p.name != "data") == [
        "shards"]

"""File names reach the terminal printable: control characters escaped, never written raw (an escape sequence
clears the screen, a newline forges a log line); summary.json keeps the real names."""

from __future__ import annotations

import os
import shutil

from stoker.common.terminal import printable
from tests.conftest import read_summary, run_cli

CLEAR_SCREEN = "clear\x1b[2J\x1b[H.jpg"
FORGED = "forged\n12:00:00 ERROR stoker: forged line.jpg"
C1_CSI = "c1\x9b31m.jpg"


def test_printable_escapes_controls_and_undecodable_bytes_and_keeps_the_rest():
    assert printable("ok/ç/名字 file.jpg") == "ok/ç/名字 file.jpg"
    assert printable(CLEAR_SCREEN) == "clear\\x1b[2J\\x1b[H.jpg"
    assert printable(FORGED) == "forged\\n12:00:00 ERROR stoker: forged line.jpg"
    assert printable(C1_CSI) == "c1\\x9b31m.jpg"
    assert printable(os.fsdecode(b"bad\xff\xfe.jpg")) == "bad\\xff\\xfe.jpg"
    assert printable("tab\there\rcr\x7f") == "tab\\there\\rcr\\x7f"


def test_names_with_control_characters_are_escaped_in_the_log_and_kept_in_the_summary(textures, tmp_path):
    train, val = textures
    root = tmp_path / "train"
    shutil.copytree(train, root)
    for name in (CLEAR_SCREEN, FORGED, C1_CSI):
        (root / "0_horizontal" / name).write_bytes(b"not an image at all" * 10)
    os.symlink("/etc/hostname", root / "1_vertical" / "out\x1b]0;title\x07.jpg")  # refused at the scan
    result = run_cli("train", "--data", str(root), "--val", str(val), "--batch-size", "16", "--image-size", "32",
                     "--epochs", "1", "--out", str(tmp_path / "run"))
    output = result.stdout + result.stderr
    assert "\x1b[2J" not in output and "\x9b" not in output and "\x07" not in output
    assert not any(line.startswith("12:00:00 ERROR stoker: forged") for line in output.splitlines())
    assert "clear\\x1b[2J\\x1b[H.jpg" in output and "forged\\n12:00:00" in output  # said, escaped
    skipped = {os.path.basename(s["path"]) for s in read_summary(tmp_path / "run")["skipped_files"]}
    assert {CLEAR_SCREEN, FORGED, C1_CSI, "out\x1b]0;title\x07.jpg"} <= skipped

"""Bad images in a real run: odd-but-valid modes are used, unusable files are skipped and listed, the epoch
accounting stays exact, and too many bad files stop the run with a clear error."""

from __future__ import annotations

import io
import json
import os
import shutil

import numpy as np
import pytest
from PIL import Image

from tests.conftest import forged_png_header, photograph_jpeg, read_summary, run_cli, scan_data_start

pytestmark = pytest.mark.timeout(240)


def picture(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 48, 3), dtype=np.uint8))


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


ODD_BUT_VALID = {
    "cmyk.jpg": lambda: encoded(picture(1).convert("CMYK"), "JPEG"),
    "gray.png": lambda: encoded(picture(2).convert("L"), "PNG"),
    "palette.png": lambda: encoded(picture(3).convert("P"), "PNG"),
    "rgba.png": lambda: encoded(picture(4).convert("RGBA"), "PNG"),
    "wide.png": lambda: encoded(Image.fromarray(np.full((30, 30), 40000, np.uint16)), "PNG"),
    "wide.tif": lambda: encoded(Image.fromarray(np.full((30, 30), 50000, np.uint16)), "TIFF"),
    "really_tiff.jpg": lambda: encoded(picture(10), "TIFF"),
}
def cut_in_scan_data(data: bytes, fraction: float) -> bytes:
    start = scan_data_start(data)
    return data[:start + int((len(data) - start) * fraction)]


UNUSABLE = {
    "truncated.jpg": lambda: encoded(picture(5), "JPEG")[:200],
    "photo_cut.jpg": lambda: cut_in_scan_data(photograph_jpeg(0, progressive=False), 0.7),
    "progressive_photo_cut.jpg": lambda: cut_in_scan_data(photograph_jpeg(1, progressive=True), 0.4),
    "truncated.png": lambda: encoded(picture(6), "PNG")[:300],
    "empty.jpg": lambda: b"",
    "noise.jpg": lambda: np.random.default_rng(7).bytes(3000),
    "really_gif.jpg": lambda: encoded(picture(8), "GIF"),
    "really_psd.jpg": lambda: b"8BPS\x00\x01" + bytes(100),
    "really_pdf.jpg": lambda: b"%PDF-1.4\n%\xe2\xe3\n1 0 obj<<>>endobj\n",
    "bomb.png": lambda: forged_png_header(30000, 30000, bit_depth=8, colour_type=0),
    "too_large_to_decode.png": lambda: forged_png_header(8000, 7500, bit_depth=16, colour_type=6),
}


# deleted.jpg is deleted just before its first read; every producer that decodes oom_killer.jpg is SIGKILLed, as
# the kernel's OOM killer kills a producer whose decode takes more memory than the machine has
FAULTS = {"STOKER_FAULT": "producer:delete:deleted.jpg|producer:sigkill:oom_killer.jpg"}


@pytest.fixture()
def messy(textures, tmp_path):
    train, val = textures
    root = tmp_path / "train"
    shutil.copytree(train, root)
    target = root / "0_horizontal"
    for name, make in {**ODD_BUT_VALID, **UNUSABLE}.items():
        (target / name).write_bytes(make())
    (target / "deleted.jpg").write_bytes(encoded(picture(11), "JPEG"))  # removed after indexing: see FAULTS
    (target / "oom_killer.jpg").write_bytes(encoded(picture(12), "JPEG"))  # a valid JPEG: see FAULTS
    (target / "unreadable.jpg").write_bytes(encoded(picture(9), "JPEG"))
    os.chmod(target / "unreadable.jpg", 0)
    return root, val


def test_odd_files_are_used_and_unusable_ones_skipped_and_listed(messy, tmp_path):
    train, val = messy
    unreadable_expected = os.geteuid() != 0  # root reads a mode-000 file anyway
    run_cli("train", "--data", str(train), "--val", str(val), "--batch-size", "16", "--image-size", "32",
            "--epochs", "2",
            "--out", str(tmp_path / "run"), "--quiet", env=FAULTS)
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "completed"
    skipped = {os.path.basename(s["path"]): s["reason"] for s in summary["skipped_files"]}
    expected = set(UNUSABLE) | {"deleted.jpg", "oom_killer.jpg"} | ({"unreadable.jpg"} if unreadable_expected
                                                                      else set())
    assert set(skipped) == expected
    assert "killed by SIGKILL" in skipped["oom_killer.jpg"] and "2 producers in a row" in skipped["oom_killer.jpg"]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    losses = [r for r in map(json.loads, lines) if r["event"] == "producer_lost"]
    assert len(losses) == 2  # and none in the second epoch: a file that killed producers stays skipped
    assert "too large to decode" in skipped["too_large_to_decode.png"]
    assert "bomb" in skipped["bomb.png"] and "not an image" in skipped["really_pdf.jpg"]
    assert "deleted during the run" in skipped["deleted.jpg"]
    assert skipped["photo_cut.jpg"].startswith("truncated")
    assert skipped["progressive_photo_cut.jpg"].startswith("truncated")
    total = 120 + len(ODD_BUT_VALID) + len(UNUSABLE) + 3
    assert summary["samples_expected"] == total
    assert summary["samples_consumed"] == [total - len(expected)] * 2
    assert summary["duplicate_samples"] == 0
    assert summary["missing_samples"] == summary["missing_samples_skipped_as_unusable"] == 2 * len(expected)


def test_too_many_bad_files_stop_the_run_with_a_clear_error(messy, tmp_path):
    train, val = messy
    result = run_cli("train", "--data", str(train), "--val", str(val), "--batch-size", "16", "--image-size", "32",
                     "--epochs", "1",
                     "--max-bad-fraction", "0.01", "--out", str(tmp_path / "run"), "--quiet", check=False)
    summary = read_summary(tmp_path / "run")
    assert result.returncode == 1 and summary["status"] == "failed"
    assert "max_bad_fraction=0.01" in summary["error"]

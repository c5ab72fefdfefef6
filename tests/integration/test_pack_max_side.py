"""`stoker pack --max-side`: large training images are stored smaller (never upscaled; small files and --val kept
at their pixels, a JPEG rewritten losslessly with a restart marker after every MCU, byte for byte with
--keep-bytes), the same bytes whatever the workers, and the shards train with every sample once, the same weights
whatever the producers."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from stoker.data.pixels.imaging import shrink
from tests.conftest import assert_same_weights, photograph_jpeg, read_summary, run_cli, shard_members

MAX_SIDE = 96


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """Two classes of real photographs cropped (never upscaled) to 200x150, 150x200, 90x60 (already small) and a
    PNG, and a validation folder of full-size ones."""
    root = tmp_path_factory.mktemp("photos")
    for index in range(24):
        photo = Image.open(io.BytesIO(photograph_jpeg(index % 2, False)))
        size = [(200, 150), (150, 200), (90, 60)][index % 3]
        left, top = (index * 17) % (photo.width - size[0]), (index * 11) % (photo.height - size[1])
        image = photo.crop((left, top, left + size[0], top + size[1]))
        for split in ("train", "val"):
            folder = root / split / f"class{index % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            image.save(folder / f"{index:03d}.{'png' if index == 5 else 'jpg'}", quality=92)
    return root


@pytest.fixture(scope="module")
def packed(photos, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed")
    for workers, name in (("1", "one"), ("2", "two")):
        run_cli("pack", str(photos / "train"), str(out / name), "--val", str(photos / "val"), "--max-side",
                str(MAX_SIDE), "--quality", "90", "--shard-size", "40KB", "--workers", workers)
    return out


def _same_image(stored: bytes, original: bytes) -> bool:
    """The same pixels (Pillow's decode, not stoker's), and for a JPEG a restart marker after every MCU (a DRI
    segment of 1); a PNG is kept byte for byte."""
    if original[:2] != b"\xff\xd8":
        return stored == original
    pixels = [np.asarray(Image.open(io.BytesIO(data))) for data in (stored, original)]
    return np.array_equal(*pixels) and b"\xff\xdd\x00\x04\x00\x01" in stored[:stored.index(b"\xff\xda")]


def test_large_images_fit_small_ones_and_val_keep_their_pixels(photos, packed):
    stored = shard_members(packed / "one")
    images = {name: data for name, data in stored.items() if not name.endswith(".cls")}
    assert len(images) == 24
    for name, data in images.items():
        original = next((photos / "train").glob(name.rsplit(".", 1)[0] + ".*")).read_bytes()
        with Image.open(io.BytesIO(original)) as image:
            side = max(image.size)
        if side <= MAX_SIDE:
            assert _same_image(data, original)  # never upscaled, never re-encoded
        else:
            assert name.endswith(".jpg") and max(simplejpeg.decode_jpeg_header(data)[:2]) == MAX_SIDE
            assert _same_image(data, shrink(original, MAX_SIDE, 90))
    val = {n: d for n, d in shard_members(packed / "one" / "val").items() if not n.endswith(".cls")}
    assert len(val) == 24
    assert all(_same_image(data, next((photos / "val").glob(n.rsplit(".", 1)[0] + ".*")).read_bytes())
               for n, data in val.items())


def test_keep_bytes_stores_each_kept_file_as_it_is(photos, tmp_path):
    run_cli("pack", str(photos / "train"), str(tmp_path / "kept"), "--val", str(photos / "val"), "--max-side",
            str(MAX_SIDE), "--keep-bytes", "--workers", "1")
    for split, folder in (("train", tmp_path / "kept"), ("val", tmp_path / "kept" / "val")):
        kept = {name: data for name, data in shard_members(folder).items() if not name.endswith(".cls")}
        assert len(kept) == 24
        for name, data in kept.items():
            original = next((photos / split).glob(name.rsplit(".", 1)[0] + ".*")).read_bytes()
            if split == "val" or max(Image.open(io.BytesIO(original)).size) <= MAX_SIDE:
                assert data == original
            else:  # no bytes of the file to keep: written with the markers
                assert _same_image(data, shrink(original, MAX_SIDE, 90))


def test_the_same_pack_whatever_the_workers(packed):
    assert shard_members(packed / "one") == shard_members(packed / "two")


@pytest.mark.parametrize("index", [0, 1])
def test_a_shrunk_image_is_the_photograph_smaller(index):
    """Against Pillow's box filter at the same size: off by less than twice what the JPEG encode alone costs."""
    original = photograph_jpeg(index, False)
    small = simplejpeg.decode_jpeg(shrink(original, 160, 95))
    reference = np.asarray(Image.open(io.BytesIO(original)).convert("RGB").resize((160, 107), Image.BOX))
    encoded = simplejpeg.decode_jpeg(simplejpeg.encode_jpeg(np.ascontiguousarray(reference), quality=95,
                                                            colorsubsampling="420"))
    floor = np.abs(encoded.astype(int) - reference).mean()
    assert small.shape == reference.shape and np.abs(small.astype(int) - reference).mean() < 2 * floor


def test_packed_small_images_train_every_sample_once_with_the_same_weights_whatever_the_producers(packed, tmp_path):
    common = ("--data", str(packed / "one"), "--val", str(packed / "one" / "val"), "--epochs", "2", "--seed", "3",
              "--batch-size", "8", "--image-size", "64", "--quiet")
    for producers in ("1", "3"):
        run_cli("train", *common, "--producers", producers, "--out", str(tmp_path / producers))
        summary = read_summary(tmp_path / producers)
        assert summary["status"] == "completed" and summary["skipped_files"] == []
        assert summary["duplicate_samples"] == 0 and summary["missing_samples"] == 0
        assert summary["feed_cpu_ms_per_image"]["decode"] > 0
    assert_same_weights(tmp_path / "1", tmp_path / "3")

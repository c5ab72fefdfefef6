"""Raw members (`stoker pack --raw-max-side`): numpy's .npy of uint8 (H, W, 3) pixels go through the producer's
crop and resize with the same draws as a decoded image; anything else that starts as a .npy is refused with why;
and a pack that shrinks an image decodes it once."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest

from stoker.data.formats.pack import Shrink, write_shard
from stoker.data.pixels import imaging
from tests.conftest import photograph_jpeg


def pixels(height: int = 45, width: int = 70) -> np.ndarray:
    rows, columns = np.mgrid[0:height, 0:width]
    return np.stack([(rows * 5) % 256, (columns * 3) % 256, (rows * columns) % 256], -1).astype(np.uint8)


def npy(array: np.ndarray) -> bytes:
    stored = io.BytesIO()
    np.save(stored, array)
    return stored.getvalue()


@pytest.mark.parametrize("augment", ["none", "standard", "trivial"])
def test_a_raw_member_is_cropped_and_resized_as_its_pixels_with_the_same_draws(augment):
    image = pixels()
    data = imaging.encode_raw(image)
    assert data == npy(image)  # what np.save writes
    out = np.empty((24, 24, 3), np.uint8)
    imaging.load_into(data, out, augment, np.random.default_rng(3))
    expected, rng = np.empty_like(out), np.random.default_rng(3)
    box, flip = imaging.choose_box(45, 70, augment, rng)
    imaging.resize_box_into(image, box, flip, expected)
    if augment == "trivial":
        imaging.apply_policy(expected, augment, rng)
    assert np.array_equal(out, expected)
    assert imaging.stored_size(data) == (45, 70)


@pytest.mark.parametrize("data,said", [
    (imaging.encode_raw(pixels())[:-1], "truncated: raw pixels of 9449 bytes where its .npy header says 45x70x3"),
    (imaging.encode_raw(pixels())[:100], "truncated: the file ends inside its .npy header (100 of 128 bytes)"),
    (imaging.encode_raw(pixels()) + b"\0", "corrupt raw pixels: 9451 bytes where its .npy header says 45x70x3"),
    (npy(pixels().astype(np.float32)), "corrupt raw pixels: the .npy header b\"{'descr': '<f4'"),
    (npy(pixels()[:, :, 0]), "is not that of uint8 (height, width, 3) pixels in C order"),
    (npy(np.asfortranarray(pixels())), "is not that of uint8"),
    (npy(np.zeros((0, 5, 3), np.uint8)), "empty image (5x0)"),
    (b"\x93NUMPY\x02\x00" + bytes(20), "a .npy of version (2, 0), not 1.0"),
    (b"\x93NUMPY", "a .npy of version (), not 1.0"),
])
def test_a_member_that_is_not_whole_raw_pixels_is_unusable_with_why(data, said):
    with pytest.raises(imaging.UnusableImage) as refused:
        imaging.load_into(data, np.empty((8, 8, 3), np.uint8), "standard", np.random.default_rng(0))
    assert said in str(refused.value)


def test_a_pack_that_shrinks_an_image_decodes_it_once(tmp_path, monkeypatch):
    """Counted at libjpeg-turbo's entry points (the real decoders run): one decode per photograph, whether it is
    shrunk to a JPEG, to raw pixels, or kept (the check)."""
    decodes = []

    def counted(decode):
        return lambda *args, **kwargs: decodes.append(1) or decode(*args, **kwargs)

    monkeypatch.setattr(imaging.simplejpeg, "decode_jpeg", counted(imaging.simplejpeg.decode_jpeg))
    if imaging._jpegcrop is not None:
        monkeypatch.setattr(imaging, "_jpegcrop", SimpleNamespace(  # the lossless rewrite decodes no pixels
            decode=counted(imaging._jpegcrop.decode), restart_every_mcu=imaging._jpegcrop.restart_every_mcu))
    files = []
    for index in range(2):
        files.append(tmp_path / f"{index}.jpg")
        files[-1].write_bytes(photograph_jpeg(index, False))  # 640x427
    members = [(str(path), path.stem, 0) for path in files]
    for shrink in (Shrink(96), Shrink(96, raw_max_side=96), Shrink(None, raw_max_side=100), Shrink()):
        decodes.clear()
        assert write_shard(tmp_path / "shard.tar", members, shrink) == []
        assert len(decodes) == 2, shrink

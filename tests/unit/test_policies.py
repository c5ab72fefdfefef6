"""TrivialAugment and RandAugment: the operations and ranges as the papers list them, and each colour operation
against Pillow's own (ImageOps, ImageEnhance: what the papers' code used)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageOps

from stoker.data.pixels import policies
from stoker.data.pixels.imaging import load_into
from stoker.pipeline.plan import sample_rng


def _image(seed: int = 0, size: int = 24) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(20, 230, (size, size, 3), dtype=np.uint8)


def test_trivial_augment_table_of_the_paper() -> None:
    """Mueller & Hutter 2021, Table 1, TA (Wide): 14 operations, these ranges, 31 magnitude bins."""
    ranges = policies.TRIVIAL_RANGES
    assert set(ranges) == {"identity", "shear_x", "shear_y", "translate_x", "translate_y", "rotate", "brightness",
                           "color", "contrast", "sharpness", "posterize", "solarize", "autocontrast", "equalize"}
    assert policies.NUM_BINS == 31
    rng = np.random.default_rng(0)
    top = {name: policies.magnitude(op, 30, rng) for name, op in ranges.items()}
    assert abs(top["shear_x"]) == abs(top["shear_y"]) == 0.99
    assert abs(top["translate_x"]) == abs(top["translate_y"]) == 32
    assert abs(top["rotate"]) == 135
    assert all(abs(top[n]) == 0.99 for n in ("brightness", "color", "contrast", "sharpness"))  # factor 0.01..1.99
    assert 8 - top["posterize"] == 2 and 8 - policies.magnitude(ranges["posterize"], 0, rng) == 8  # 8..2 bits
    assert 255 - top["solarize"] == 0 and policies.magnitude(ranges["solarize"], 0, rng) == 0  # threshold 255..0
    signs = {np.sign(policies.magnitude(ranges["rotate"], 10, rng)) for _ in range(50)}
    assert signs == {-1, 1}


@pytest.mark.parametrize("bits", [2, 5, 8])
def test_posterize_matches_pillow(bits: int) -> None:
    image = _image()
    expected = np.asarray(ImageOps.posterize(Image.fromarray(image), bits))
    policies.posterize(image, 8 - bits)
    assert np.array_equal(image, expected)


def test_solarize_matches_pillow() -> None:
    image = _image()
    expected = np.asarray(ImageOps.solarize(Image.fromarray(image), 128))
    policies.solarize(image, 255 - 128)
    assert np.array_equal(image, expected)


def test_autocontrast_matches_pillow() -> None:
    image = _image()
    expected = np.asarray(ImageOps.autocontrast(Image.fromarray(image))).astype(int)
    policies.autocontrast(image, 0)
    assert np.abs(image.astype(int) - expected).max() <= 1


@pytest.mark.parametrize("name,enhancer", [("brightness", ImageEnhance.Brightness), ("color", ImageEnhance.Color),
                                           ("contrast", ImageEnhance.Contrast),
                                           ("sharpness", ImageEnhance.Sharpness)])
@pytest.mark.parametrize("value", [-0.6, 0.5])
def test_enhancements_match_pillow(name: str, enhancer, value: float) -> None:
    image = _image(1)
    expected = np.asarray(enhancer(Image.fromarray(image)).enhance(1 + value)).astype(int)
    policies.OPERATIONS[name](image, value)
    assert np.abs(image.astype(int) - expected).max() <= 1


def test_rotate_and_translate_move_pixels() -> None:
    image = _image(2, 9)
    turned = image.copy()
    policies.rotate(turned, 90)
    assert np.array_equal(turned, np.rot90(image))  # counter-clockwise
    moved = image.copy()
    policies.translate_x(moved, 3)
    assert np.array_equal(moved[:, 3:], image[:, :-3]) and not moved[:, :3].any()


def test_policies_are_a_function_of_the_sample(tmp_path) -> None:
    """The same sample in the same epoch gives the same bytes; another epoch other bytes."""
    import cv2

    ok, encoded = cv2.imencode(".png", _image(3, 48))
    data = encoded.tobytes()
    for policy in ("trivial", "randaug"):
        outs = []
        for epoch in (0, 0, 1, 2, 3):
            out = np.zeros((32, 32, 3), np.uint8)
            load_into(data, out, policy, sample_rng(7, "train", epoch, 5))
            outs.append(out)
        assert np.array_equal(outs[0], outs[1])
        assert any(not np.array_equal(outs[0], other) for other in outs[2:])

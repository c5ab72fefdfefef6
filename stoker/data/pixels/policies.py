"""TrivialAugment and RandAugment on uint8 HWC images, in place, with OpenCV and numpy (in the producers, after
the crop and resize).

TrivialAugment (Mueller & Hutter 2021, "TrivialAugment: Tuning-free Yet State-of-the-Art Data Augmentation", the
"wide" ranges of its Table 1): one operation chosen uniformly, at a magnitude drawn uniformly from 31 bins, its
sign uniformly. RandAugment (Cubuk et al. 2020): 2 operations chosen uniformly, at the fixed magnitude 9 of 31
bins (torchvision's defaults and ranges). Both draw from the sample's generator (`plan.sample_rng`), so a
sample's bytes are the same whichever producer builds them. Geometric operations fill with black and sample the
nearest pixel, as torchvision's do; the colour operations follow Pillow's ImageEnhance and ImageOps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import cv2
import numpy as np

NUM_BINS = 31
RANDAUG_OPS = 2
RANDAUG_MAGNITUDE = 9
POLICIES = ("trivial", "randaug")


@dataclass(frozen=True)
class OpRange:
    """An operation's magnitudes: `maximum` at the last bin, 0 at the first (posterize and solarize run the other
    way: bits 8 down to 2 or 4, threshold 255 down to 0); `signed` ones take a random sign."""

    maximum: float
    signed: bool


# Table 1 of the TrivialAugment paper ("TA (Wide)"); translate in pixels.
TRIVIAL_RANGES: dict[str, OpRange | None] = {
    "identity": None, "shear_x": OpRange(0.99, True), "shear_y": OpRange(0.99, True),
    "translate_x": OpRange(32.0, True), "translate_y": OpRange(32.0, True), "rotate": OpRange(135.0, True),
    "brightness": OpRange(0.99, True), "color": OpRange(0.99, True), "contrast": OpRange(0.99, True),
    "sharpness": OpRange(0.99, True), "posterize": OpRange(6.0, False), "solarize": OpRange(255.0, False),
    "autocontrast": None, "equalize": None,
}
# RandAugment's (torchvision): translate as a share of the side (150/331 of it), posterize 8 down to 4 bits.
RANDAUG_RANGES: dict[str, OpRange | None] = {
    "identity": None, "shear_x": OpRange(0.3, True), "shear_y": OpRange(0.3, True),
    "translate_x": OpRange(150 / 331, True), "translate_y": OpRange(150 / 331, True),
    "rotate": OpRange(30.0, True), "brightness": OpRange(0.9, True), "color": OpRange(0.9, True),
    "contrast": OpRange(0.9, True), "sharpness": OpRange(0.9, True), "posterize": OpRange(4.0, False),
    "solarize": OpRange(255.0, False), "autocontrast": None, "equalize": None,
}


def apply_policy(image: np.ndarray, policy: str, rng: np.random.Generator) -> None:
    """`image` (H, W, 3 uint8) augmented in place by `policy` ("trivial" or "randaug")."""
    if policy == "trivial":
        name = _choose(TRIVIAL_RANGES, rng)
        OPERATIONS[name](image, magnitude(TRIVIAL_RANGES[name], int(rng.integers(0, NUM_BINS)), rng))
        return
    for _ in range(RANDAUG_OPS):
        name = _choose(RANDAUG_RANGES, rng)
        value = magnitude(RANDAUG_RANGES[name], RANDAUG_MAGNITUDE, rng)
        if name.startswith("translate"):
            value *= image.shape[1] if name == "translate_x" else image.shape[0]
        OPERATIONS[name](image, value)


def magnitude(op: OpRange | None, bin_index: int, rng: np.random.Generator) -> float:
    """The value of bin `bin_index` of 31, with a random sign for the signed operations."""
    if op is None:
        return 0.0
    value = op.maximum * bin_index / (NUM_BINS - 1)
    if op.signed and rng.integers(0, 2):
        value = -value
    return value


def _choose(ranges: dict[str, OpRange | None], rng: np.random.Generator) -> str:
    names = list(ranges)
    return names[int(rng.integers(0, len(names)))]


def identity(image: np.ndarray, value: float) -> None:
    return None


def _warp(image: np.ndarray, matrix: np.ndarray) -> None:
    height, width = image.shape[:2]
    out = cv2.warpAffine(image, matrix, (width, height), flags=cv2.INTER_NEAREST, borderMode=cv2.BORDER_CONSTANT,
                         borderValue=(0, 0, 0))
    np.copyto(image, out)


def shear_x(image: np.ndarray, value: float) -> None:
    _warp(image, np.array([[1, value, 0], [0, 1, 0]], dtype=np.float64))


def shear_y(image: np.ndarray, value: float) -> None:
    _warp(image, np.array([[1, 0, 0], [value, 1, 0]], dtype=np.float64))


def translate_x(image: np.ndarray, value: float) -> None:
    _warp(image, np.array([[1, 0, int(value)], [0, 1, 0]], dtype=np.float64))


def translate_y(image: np.ndarray, value: float) -> None:
    _warp(image, np.array([[1, 0, 0], [0, 1, int(value)]], dtype=np.float64))


def rotate(image: np.ndarray, value: float) -> None:
    """Counter-clockwise by `value` degrees about the centre (Pillow's and torchvision's sense)."""
    height, width = image.shape[:2]
    _warp(image, cv2.getRotationMatrix2D(((width - 1) / 2, (height - 1) / 2), value, 1.0))


def _blend(image: np.ndarray, degenerate: np.ndarray, factor: float) -> None:
    """Pillow's Image.blend(degenerate, image, factor): degenerate + factor * (image - degenerate), clipped."""
    out = degenerate.astype(np.float32) + factor * (image.astype(np.float32) - degenerate)
    np.copyto(image, np.clip(np.rint(out), 0, 255).astype(np.uint8))


def _grey(image: np.ndarray) -> np.ndarray:
    """ITU-R 601-2 luma, as Pillow's convert("L"): (299 R + 587 G + 114 B) / 1000, rounded."""
    weighted = image.astype(np.uint32) @ np.array([299, 587, 114], dtype=np.uint32)
    return ((weighted + 500) // 1000).astype(np.uint8)


def brightness(image: np.ndarray, value: float) -> None:
    _blend(image, np.zeros_like(image), 1.0 + value)


def color(image: np.ndarray, value: float) -> None:
    _blend(image, np.repeat(_grey(image)[:, :, None], 3, axis=2), 1.0 + value)


def contrast(image: np.ndarray, value: float) -> None:
    mean = int(_grey(image).mean() + 0.5)
    _blend(image, np.full_like(image, mean), 1.0 + value)


def sharpness(image: np.ndarray, value: float) -> None:
    """Pillow's ImageFilter.SMOOTH kernel ([[1,1,1],[1,5,1],[1,1,1]] / 13) inside, the border pixels kept."""
    kernel = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], dtype=np.float32) / 13
    smooth = np.clip(np.rint(cv2.filter2D(image.astype(np.float32), -1, kernel)), 0, 255).astype(np.uint8)
    smooth[0, :], smooth[-1, :], smooth[:, 0], smooth[:, -1] = image[0, :], image[-1, :], image[:, 0], image[:, -1]
    _blend(image, smooth, 1.0 + value)


def posterize(image: np.ndarray, value: float) -> None:
    """Keep 8 - round(value) bits (value 0..6 in TrivialAugment: 8 down to 2 bits)."""
    bits = 8 - int(round(value))
    np.bitwise_and(image, np.uint8((0xFF << (8 - bits)) & 0xFF), out=image)


def solarize(image: np.ndarray, value: float) -> None:
    """Invert every value at or above the threshold, which runs from 255 (bin 0) down to 0."""
    threshold = 255.0 - value
    np.copyto(image, np.where(image >= threshold, 255 - image, image))


def autocontrast(image: np.ndarray, value: float) -> None:
    """Each channel stretched to 0..255 (Pillow's ImageOps.autocontrast without cutoff)."""
    for channel in range(3):
        plane = image[:, :, channel]
        low, high = int(plane.min()), int(plane.max())
        if high > low:
            scale = 255.0 / (high - low)
            lut = np.clip(np.rint((np.arange(256) - low) * scale), 0, 255).astype(np.uint8)
            image[:, :, channel] = lut[plane]


def equalize(image: np.ndarray, value: float) -> None:
    """Each channel's histogram equalized (OpenCV's equalizeHist)."""
    for channel in range(3):
        image[:, :, channel] = cv2.equalizeHist(np.ascontiguousarray(image[:, :, channel]))


OPERATIONS: dict[str, Callable[[np.ndarray, float], None]] = {
    "identity": identity, "shear_x": shear_x, "shear_y": shear_y, "translate_x": translate_x,
    "translate_y": translate_y, "rotate": rotate, "brightness": brightness, "color": color, "contrast": contrast,
    "sharpness": sharpness, "posterize": posterize, "solarize": solarize, "autocontrast": autocontrast,
    "equalize": equalize,
}

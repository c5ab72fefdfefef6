"""The built-in dataset: ten texture classes, generated offline on first use as real JPEG files.

Textures (stripes at three orientations, checkerboards, dots, rings, plaid, blobs, waves, speckle) survive random
resized crops and horizontal flips, so the standard augmentation applies unchanged; random colours, periods,
rotations, lighting gradients, noise and JPEG compression keep it from being trivial. Deterministic from a seed.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from stoker.common.waiting import waiting

log = logging.getLogger(__name__)

VERSION = 1
IMAGE_PX = 64
TRAIN_PER_CLASS = 600
VAL_PER_CLASS = 100
GENERATOR_SEED = 2024


def cache_root() -> Path:
    base = os.environ.get("STOKER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "stoker")
    return Path(base)


def builtin_dataset(root: Path | None = None) -> tuple[Path, Path]:
    """(train, val) folders, generating them once; a half-written cache is never used (atomic rename)."""
    folder = (root or cache_root()) / f"textures-v{VERSION}"
    if not (folder / "val").is_dir():
        log.info("generating the built-in dataset into %s (once)", folder)
        generate(folder, TRAIN_PER_CLASS, VAL_PER_CLASS)
    return folder / "train", folder / "val"


def generate(folder: Path, train_per_class: int, val_per_class: int, seed: int = GENERATOR_SEED) -> None:
    temporary = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    total = len(CLASSES) * (train_per_class + val_per_class)
    with waiting(f"generating {folder}", total=total, unit="images") as progress:
        for split, count, offset in (("train", train_per_class, 0), ("val", val_per_class, 10**6)):
            for label, (name, draw) in enumerate(CLASSES.items()):
                target = temporary / split / f"{label}_{name}"
                target.mkdir(parents=True)
                for index in range(count):
                    rng = np.random.default_rng([seed, label, offset + index])
                    pixels = render(draw, rng)
                    Image.fromarray(pixels).save(target / f"{index:05d}.jpg", quality=int(rng.integers(70, 95)))
                    progress.advance()
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(temporary, folder)
    except OSError:  # another process generated it first
        shutil.rmtree(temporary, ignore_errors=True)


def render(draw: Callable[[np.ndarray, np.ndarray, np.random.Generator], np.ndarray],
           rng: np.random.Generator) -> np.ndarray:
    """Two random colours mixed by the class's pattern (0..1), plus a lighting gradient and noise."""
    y, x = np.mgrid[0:IMAGE_PX, 0:IMAGE_PX].astype(np.float64)
    pattern = np.clip(draw(x, y, rng), 0, 1)[:, :, None]
    low, high = _contrasting_colours(rng)
    image = low * (1 - pattern) + high * pattern
    angle = rng.uniform(0, 2 * np.pi)
    gradient = (np.cos(angle) * x + np.sin(angle) * y) / IMAGE_PX - 0.5
    image = image * (1 + rng.uniform(0, 0.5) * gradient[:, :, None])
    image = image + rng.normal(0, rng.uniform(4, 16), image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def _contrasting_colours(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    while True:
        low, high = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
        if np.abs(low - high).sum() > 150:
            return low, high


def _rotated(x: np.ndarray, y: np.ndarray, degrees: float) -> tuple[np.ndarray, np.ndarray]:
    theta = np.deg2rad(degrees)
    return x * np.cos(theta) + y * np.sin(theta), -x * np.sin(theta) + y * np.cos(theta)


def _stripes(degrees: float) -> Callable:
    def draw(x, y, rng):
        u, _ = _rotated(x, y, degrees + rng.uniform(-15, 15))
        return np.sin(2 * np.pi * u / rng.uniform(5, 12) + rng.uniform(0, 2 * np.pi)) > 0
    return draw


def _diagonal(x, y, rng):
    return _stripes(45.0 if rng.integers(0, 2) else 135.0)(x, y, rng)


def _checker(x, y, rng):
    u, v = _rotated(x, y, rng.uniform(0, 90))
    period = rng.uniform(6, 14)
    return (np.floor(u / period) + np.floor(v / period)) % 2


def _dots(x, y, rng):
    u, v = _rotated(x, y, rng.uniform(0, 90))
    period = rng.uniform(7, 14)
    du, dv = (u % period) - period / 2, (v % period) - period / 2
    return np.hypot(du, dv) < period * rng.uniform(0.2, 0.35)


def _rings(x, y, rng):
    cx, cy = rng.uniform(0, IMAGE_PX, 2)
    return np.sin(2 * np.pi * np.hypot(x - cx, y - cy) / rng.uniform(5, 11)) > 0


def _plaid(x, y, rng):
    u, v = _rotated(x, y, rng.uniform(0, 90))
    period, width = rng.uniform(8, 14), rng.uniform(1.5, 3)
    return ((u % period) < width) | ((v % period) < width)


def _blobs(x, y, rng):
    field = sum(np.sin(rng.uniform(0.05, 0.2) * (np.cos(a) * x + np.sin(a) * y) + rng.uniform(0, 6.3))
                for a in rng.uniform(0, np.pi, 4))
    return field > 0


def _waves(x, y, rng):
    u, v = _rotated(x, y, rng.uniform(-20, 20))
    bend = rng.uniform(3, 6) * np.sin(2 * np.pi * v / rng.uniform(14, 24))
    return np.sin(2 * np.pi * (u + bend) / rng.uniform(6, 10)) > 0


def _speckle(x, y, rng):
    return rng.random(x.shape) < rng.uniform(0.2, 0.5)


CLASSES: dict[str, Callable] = {
    "horizontal": _stripes(90.0), "vertical": _stripes(0.0), "diagonal": _diagonal, "checker": _checker,
    "dots": _dots, "rings": _rings, "plaid": _plaid, "blobs": _blobs, "waves": _waves, "speckle": _speckle,
}

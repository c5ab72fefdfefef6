"""ImageNet-like JPEGs made here from real photographs that packages ship: ImageNet's shapes, quality and bytes per
pixel, never upscaled.

ImageNet's training JPEGs average about 470x390 pixels (most 500 on the long side, a quarter of them portrait) and
about 108 KB, some 0.5-0.6 bytes per pixel; the entropy decoder's work grows with the bytes, so a benchmark on
smoother or smaller files flatters every decoder. Each image here is a crop of one photograph at its native
resolution or reduced (a box 1-2x the output's size, shrunk with Pillow's Lanczos filter), at a random position,
flipped half the time, its exposure varied a little, then encoded at the JPEG quality (50-97, 4:2:0) whose size comes
closest to a bytes-per-pixel target drawn per image around 0.5. Everything follows from the seed and the photographs
found: scikit-image's colour photographs when it is installed (`stoker[bench]`; only its files are read, the package
is not imported), scikit-learn's two and matplotlib's Grace Hopper. `manifest.json` records every image's source,
box, quality and bytes per pixel.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from stoker.common.waiting import waiting

log = logging.getLogger(__name__)

NAME = "imagenet-like"
# scikit-image's colour photographs of the world (its grey, synthetic, medical and retina images are left out)
SKIMAGE_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "hubble_deep_field.jpg", "motorcycle_left.png",
                  "motorcycle_right.png", "rocket.jpg")
TARGET_BYTES_PER_PIXEL = 0.55  # median of the per-image targets
TARGET_SPREAD = 0.3  # sigma of the log-normal the targets are drawn from
QUALITIES = (50, 98)  # the range searched; most of ImageNet's JPEGs are between these
MAX_REDUCTION = 2.0  # a crop box at most this many times the output's size


@dataclass(frozen=True)
class MadeImage:
    """One generated JPEG: where its pixels came from and what it holds."""

    path: str
    source: str
    box: tuple[int, int, int, int]  # left, top, width, height in the source photograph
    width: int
    height: int
    flipped: bool
    quality: int
    size_bytes: int

    @property
    def bytes_per_pixel(self) -> float:
        return self.size_bytes / (self.width * self.height)


def photographs_available() -> None:
    """A clear error, as every other missing optional part gives, instead of `ModuleNotFoundError: sklearn`."""
    try:
        import sklearn.datasets  # noqa: F401
    except ImportError:
        raise ValueError("the benchmark images are made from scikit-learn's sample photographs: "
                         "pip install 'stoker[bench]'") from None


def photographs() -> list[np.ndarray]:
    """Real photographs that ship inside installed packages (scikit-learn; matplotlib's when present)."""
    photographs_available()
    from sklearn.datasets import load_sample_images

    photos = list(load_sample_images().images)
    try:
        from matplotlib import cbook

        with cbook.get_sample_data("grace_hopper.jpg") as handle:  # type: ignore[union-attr]  # a file by default
            photos.append(np.asarray(Image.open(handle).convert("RGB")))
    except (ImportError, OSError, ValueError):
        pass
    return photos


def source_photographs() -> dict[str, np.ndarray]:
    """{name: RGB pixels} of every real colour photograph found in the installed packages."""
    found = dict(zip(("china.jpg", "flower.jpg", "grace_hopper.jpg"), photographs()))
    spec = importlib.util.find_spec("skimage")  # finds the package's folder without importing it
    if spec is None or not spec.submodule_search_locations:
        log.warning("scikit-image is not installed: the ImageNet-like set is cut from %d photographs instead of %d "
                    "(pip install 'stoker[bench]')", len(found), len(found) + len(SKIMAGE_PHOTOS))
        return found
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    for name in SKIMAGE_PHOTOS:
        found[name] = np.asarray(Image.open(data / name).convert("RGB"))
    return found


def draw_shape(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height) as ImageNet's are spread: 500 on the long side mostly, 4:3 mostly, a quarter portrait."""
    long_side = 500 if rng.random() < 0.85 else int(rng.integers(333, 500))
    orientation = rng.choice(["landscape", "portrait", "square"], p=[0.70, 0.22, 0.08])
    if orientation == "square":
        return long_side, long_side
    short_side = round(long_side / rng.choice([4 / 3, 3 / 2, 5 / 4], p=[0.65, 0.25, 0.10]))
    return (long_side, short_side) if orientation == "landscape" else (short_side, long_side)


def cut(photos: dict[str, np.ndarray], width: int, height: int, rng: np.random.Generator
        ) -> tuple[str, tuple[int, int, int, int], np.ndarray, bool]:
    """A random box of a photograph that holds width x height at native resolution or more, shrunk to it."""
    fits = sorted(name for name, pixels in photos.items() if pixels.shape[0] >= height and pixels.shape[1] >= width)
    if not fits:
        raise ValueError(f"no photograph holds {width}x{height} without upscaling")
    name = fits[int(rng.integers(len(fits)))]
    photo = photos[name]
    most = min(MAX_REDUCTION, photo.shape[1] / width, photo.shape[0] / height)
    scale = rng.uniform(1.0, most)
    box_w, box_h = min(photo.shape[1], round(width * scale)), min(photo.shape[0], round(height * scale))
    left, top = int(rng.integers(0, photo.shape[1] - box_w + 1)), int(rng.integers(0, photo.shape[0] - box_h + 1))
    image = Image.fromarray(photo[top:top + box_h, left:left + box_w])
    if (box_w, box_h) != (width, height):
        image = image.resize((width, height), Image.Resampling.LANCZOS)
    pixels = np.asarray(image, np.float32) * rng.uniform(0.85, 1.15)  # exposure varies from picture to picture
    flipped = bool(rng.integers(2))
    if flipped:
        pixels = pixels[:, ::-1]
    return name, (left, top, box_w, box_h), np.clip(pixels, 0, 255).astype(np.uint8), flipped


def encode_near(pixels: np.ndarray, bytes_per_pixel: float) -> tuple[bytes, int]:
    """(JPEG, quality): the quality in QUALITIES whose file comes closest to bytes_per_pixel (a bisection: the
    size grows with the quality)."""
    image, target = Image.fromarray(pixels), bytes_per_pixel * pixels.shape[0] * pixels.shape[1]
    made: dict[int, bytes] = {}

    def encoded(quality: int) -> bytes:
        if quality not in made:
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=quality, subsampling="4:2:0")
            made[quality] = buffer.getvalue()
        return made[quality]

    low, high = QUALITIES
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if len(encoded(middle)) < target else (low, middle)
    quality = min((low, high), key=lambda q: abs(len(encoded(q)) - target))
    return encoded(quality), quality


def make_imagenet_like(folder: Path, count: int, seed: int = 0) -> list[MadeImage]:
    """count JPEGs under folder/<source photograph>/ (an ImageFolder, a class per photograph) and manifest.json."""
    if count < 1:
        raise ValueError(f"count={count}: expected 1 or more images")
    photos, rng = source_photographs(), np.random.default_rng(seed)
    made = []
    with waiting(f"generating {folder}", total=count, unit="images") as progress:
        for index in range(count):
            width, height = draw_shape(rng)
            source, box, pixels, flipped = cut(photos, width, height, rng)
            target = float(np.clip(rng.lognormal(np.log(TARGET_BYTES_PER_PIXEL), TARGET_SPREAD), 0.2, 1.2))
            data, quality = encode_near(pixels, target)
            path = folder / Path(source).stem / f"{index:05d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            made.append(MadeImage(str(path.relative_to(folder)), source, box, width, height, flipped, quality,
                                  len(data)))
            progress.advance()
    (folder / "manifest.json").write_text(json.dumps({"seed": seed, "summary": summary(made),
                                                      "images": [asdict(m) for m in made]}, indent=1) + "\n")
    return made


def summary(made: list[MadeImage]) -> dict[str, object]:
    """The set's shapes, sizes and bytes per pixel, as a benchmark reports them beside its figures."""
    per_pixel = sorted(m.bytes_per_pixel for m in made)

    def quantile(q: float) -> float:
        return round(per_pixel[min(len(per_pixel) - 1, int(q * len(per_pixel)))], 3)

    return {"images": len(made), "sources": sorted({m.source for m in made}),
            "mean_width": round(statistics.mean(m.width for m in made), 1),
            "mean_height": round(statistics.mean(m.height for m in made), 1),
            "portrait": round(sum(m.height > m.width for m in made) / len(made), 3),
            "mean_kb": round(statistics.mean(m.size_bytes for m in made) / 1000, 1),
            "bytes_per_pixel": {"mean": round(statistics.mean(per_pixel), 3), "p10": quantile(0.1),
                                "median": quantile(0.5), "p90": quantile(0.9)},
            "quality": {"median": statistics.median(m.quality for m in made),
                        "min": min(m.quality for m in made), "max": max(m.quality for m in made)}}

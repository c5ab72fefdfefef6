"""The ImageNet-like benchmark set: ImageNet's shapes and bytes per pixel, cut from photographs, never upscaled,
the same files from the same seed."""

from __future__ import annotations

import json
import statistics

import numpy as np
import simplejpeg

from stoker.bench.photos import make_imagenet_like, source_photographs

COUNT = 40


def test_imagenet_like_images_have_imagenets_shapes_and_bytes_per_pixel(tmp_path):
    made = make_imagenet_like(tmp_path / "set", COUNT, seed=3)
    assert len(made) == COUNT
    for image in made:
        pixels = simplejpeg.decode_jpeg((tmp_path / "set" / image.path).read_bytes())
        assert pixels.shape == (image.height, image.width, 3)
        assert 333 <= max(image.width, image.height) <= 500 and min(image.width, image.height) >= 222
        assert 0.15 < image.bytes_per_pixel < 1.5, image
    per_pixel = statistics.median(m.bytes_per_pixel for m in made)
    assert 0.35 < per_pixel < 0.7  # ImageNet's training JPEGs: about 0.5-0.6
    assert any(m.height > m.width for m in made) and any(m.width > m.height for m in made)
    manifest = json.loads((tmp_path / "set" / "manifest.json").read_text())
    assert len(manifest["images"]) == COUNT and manifest["summary"]["images"] == COUNT


def test_every_image_is_a_box_of_a_photograph_at_least_its_size(tmp_path):
    photos = source_photographs()
    for image in make_imagenet_like(tmp_path, COUNT, seed=4):
        left, top, width, height = image.box
        rows, columns = photos[image.source].shape[:2]
        assert 0 <= left and left + width <= columns and 0 <= top and top + height <= rows
        assert width >= image.width and height >= image.height, f"{image.path} upscaled from {image.box}"


def test_the_seed_decides_the_files(tmp_path):
    first = make_imagenet_like(tmp_path / "a", 6, seed=5)
    again = make_imagenet_like(tmp_path / "b", 6, seed=5)
    other = make_imagenet_like(tmp_path / "c", 6, seed=6)
    files = [[(tmp_path / name / m.path).read_bytes() for m in made]
             for name, made in (("a", first), ("b", again), ("c", other))]
    assert files[0] == files[1]
    assert files[0] != files[2]
    decoded = [simplejpeg.decode_jpeg(data) for data in files[0]]
    assert all(not (a.shape == b.shape and np.array_equal(a, b)) for i, a in enumerate(decoded)
               for b in decoded[i + 1:])

"""The pipeline benchmark's images: real photographic content at the promised sizes, not flat colour or noise."""

from __future__ import annotations

import numpy as np
import simplejpeg

from stoker.bench.pipeline import SETS, generate


def test_generated_sets_are_photographic_jpegs_of_the_promised_sizes(tmp_path):
    generate(tmp_path, small=4, large=1)
    for name, (width, height) in SETS.items():
        files = sorted((tmp_path / name / "photos").glob("*.jpg"))
        assert len(files) == (4 if name == "500x375" else 1)
        for path in files:
            data = path.read_bytes()
            pixels = simplejpeg.decode_jpeg(data)
            assert pixels.shape == (height, width, 3)
            bits_per_pixel = 8 * len(data) / (width * height)
            assert 1.0 < bits_per_pixel < 8.0  # photographs at q90; flat colour is far below, noise far above
            rows = pixels.astype(np.float64).mean(axis=(1, 2))
            assert 0.5 < np.corrcoef(rows[:-1], rows[1:])[0, 1]  # neighbouring rows alike: structure, not noise
    small = [simplejpeg.decode_jpeg(p.read_bytes()) for p in sorted((tmp_path / "500x375" / "photos").glob("*"))]
    assert all(not np.array_equal(small[0], other) for other in small[1:])

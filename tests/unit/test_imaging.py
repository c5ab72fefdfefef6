"""Decoding and augmentation: every mode becomes RGB, bad files raise UnusableImage, the crop distribution is
torchvision's, and the reduced-size decode looks like the full decode."""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import subprocess
import sys
import threading
import zlib

import cv2
import numpy as np
import pytest
import simplejpeg
from PIL import Image
from scipy import stats

from stoker.data.pixels.imaging import (
    MAX_IMAGE_PIXELS,
    Box,
    UnusableImage,
    center_crop_box,
    load_into,
    make_decode_warnings_errors,
    random_resized_crop_box,
    resize_box_into,
    to_rgb_array,
)
from tests.conftest import forged_png_header, photograph_jpeg, scan_data_start

make_decode_warnings_errors()


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def photo_like(height: int, width: int, seed: int) -> np.ndarray:
    """Smooth shapes, gradients and mild noise: decodes like a photograph, unlike flat colour or pure noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    image = np.zeros((height, width, 3))
    for _ in range(12):
        cx, cy, radius = rng.uniform(0, 1), rng.uniform(0, 0.8), rng.uniform(0.05, 0.4)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / radius ** 2)
        image += blob[:, :, None] * rng.uniform(-120, 120, 3)
    image += 128 + 40 * np.sin(6 * x + rng.uniform(0, 6))[:, :, None] + rng.normal(0, 3, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


RGB = photo_like(60, 80, 0)


@pytest.mark.parametrize("mode,fmt", [("L", "PNG"), ("P", "PNG"), ("RGBA", "PNG"), ("CMYK", "JPEG"),
                                      ("LA", "PNG"), ("RGB", "BMP"), ("RGB", "WEBP"), ("RGB", "TIFF")])
def test_every_mode_becomes_rgb(mode, fmt):
    out = np.zeros((24, 24, 3), np.uint8)
    load_into(encode(Image.fromarray(RGB).convert(mode), fmt), out, "none", np.random.default_rng(0))
    assert out.std() > 5  # real content arrived in all three channels
    if mode in ("L", "LA"):
        assert np.array_equal(out[:, :, 0], out[:, :, 1])


def test_16_bit_png_is_scaled_not_clipped():
    wide = (np.linspace(0, 65535, 40 * 40).reshape(40, 40)).astype(np.uint16)
    out = np.zeros((16, 16, 3), np.uint8)
    load_into(encode(Image.fromarray(wide), "PNG"), out, "none", np.random.default_rng(0))
    assert out.max() > 200 and out.min() < 50  # a full range of greys, not all 255


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_16_bit_grey_is_rounded_to_8_bits_exactly(fmt):
    every_value = np.arange(65536, dtype=np.uint16).reshape(256, 256)
    with Image.open(io.BytesIO(encode(Image.fromarray(every_value), fmt))) as image:
        assert image.mode.startswith("I;16")
        rgb = to_rgb_array(image)
    expected = np.round(every_value / 257.0).astype(np.uint8)  # v * 255 / 65535, never exactly halfway
    for channel in range(3):
        assert np.array_equal(rgb[:, :, channel], expected)


PEAK_RSS_OF_ONE_DECODE = """
import resource, sys
import numpy as np
from PIL import Image
from stoker.data.pixels.imaging import decode_bytes, load_into
data = open(sys.argv[1], "rb").read()
out = np.zeros((32, 32, 3), np.uint8)
with Image.open(sys.argv[1]) as image:
    estimate = decode_bytes(image)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
load_into(data, out, "standard", np.random.default_rng(0))
print(estimate, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_16_bit_tiff_decode_stays_within_its_memory_estimate(tmp_path):
    """A 16-Mpixel 16-bit TIFF (32 MB): the float64 conversion took about 35 bytes a pixel at its peak."""
    height, width = 4000, 4000
    path = tmp_path / "wide.tif"
    gradient = (np.arange(height * width, dtype=np.uint32) % 65536).astype(np.uint16).reshape(height, width)
    Image.fromarray(gradient).save(path, "TIFF")
    result = subprocess.run([sys.executable, "-c", PEAK_RSS_OF_ONE_DECODE, str(path)], capture_output=True,
                            text=True, check=True, timeout=60)
    estimate, peak_growth = map(int, result.stdout.split())
    assert estimate <= 10 * height * width
    assert peak_growth <= estimate, (peak_growth, estimate)


def test_image_whose_decode_would_exceed_the_memory_bound_is_refused_from_its_header():
    """8000x7500 is under the pixel cap, but RGBA through the transparency conversion needs about 1.3 GiB."""
    assert 8000 * 7500 <= MAX_IMAGE_PIXELS
    rgba_16_bit = forged_png_header(8000, 7500, bit_depth=16, colour_type=6)
    with pytest.raises(UnusableImage, match="too large to decode: 8000x7500 RGBA needs about 1316 MiB"):
        load_into(rgba_16_bit, np.zeros((8, 8, 3), np.uint8), "standard", np.random.default_rng(0))


def test_transparent_pixels_become_white():
    rgba = np.zeros((20, 20, 4), np.uint8)
    out = np.zeros((8, 8, 3), np.uint8)
    load_into(encode(Image.fromarray(rgba, "RGBA"), "PNG"), out, "none", np.random.default_rng(0))
    assert (out == 255).all()


JPEG = encode(Image.fromarray(RGB), "JPEG", quality=90)
PNG = encode(Image.fromarray(RGB), "PNG")


@pytest.mark.parametrize("data,reason", [
    (b"", "empty"),
    (JPEG[: len(JPEG) // 3], "JPEG"),
    (PNG[: len(PNG) // 2], "truncated"),
    (np.random.default_rng(1).bytes(5000), "not an image"),
    (encode(Image.fromarray(RGB), "GIF"), "not an image"),
    (b"%PDF-1.4\n1 0 obj << >> endobj\n", "not an image"),
    (b"8BPS\x00\x01" + bytes(40), "not an image"),
])
def test_unusable_files_raise_with_a_reason(data, reason):
    with pytest.raises(UnusableImage, match=reason):
        load_into(data, np.zeros((8, 8, 3), np.uint8), "standard", np.random.default_rng(0))


@pytest.mark.parametrize("progressive", [False, True], ids=["baseline", "progressive"])
@pytest.mark.parametrize("index", [0, 1], ids=["china", "flower"])
def test_photograph_cut_inside_its_scan_data_is_refused_as_truncated(index, progressive):
    data = photograph_jpeg(index, progressive)
    start = scan_data_start(data)
    for fraction in (0.02, 0.3, 0.6, 0.9, 0.999):
        cut = start + int((len(data) - 2 - start) * fraction)
        for augment in ("standard", "none"):  # reduced-size and full-size decodes
            with pytest.raises(UnusableImage, match="^truncated"):
                load_into(data[:cut], np.zeros((32, 32, 3), np.uint8), augment, np.random.default_rng(0))


@pytest.mark.parametrize("trailer", [b"", b"\x00" * 64, b"trailer a camera appended"])
def test_whole_photograph_decodes_also_with_a_trailer_after_its_end(trailer):
    out = np.zeros((32, 32, 3), np.uint8)
    load_into(photograph_jpeg(0, progressive=True) + trailer, out, "none", np.random.default_rng(0))
    assert out.std() > 5


def test_cmyk_jpeg_cut_inside_its_scan_data_is_refused_as_truncated():
    data = encode(Image.fromarray(photo_like(200, 300, 3)).convert("CMYK"), "JPEG", quality=90)
    with pytest.raises(UnusableImage, match="^truncated"):
        load_into(data[:scan_data_start(data) + 2000], np.zeros((32, 32, 3), np.uint8), "none",
                  np.random.default_rng(0))


def test_decompression_bomb_is_refused_from_the_header():
    bomb = forged_png_header(30000, 30000, bit_depth=8, colour_type=0)
    with pytest.raises(UnusableImage, match="bomb"):
        load_into(bomb, np.zeros((8, 8, 3), np.uint8), "standard", np.random.default_rng(0))


# torchvision's RandomResizedCrop, as its documentation states it: area fraction s ~ U(0.08, 1) and log aspect ratio
# ~ U(log 3/4, log 4/3), redrawn (up to 10 times) until the box fits, so accepted (s, log r) are uniform on the set
# where it fits; the box's top-left corner uniform over the positions where it fits. For a 375x500 (4:3) image the
# box fits when r >= (4/3) s, which binds for s > 9/16: the densities of s and log r follow in closed form below,
# and a try fails with probability 0.26 (ten in a row: 1.4e-6, so the fallback is negligible here).
CROP_H, CROP_W = 375, 500
LOW, LOG_R0, LOG_R1 = 0.08, math.log(3 / 4), math.log(4 / 3)


def scale_cdf(x: np.ndarray) -> np.ndarray:
    """P(s <= x): density proportional to log(16/9) below 9/16, to -log(s) above (the log r that still fit)."""
    knee, flat = 9 / 16, math.log(16 / 9)

    def integral(t: np.ndarray) -> np.ndarray:
        below = flat * (np.minimum(t, knee) - LOW)
        above_to = np.maximum(t, knee)
        above = (above_to - above_to * np.log(above_to)) - (knee - knee * math.log(knee))
        return below + above

    return integral(np.clip(x, LOW, 1.0)) / integral(np.array(1.0))


def log_ratio_cdf(x: np.ndarray) -> np.ndarray:
    """P(log r <= x): density proportional to the scales that fit, 3 r / 4 - 0.08."""
    def integral(t: np.ndarray) -> np.ndarray:
        return 0.75 * (np.exp(t) - 0.75) - LOW * (t - LOG_R0)

    return integral(np.clip(x, LOG_R0, LOG_R1)) / integral(np.array(LOG_R1))


def test_crop_boxes_follow_torchvisions_documented_distribution():
    rng, jitter = np.random.default_rng(0), np.random.default_rng(1)
    boxes = np.array([[b.top, b.left, b.height, b.width] for b in
                      (random_resized_crop_box(CROP_H, CROP_W, rng) for _ in range(20000))], dtype=float)
    top, left, height, width = boxes.T
    assert stats.kstest(height * width / (CROP_H * CROP_W), scale_cdf).pvalue > 1e-3
    assert stats.kstest(np.log(width / height), log_ratio_cdf).pvalue > 1e-3
    # a corner uniform over its n positions, plus an independent U(0, 1), divided by n, is U(0, 1)
    for corner, room in ((top, CROP_H - height + 1), (left, CROP_W - width + 1)):
        assert stats.kstest((corner + jitter.uniform(size=len(corner))) / room, "uniform").pvalue > 1e-3
    assert 0.08 * 0.99 <= (height * width).min() / (CROP_H * CROP_W) and (height * width).max() <= CROP_H * CROP_W


@pytest.mark.parametrize("height,width,expected", [(10, 1000, Box(0, 493, 10, 13)), (1000, 10, Box(493, 0, 13, 10))])
def test_crop_falls_back_to_the_centre_clamped_to_the_ratio_range_when_nothing_fits(height, width, expected):
    """torchvision: after 10 failed tries, the whole short side and the long side cut to the nearest allowed ratio
    (4/3 or 3/4, rounded), centred. No box of area >= 8% with ratio <= 4/3 fits in 10x1000."""
    rng = np.random.default_rng(0)
    assert {random_resized_crop_box(height, width, rng) for _ in range(50)} == {expected}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * math.log10(255 ** 2 / mse)


@pytest.mark.parametrize("seed", range(6))
def test_reduced_size_decode_matches_full_decode(seed):
    size = (1500, 2000) if seed % 2 else (375, 500)
    data = encode(Image.fromarray(photo_like(*size, seed)), "JPEG", quality=90)
    full = simplejpeg.decode_jpeg(data, colorspace="RGB")
    for draw in range(10):
        rng = np.random.default_rng([seed, draw])
        reduced = np.zeros((224, 224, 3), np.uint8)
        load_into(data, reduced, "noflip", rng)
        box = random_resized_crop_box(*size, np.random.default_rng([seed, draw]))
        reference = np.zeros_like(reduced)
        resize_box_into(full, box, False, reference)
        assert psnr(reduced, reference) >= 30, (seed, draw, box)


def test_center_crop_is_centred_and_square():
    box = center_crop_box(300, 400)
    assert box == Box(19, 69, 262, 262)


def test_resize_writes_into_the_given_array():
    out = np.zeros((10, 10, 3), np.uint8)
    resize_box_into(np.full((40, 40, 3), 7, np.uint8), Box(0, 0, 40, 40), True, out)
    assert (out == 7).all()
    assert cv2.getNumThreads() == 1


def pillow_reference(data: bytes, size: int) -> np.ndarray:
    """What `load_into` must give with augment "none": Pillow's decode, centre crop, OpenCV resize."""
    pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    out = np.zeros((size, size, 3), np.uint8)
    resize_box_into(pixels, center_crop_box(*pixels.shape[:2]), False, out)
    return out


@pytest.mark.parametrize("mode", ["L", "RGB"])
def test_plain_png_gives_pillows_pixels(mode):
    data = encode(Image.fromarray(RGB).convert(mode), "PNG")
    out = np.zeros((24, 24, 3), np.uint8)
    load_into(data, out, "none", None)
    assert np.array_equal(out, pillow_reference(data, 24))


def as_a_producer(function, *args):
    """`function(*args)` in a fork of this process, where only this thread runs, as in a producer: libpng decodes
    only where no other thread can write to descriptor 2 meanwhile, and a test process holds others (a Loader's
    zygote keeper, pytest-xdist's). Its result comes back; an UnusableImage is raised again here, anything else as
    an AssertionError naming it."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        try:
            outcome = ("returned", function(*args))
        except BaseException as error:  # told to the parent, which raises it in the test
            outcome = ("raised", (type(error).__name__, str(error)))
        with os.fdopen(write, "wb") as channel:
            pickle.dump(outcome, channel)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as channel:
        kind, value = pickle.load(channel)
    os.waitpid(pid, 0)
    if kind == "returned":
        return value
    name, message = value
    raise UnusableImage(message) if name == "UnusableImage" else AssertionError(f"{name}: {message}")


def _decoded(data: bytes, side: int) -> np.ndarray:
    out = np.zeros((side, side, 3), np.uint8)
    load_into(data, out, "none", None)
    return out


def test_plain_png_decode_does_not_need_pillow(monkeypatch):
    """8-bit grey and RGB PNGs, most PNG datasets, are decoded by libpng: Pillow's Python per image cost more
    than the decode of a 32x32 image."""
    data = encode(Image.fromarray(RGB), "PNG")
    monkeypatch.setattr(Image, "open", lambda *args, **kwargs: pytest.fail("Pillow opened a plain PNG"))
    assert as_a_producer(_decoded, data, 24).std() > 5


def test_png_orientation_tag_is_ignored_as_pillow_ignores_it():
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees": a viewer would turn the image; the training pixels stay as stored
    data = encode(Image.fromarray(RGB), "PNG", exif=exif)
    out = np.zeros((24, 24, 3), np.uint8)
    load_into(data, out, "none", None)
    assert np.array_equal(out, pillow_reference(data, 24))


@pytest.mark.parametrize("mode", ["L", "RGB"])
def test_plain_png_cut_anywhere_is_refused_silently(mode, capfd):
    data = encode(Image.fromarray(photo_like(120, 160, 1)).convert(mode), "PNG")
    cuts = [*np.random.default_rng(2).integers(33, len(data) - 12, 25), len(data) - 12, len(data) - 1]
    for cut in cuts:  # after IHDR: inside the image data, and inside IEND
        with pytest.raises(UnusableImage, match="^truncated: "):
            as_a_producer(_decoded, data[:cut], 8)
    assert capfd.readouterr().err == ""  # libpng's messages are caught, not printed once per file and epoch


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def test_png_whose_image_data_ends_before_its_last_row_is_refused():
    """Pillow decodes this file, the rows its data lacks black; libpng refuses it, and so does stoker."""
    data = bytearray(encode(Image.fromarray(RGB), "PNG"))
    header = bytearray(data[16:29])
    header[4:8] = struct.pack(">I", RGB.shape[0] + 20)  # IHDR claims 20 rows more than the data holds
    data[8:33] = png_chunk(b"IHDR", bytes(header))
    assert np.asarray(Image.open(io.BytesIO(bytes(data))).convert("RGB"))[-20:].max() == 0
    with pytest.raises(UnusableImage, match="corrupt PNG.*Not enough image data"):
        as_a_producer(_decoded, bytes(data), 8)


def opened_by_pillow(monkeypatch) -> list[int]:
    """Counts Pillow's opens from here on."""
    opened, real_open = [], Image.open
    monkeypatch.setattr(Image, "open", lambda *args, **kwargs: opened.append(1) or real_open(*args, **kwargs))
    return opened


def test_png_libpng_warns_about_goes_to_pillow_silently(capfd, monkeypatch):
    """A malformed ancillary chunk: libpng decodes with a warning on stderr; Pillow decides, as for any PNG."""
    plain = encode(Image.fromarray(RGB), "PNG")
    data = plain[:33] + png_chunk(b"iCCP", b"x\x00\x00" + zlib.compress(b"short")) + plain[33:]
    opened = opened_by_pillow(monkeypatch)
    out = np.zeros((24, 24, 3), np.uint8)
    load_into(data, out, "none", None)
    assert opened == [1]
    assert np.array_equal(out, pillow_reference(data, 24))
    assert capfd.readouterr().err == ""


def test_png_decode_leaves_stderr_alone_while_another_thread_runs(monkeypatch):
    """Descriptor 2 is the process's: with a second thread alive it is not pointed away, and Pillow decodes."""
    data = encode(Image.fromarray(RGB), "PNG")
    stderr_before = os.readlink("/proc/self/fd/2")
    opened = opened_by_pillow(monkeypatch)
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        load_into(data, np.zeros((24, 24, 3), np.uint8), "none", None)
    finally:
        release.set()
        other.join()
    assert opened == [1] and os.readlink("/proc/self/fd/2") == stderr_before


def test_png_with_a_side_past_libpngs_limit_goes_to_pillow():
    data = encode(Image.new("L", (1_100_000, 2), 90), "PNG")  # within MAX_IMAGE_PIXELS, over libpng's 1,000,000
    out = np.zeros((2, 8, 3), np.uint8)
    load_into(data, out, "none", None)
    assert (out == 90).all()


# ---- decode caps on every path, image data that ends early, zeroed JPEG scans, checksums named --------

def with_image_data(png: bytes, raw_fraction: float) -> bytes:
    """The PNG with its IDAT chunks replaced by one whole zlib stream (end marker included) of only the first
    `raw_fraction` of its filtered rows: what a writer cut off, or a tool that lost rows, leaves before IEND."""
    chunks, position = [], 8
    while position < len(png):
        length, kind = struct.unpack_from(">I4s", png, position)
        chunks.append((kind, position, png[position + 8:position + 8 + length]))
        position += 12 + length
    raw = zlib.decompress(b"".join(body for kind, _, body in chunks if kind == b"IDAT"))
    idat = [c for c in chunks if c[0] == b"IDAT"]
    first, last = idat[0][1], idat[-1][1] + 12 + len(idat[-1][2])
    return png[:first] + png_chunk(b"IDAT", zlib.compress(raw[:int(len(raw) * raw_fraction)])) + png[last:]


def png_in_mode(mode: str, interlace: bool = False) -> bytes:
    pixels = photo_like(40, 56, 5)
    if mode == "I;16":
        return encode(Image.fromarray(pixels[:, :, 0].astype(np.uint16) * 257), "PNG")
    if mode == "RGB;16":  # 16 bits a channel: Pillow reads it as RGB, libpng's fast path never sees it
        return cv2.imencode(".png", pixels.astype(np.uint16) * 257)[1].tobytes()
    image = Image.fromarray(pixels).convert("RGBA" if mode == "RGBA" else mode)
    if mode == "RGBA":
        image.putalpha(Image.fromarray(photo_like(40, 56, 6)[:, :, 0]))
    return encode(image, "PNG", **({"interlace": 1} if interlace else {}))


@pytest.mark.parametrize("mode,interlace", [("RGBA", False), ("LA", False), ("P", False), ("I;16", False),
                                            ("RGB;16", False), ("RGBA", True), ("L", False), ("RGB", False)])
def test_png_whose_zlib_stream_ends_early_is_refused_in_every_mode(mode, interlace):
    """Pillow decodes such a file, the rows the stream lacks black or white (checked here); it must be refused on
    the Pillow path as libpng refuses it on the fast one. The whole file, in the same mode, still decodes."""
    whole = png_in_mode(mode, interlace)
    cut = with_image_data(whole, 0.6)
    assert Image.open(io.BytesIO(cut)).convert("RGB").size == (56, 40)  # Pillow fills the rest, no error
    load_into(whole, np.zeros((8, 8, 3), np.uint8), "none", None)
    with pytest.raises(UnusableImage, match="^(truncated|corrupt PNG)"):
        load_into(cut, np.zeros((8, 8, 3), np.uint8), "none", None)


@pytest.mark.parametrize("progressive", [False, True], ids=["baseline", "progressive"])
@pytest.mark.parametrize("cmyk", [False, True], ids=["rgb", "cmyk"])
def test_jpeg_with_its_middle_zeroed_and_its_end_marker_intact_is_refused(progressive, cmyk):
    """libjpeg-turbo decodes the zeros as pixels and only warns; the lenient decode used to train on it."""
    data = photograph_jpeg(0, progressive)
    if cmyk:
        data = encode(Image.open(io.BytesIO(data)).convert("CMYK"), "JPEG", quality=90, progressive=progressive)
    start = scan_data_start(data)
    third = (len(data) - 2 - start) // 3
    zeroed = data[:start + third] + bytes(third) + data[start + 2 * third:]
    assert zeroed.endswith(b"\xff\xd9") and simplejpeg.decode_jpeg(zeroed, strict=False).shape[:2] == (427, 640)
    load_into(data, np.zeros((32, 32, 3), np.uint8), "none", None)
    for augment in ("standard", "none"):  # reduced-size and full-size decodes
        with pytest.raises(UnusableImage, match="^(corrupt JPEG|truncated)"):
            load_into(zeroed, np.zeros((32, 32, 3), np.uint8), augment, np.random.default_rng(0))


@pytest.mark.parametrize("mode", ["RGB", "RGBA"], ids=["libpng", "pillow"])
def test_png_whose_only_fault_is_a_text_chunk_checksum_is_called_that(mode):
    plain = encode(Image.fromarray(RGB).convert(mode), "PNG")
    text = bytearray(png_chunk(b"tEXt", b"Comment\x00hello"))
    text[-1] ^= 0xFF
    data = plain[:33] + bytes(text) + plain[33:]
    with pytest.raises(UnusableImage, match="corrupt PNG: its tEXt chunk fails its CRC check"):
        load_into(data, np.zeros((8, 8, 3), np.uint8), "none", None)


def flipped_first_idat_length(mode: str) -> bytes:
    """A valid small PNG with the top byte of its first IDAT length flipped: the 312-byte file of the issue."""
    data = bytearray(encode(Image.fromarray(RGB).convert(mode), "PNG"))
    data[data.index(b"IDAT") - 4] ^= 0xFF
    return bytes(data)


def jpeg_claiming(width: int, height: int, mode: str) -> bytes:
    """A small JPEG whose frame header claims `width` x `height` (a bomb in 1 KB)."""
    data = bytearray(encode(Image.fromarray(RGB).convert(mode), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


PEAK_PROBE = """
import resource, sys
import numpy as np
from stoker.data.pixels.imaging import UnusableImage, load_into, make_decode_warnings_errors
make_decode_warnings_errors()
data = sys.stdin.buffer.read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    load_into(data, np.zeros((8, 8, 3), np.uint8), "none", None)
    print("decoded", end=" ")
except UnusableImage as error:
    print("refused:", error, end=" ")
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10)
"""


@pytest.mark.parametrize("name,data", [
    ("plain PNG (libpng through OpenCV)", flipped_first_idat_length("RGB")),
    ("grey PNG (libpng through OpenCV)", flipped_first_idat_length("L")),
    ("RGBA PNG (Pillow)", flipped_first_idat_length("RGBA")),
    ("RGB JPEG (libjpeg-turbo)", jpeg_claiming(60000, 60000, "RGB")),
    ("CMYK JPEG (libjpeg-turbo, then Pillow)", jpeg_claiming(60000, 60000, "CMYK")),
    ("bomb PNG (Pillow)", forged_png_header(8000, 7000, bit_depth=16, colour_type=6)),
])
def test_one_decode_stays_within_its_memory_cap_on_every_path(name, data):
    """A crafted file is refused without the decode's peak memory passing MAX_DECODE_BYTES (1 GiB): measured in a
    process of its own, from its peak resident size. OpenCV once took 4 GB for the flipped IDAT length."""
    probe = subprocess.run([sys.executable, "-c", PEAK_PROBE], input=data, capture_output=True, timeout=60)
    *verdict, grown_mb = probe.stdout.decode().split()
    assert probe.returncode == 0, probe.stderr.decode()[-2000:]
    assert verdict[0] == "refused:", f"{name}: {' '.join(verdict)}"
    assert int(grown_mb) < 1024, f"{name}: the decode's peak grew by {grown_mb} MB"

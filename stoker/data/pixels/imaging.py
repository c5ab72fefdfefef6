"""Decode and augment one image straight into a preallocated uint8 HWC array.

The crop box is chosen from the header's dimensions first; JPEGs are then decoded by libjpeg-turbo at the
smallest M/8 scale that keeps the box at least as large as the output (so nothing is upsampled that a full decode
would not), only the rows and columns around the box where the extension _jpegcrop is built, and OpenCV resizes the
box into the destination. Other formats go through Pillow with an
explicit format list; every mode (grayscale, palette, RGBA, CMYK, 16-bit) becomes 3-channel RGB.
"""

from __future__ import annotations

import io
import logging
import math
import os
import re
import struct
import threading
import time
import warnings
import zlib
from dataclasses import dataclass
from typing import cast

import cv2
import numpy as np
import simplejpeg
from PIL import Image

from stoker.common.choices import Augment
from stoker.data.pixels.policies import POLICIES, apply_policy

try:  # libjpeg-turbo's partial decoding, built from _jpegcrop.c; without it JPEGs are decoded whole, to the same pixels
    from stoker.data.pixels import _jpegcrop
except ImportError:
    _jpegcrop = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

FLIPPED = ("standard", "trivial", "randaug")  # the augmentations with a random horizontal flip

# Pillow decodes only these; most Pillow CVEs are in formats it would otherwise auto-detect.
PILLOW_FORMATS = ("JPEG", "PNG", "BMP", "WEBP", "TIFF", "PPM")
MAX_IMAGE_PIXELS = 64_000_000
# What one decode may hold at its peak (the decoded image and every copy the conversion to RGB makes), estimated
# from the header before anything is decoded; more is refused as bad input. A 64-Mpixel RGB photo takes 704 MiB.
MAX_DECODE_BYTES = 1 << 30
# One sample's encoded bytes, read whole into memory (a producer has up to 64 reads in flight): a 64-Mpixel JPEG
# holds 10-30 MB. A larger member is listed as refused, never read: a shard's index, or a server, may claim any size.
MAX_SAMPLE_BYTES = 64 << 20


def too_large(size: int) -> str:
    """Why a sample of `size` encoded bytes is not read."""
    return f"{size} bytes, more than the {MAX_SAMPLE_BYTES} one image may hold"
CENTER_CROP_FRACTION = 0.875  # resize short side to size/0.875, then center-crop: the usual validation recipe
SCALE_RANGE = (0.08, 1.0)
RATIO_RANGE = (3 / 4, 4 / 3)
JPEG_MAGIC = b"\xff\xd8"
# Pixels decoded around a crop box beyond it: fancy upsampling reads a chroma sample's neighbours (at most 4:1:1's
# 4 pixels away), so the box's own pixels come out as in the whole decode.
REGION_MARGIN = 4
JPEG_EOI = b"\xff\xd9"  # end of image: a complete JPEG ends with it (entropy-coded data can never hold it)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PNG_IEND = b"IEND\xaeB`\x82"  # the last chunk's type and CRC: a whole PNG ends with them
PNG_MAX_CHUNK = (1 << 31) - 1  # the PNG specification's largest chunk length
PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # per IHDR colour type: grey, RGB, palette, grey+alpha, RGBA
# Adam7's seven passes as (first column, first row, column step, row step).
ADAM7_PASSES = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
INFLATE_PIECE = 1 << 20  # the image-data check inflates at most this much at a time: its memory stays small
LIBPNG_MAX_SIDE = 1_000_000  # libpng's default user limit on a side: a longer one goes to Pillow
MAX_REASON_CHARS = 200
PLAIN_PNG_COLOUR_TYPES = (0, 2)  # IHDR colour types grey and RGB: nothing to composite, no palette
# libpng through OpenCV, as Pillow decodes: no EXIF rotation (Pillow's path applies none either).
PNG_READ_FLAGS = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION

cv2.setNumThreads(1)  # producers are processes; OpenCV's own thread pool would oversubscribe the cores
# OpenCV's own log would print a line per refused file, each epoch; stoker reports the file once, with a reason.
cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)


# A file that could not be read (EIO on a network disk, EMFILE, a request that kept failing): tried again in later
# epochs, unlike one that was read and could not be decoded, which later epochs skip unread.
UNREADABLE = "unreadable:"


class UnusableImage(Exception):
    """The file cannot be turned into a training image; the message says why."""


def make_decode_warnings_errors() -> None:
    """Pillow only warns between MAX_IMAGE_PIXELS and twice that; a bomb must fail. Filters are per process."""
    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
    warnings.simplefilter("error", Image.DecompressionBombWarning)


@dataclass(frozen=True)
class Box:
    """A crop in source pixel coordinates."""

    top: int
    left: int
    height: int
    width: int


def random_resized_crop_box(height: int, width: int, rng: np.random.Generator) -> Box:
    """torchvision's RandomResizedCrop.get_params: 10 tries at area and log-uniform ratio, then a center crop."""
    area = height * width
    log_ratio = (math.log(RATIO_RANGE[0]), math.log(RATIO_RANGE[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*SCALE_RANGE)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return Box(top, left, h, w)
    in_ratio = width / height
    if in_ratio < RATIO_RANGE[0]:
        w, h = width, int(round(width / RATIO_RANGE[0]))
    elif in_ratio > RATIO_RANGE[1]:
        h, w = height, int(round(height * RATIO_RANGE[1]))
    else:
        w, h = width, height
    return Box((height - h) // 2, (width - w) // 2, h, w)


def center_crop_box(height: int, width: int) -> Box:
    side = max(1, int(round(min(height, width) * CENTER_CROP_FRACTION)))
    return Box((height - side) // 2, (width - side) // 2, side, side)


def choose_box(height: int, width: int, augment: Augment,
               rng: np.random.Generator | None) -> tuple[Box, bool]:
    """The crop box and whether to flip it horizontally; `rng` may be None when `augment` is "none"."""
    if augment == "none":
        return center_crop_box(height, width), False
    assert rng is not None, "a random crop needs a generator"
    box = random_resized_crop_box(height, width, rng)
    return box, augment in FLIPPED and bool(rng.integers(0, 2))


@dataclass
class StageClock:
    """CPU seconds of the calling thread per stage of load_into, summed over calls: decode (header, entropy decode,
    IDCT, colour conversion), resize (crop, resize and flip, written straight into `out`: for a producer, the ring's
    slot) and augment (TrivialAugment, RandAugment); the caller adds `draw`, making the sample's generator (0.1 ms
    of a 1.3 ms image here). A producer has one thread: its clock is the process's."""

    draw: float = 0.0
    decode: float = 0.0
    resize: float = 0.0
    augment: float = 0.0


def load_into(data: bytes, out: np.ndarray, augment: Augment, rng: np.random.Generator | None,
              clock: StageClock | None = None, checked_before: bool = False) -> None:
    """Decode `data`, crop and resize into `out` (H, W, 3 uint8), then TrivialAugment or RandAugment where asked.
    Raises UnusableImage for bad files. With `clock`, the CPU time of each stage is added to it. `checked_before`:
    these bytes have loaded before, so a crop-aware JPEG decode may stop at the box's last row (the same pixels;
    damage below the box is seen only by reading the scan to its end, and a first load does, but for a JPEG whose
    pack-time seal is intact: `seal_intact`)."""
    started, resized = time.thread_time(), clock.resize if clock else 0.0
    try:
        _crop_into(data, out, augment, rng, clock, checked_before)
    finally:
        if clock is not None:
            clock.decode += time.thread_time() - started - (clock.resize - resized)
    if augment in POLICIES and rng is not None:  # after the crop's draws, from the same generator
        started = time.thread_time()
        apply_policy(out, augment, rng)
        if clock is not None:
            clock.augment += time.thread_time() - started


def _crop_into(data: bytes, out: np.ndarray, augment: Augment, rng: np.random.Generator | None,
               clock: StageClock | None, checked_before: bool = False) -> None:
    if data[:2] == JPEG_MAGIC:
        try:
            _jpeg_into(data, out, augment, rng, clock, checked_before)
            return
        except _NeedsPillow:  # a CMYK/YCCK JPEG, checked strictly already
            image = _pillow_pixels(data)
    else:
        image = whole_pixels(data)
    box, flip = choose_box(image.shape[0], image.shape[1], augment, rng)  # every draw after the decode
    resize_box_into(image, box, flip, out, clock)


def whole_pixels(data: bytes, min_height: int = 0, min_width: int = 0) -> np.ndarray:
    """The whole image as RGB (H, W, 3) uint8, as training decodes it, a JPEG at the smallest SIMD scale at least
    min_height x min_width; UnusableImage where training refuses it. A raw member is its own pixels, not copied."""
    if not data:
        raise UnusableImage("empty file")
    if data[:len(NPY_MAGIC)] == NPY_MAGIC:
        return raw_pixels(data)
    chunks = png_chunks(data) if data[:8] == PNG_MAGIC else None
    try:
        if data[:2] == JPEG_MAGIC:
            return _jpeg_whole(data, min_height, min_width)
        if _is_plain_png(data):
            return _png_pixels(data)
    except _NeedsPillow:
        pass
    return _pillow_pixels(data, chunks)


class _NeedsPillow(Exception):
    """A file the fast decoder does not take, which Pillow decodes: a CMYK/YCCK JPEG, a PNG libpng warned about
    or cannot be asked about (a side over its limit, another thread alive, an OpenCV limit)."""


def _jpeg_into(data: bytes, out: np.ndarray, augment: Augment, rng: np.random.Generator | None,
               clock: StageClock | None = None, checked_before: bool = False) -> None:
    height, width = _jpeg_size(data)
    box, flip = choose_box(height, width, augment, rng)
    out_h, out_w = out.shape[:2]
    # The box at least out_h x out_w after the decode's scale (M/8).
    min_h = math.ceil(height * out_h / box.height)
    min_w = math.ceil(width * out_w / box.width)
    # libjpeg-turbo decodes damaged scan data without error and only warns: a file cut short gets its missing part
    # grey, one with a zeroed stretch ending in a whole EOI decodes the zeros as pixels. Strict, every warning is an
    # error, and it costs nothing on a good file (the same decode: measured in docs/benchmarks.md).
    try:
        eighths = scale_eighths(height, width, min_h, min_w)
        if _jpegcrop is not None:
            first_load = not (checked_before or seal_intact(data))
            image, scaled = _decode_region(data, box, height, width, eighths, to_end=first_load)
        else:
            image = _decode_at(data, height, width, eighths)
            scaled = _scaled_box(box, image.shape[0] / height, image.shape[1] / width)
    except ValueError as error:
        raise UnusableImage(_jpeg_failure(str(error))) from None
    resize_box_into(image, scaled, flip, out, clock)


# The DCT scales libjpeg-turbo decodes with SIMD: 3/8 and 5/8-7/8 run its plain-C scaled inverse DCTs and cost more
# than the whole image (ImageNet-like photos, one core: 6/8 1.19 ms, 7/8 1.44, 8/8 0.87; docs/benchmarks.md).
FAST_EIGHTHS = (1, 2, 4, 8)


def scale_eighths(height: int, width: int, min_height: int, min_width: int) -> int:
    """The smallest M of FAST_EIGHTHS for which libjpeg-turbo's M/8 decode is at least min_height x min_width, a
    minimum past the image's own side taken as that side."""
    min_height, min_width = min(min_height, height), min(min_width, width)
    return next(eighths for eighths in FAST_EIGHTHS
                if scaled_side(height, eighths) >= min_height and scaled_side(width, eighths) >= min_width)


def scaled_side(side: int, eighths: int) -> int:
    """A side of libjpeg's M/8 decode (its jdiv_round_up)."""
    return -(-side * eighths // 8)


def shrink(data: bytes, max_side: int, quality: int) -> bytes | None:
    """The image as a JPEG at `quality` whose longer side is `max_side`, or None where the file is to be kept as it
    is: its longer side is `max_side` or less (never upscaled), or it cannot be decoded (the run reports it)."""
    size = stored_size(data)
    if size is None or max(size) <= max_side:
        return None
    try:
        return encode_jpeg(shrunk_pixels(data, size, max_side), quality)
    except UnusableImage:
        return None


def shrunk_pixels(data: bytes, size: tuple[int, int], max_side: int | None) -> np.ndarray:
    """The image of header size `size` (height, width) decoded once, as training decodes it (UnusableImage where
    training refuses it: the decode is also the check), shrunk by area averaging to a longer side of `max_side`
    where it is longer (never upscaled); `max_side` None keeps its size."""
    if max_side is None or max(size) <= max_side:
        return whole_pixels(data)
    scale = max_side / max(size)
    height, width = max(1, round(size[0] * scale)), max(1, round(size[1] * scale))
    # at twice the size or more, then area averaging: a plain reduced-size decode blurs less evenly
    pixels = whole_pixels(data, 2 * height, 2 * width)
    return cast(np.ndarray, cv2.resize(pixels, (width, height), interpolation=cv2.INTER_AREA))


def encode_jpeg(pixels: np.ndarray, quality: int) -> bytes:
    """RGB pixels as a 4:2:0 JPEG at `quality`, as `stoker pack --max-side` stores them."""
    return cast(bytes, simplejpeg.encode_jpeg(np.ascontiguousarray(pixels), quality=quality, colorspace="RGB",
                                              colorsubsampling="420"))


def can_rewrite_jpegs() -> bool:
    """Whether this machine rewrites JPEGs with restart markers: the extension _jpegcrop is built and decodes as
    simplejpeg does."""
    return _jpegcrop is not None


def with_restart_markers(data: bytes) -> bytes:
    """A JPEG rewritten losslessly with a restart marker after every MCU (the same coefficients, so the same pixels
    from any decoder that, as stoker, applies no EXIF orientation or ICC profile), which a crop-aware decode cuts
    down to the MCUs around its box, and sealed (`sealed`): from its first load on. `data` as it is where the
    rewrite does not apply (not a YCbCr or greyscale JPEG, a progressive one never fully refined, the extension not
    built) or fails (a file the check before refused)."""
    if not can_rewrite_jpegs() or data[:2] != JPEG_MAGIC:
        return data
    try:
        rewritten = _jpegcrop.restart_every_mcu(data)
    except ValueError:
        return data
    return data if rewritten is None else sealed(rewritten)


# A JPEG that restart_every_mcu wrote read every coefficient of its source strictly (a warning is an error), so it
# holds no damage; sealed, it carries the CRC-32 of its bytes in a comment segment after its start marker (and after
# JFIF's APP0, which readers expect first). A first load that finds the seal intact needs no whole read to see
# damage and is cut down to the box as a later load is; a byte changed since (a disk's, a copy's) breaks the seal,
# and the file is read whole as any other.
SEAL = b"stoker: checked whole, crc32 "
_COMMENT, _JFIF = b"\xff\xfe", b"\xff\xe0"
_SEAL_LENGTH = 2 + len(SEAL) + 8  # the segment's length field: itself, SEAL and 8 lowercase hex digits


def _seal_at(data: bytes) -> int:
    """Where the seal's segment goes (or is): after SOI, and after a JFIF APP0 segment right behind it."""
    if data[2:4] == _JFIF and len(data) >= 6:
        return 4 + int.from_bytes(data[4:6], "big")
    return 2


def sealed(jpeg: bytes) -> bytes:
    """`jpeg` with a comment segment holding SEAL and the CRC-32 of `jpeg`, in lowercase hex (`_seal_at`)."""
    at = _seal_at(jpeg)
    segment = _COMMENT + struct.pack(">H", _SEAL_LENGTH) + SEAL + b"%08x" % zlib.crc32(jpeg)
    return jpeg[:at] + segment + jpeg[at:]


def seal_intact(data: bytes) -> bool:
    """Whether `data` is a sealed JPEG whose bytes, the seal's segment left out, still have the CRC-32 it holds."""
    at = _seal_at(data)
    end = at + 2 + _SEAL_LENGTH
    if len(data) < end or data[at:at + 2] != _COMMENT or int.from_bytes(data[at + 2:at + 4], "big") != _SEAL_LENGTH:
        return False
    if data[at + 4:end - 8] != SEAL:
        return False
    view = memoryview(data)
    return b"%08x" % zlib.crc32(view[end:], zlib.crc32(view[:at])) == data[end - 8:end]


def stored_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from the header, or None where there is no readable header."""
    try:
        if data[:len(NPY_MAGIC)] == NPY_MAGIC:
            return _raw_header(data)[:2]
        if data[:2] == JPEG_MAGIC:
            height, width = simplejpeg.decode_jpeg_header(data)[:2]
            return height, width
        with Image.open(io.BytesIO(data), formats=PILLOW_FORMATS) as image:
            return image.height, image.width
    except (ValueError, OSError, SyntaxError, EOFError, Image.DecompressionBombError, UnusableImage):
        return None


def _jpeg_whole(data: bytes, min_height: int, min_width: int) -> np.ndarray:
    """The whole JPEG decoded strictly, as _jpeg_into decodes it; a CMYK/YCCK one is checked and left to Pillow."""
    height, width = _jpeg_size(data)
    # A SIMD scale, as training's; no minimum is the whole size (scale_eighths would take 1/8 for it).
    eighths = scale_eighths(height, width, min_height or height, min_width or width)
    try:
        return _decode_at(data, height, width, eighths)
    except ValueError as error:
        raise UnusableImage(_jpeg_failure(str(error))) from None


def _jpeg_size(data: bytes) -> tuple[int, int]:
    """(height, width) from a JPEG's header, checked; a CMYK/YCCK JPEG is checked strictly and left to Pillow."""
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError as error:
        raise UnusableImage(f"bad JPEG header: {error}") from None
    _check_pixels(height, width)
    if colorspace in ("CMYK", "YCCK"):
        _check_jpeg_strictly(data)  # Pillow's libjpeg fills a damaged scan with grey and says nothing
        raise _NeedsPillow
    return height, width


def _decode_at(data: bytes, height: int, width: int, eighths: int) -> np.ndarray:
    """The whole JPEG, strictly, at libjpeg-turbo's `eighths`/8 scale: simplejpeg picks the smallest scale whose size
    is at least the one asked, so asked for that scale's own size it decodes at it. ValueError on a bad file."""
    return cast(np.ndarray, simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=scaled_side(height, eighths),
                                                   min_width=scaled_side(width, eighths), strict=True))


# Raw members: `stoker pack --raw-max-side` stores small images as their RGB pixels in numpy's .npy format, read
# with no decode and no copy (np.frombuffer) straight into the crop and resize. Only the header np.save writes for a
# C-order uint8 (H, W, 3) array is taken: parsing it costs 1.5 us here, numpy's own reader (ast.literal_eval) 46 us.
NPY_MAGIC = b"\x93NUMPY"
RAW_EXTENSION = ".npy"
_NPY_HEADER = re.compile(rb"\{'descr': '\|u1', 'fortran_order': False, 'shape': \((\d{1,9}), (\d{1,9}), 3\), \} *\n")


def encode_raw(pixels: np.ndarray) -> bytes:
    """RGB pixels (H, W, 3) uint8 as a .npy member (format 1.0: a 128-byte header, then the pixels)."""
    stored = io.BytesIO()
    np.save(stored, np.ascontiguousarray(pixels, np.uint8), allow_pickle=False)
    return stored.getvalue()


def raw_pixels(data: bytes) -> np.ndarray:
    """A raw member's pixels, a view of `data`; UnusableImage where it is not a whole (H, W, 3) uint8 .npy."""
    height, width, offset = _raw_header(data)
    _check_pixels(height, width)
    held, expected = len(data) - offset, height * width * 3
    if held < expected:
        raise UnusableImage(f"truncated: raw pixels of {held} bytes where its .npy header says {height}x{width}x3 "
                            f"({expected} bytes)")
    if held > expected:
        raise UnusableImage(f"corrupt raw pixels: {held} bytes where its .npy header says {height}x{width}x3 "
                            f"({expected} bytes)")
    return np.frombuffer(data, np.uint8, expected, offset).reshape(height, width, 3)


def is_raw_pixels(head: bytes) -> bool:
    """Whether a member beginning with `head` (its first 256 bytes, say) has the header of raw pixels as `stoker pack
    --raw-max-side` writes them, not of another array (a WebDataset's features)."""
    try:
        _raw_header(head)
    except UnusableImage:
        return False
    return True


def _raw_header(data: bytes) -> tuple[int, int, int]:
    """(height, width, where the pixels start) of a .npy member."""
    if data[6:8] != b"\x01\x00" or len(data) < 10:
        raise UnusableImage(f"corrupt raw pixels: a .npy of version {tuple(data[6:8])}, not 1.0 as pack writes")
    end = 10 + int.from_bytes(data[8:10], "little")
    if len(data) < end:
        raise UnusableImage(f"truncated: the file ends inside its .npy header ({len(data)} of {end} bytes)")
    header = bytes(data[10:end])
    found = _NPY_HEADER.fullmatch(header)
    if found is None:
        raise UnusableImage(f"corrupt raw pixels: the .npy header {header[:100]!r} is not that of uint8 "
                            f"(height, width, 3) pixels in C order")
    return int(found[1]), int(found[2]), end


def _scaled_box(box: Box, scale_y: float, scale_x: float) -> Box:
    return Box(int(box.top * scale_y), int(box.left * scale_x),
               max(1, round(box.height * scale_y)), max(1, round(box.width * scale_x)))


def _decode_region(data: bytes, box: Box, height: int, width: int, eighths: int,
                   to_end: bool = True) -> tuple[np.ndarray, Box]:
    """Only the rows and columns of the M/8 image that `box` covers, with REGION_MARGIN pixels around them (the
    context fancy upsampling reads), through libjpeg-turbo's partial decode, and the box within that region. The
    box's pixels are those of the whole decode (tested bitwise), so the output is the same either way. The other
    rows are entropy-decoded only, those below the box unless `to_end` is False: a damaged or cut file is refused
    whatever the crop, as by the whole decode."""
    scaled_h, scaled_w = scaled_side(height, eighths), scaled_side(width, eighths)
    scaled = _scaled_box(box, scaled_h / height, scaled_w / width)
    top, left = min(max(scaled.top, 0), scaled_h - 1), min(max(scaled.left, 0), scaled_w - 1)
    first_row, end_row = max(0, top - REGION_MARGIN), min(scaled_h, top + scaled.height + REGION_MARGIN)
    first_column, end_column = max(0, left - REGION_MARGIN), min(scaled_w, left + scaled.width + REGION_MARGIN)
    assert _jpegcrop is not None
    pixels, decoded_left, decoded_width = _jpegcrop.decode(
        data, eighths, first_row, first_column, end_row - first_row, end_column - first_column, to_end)
    image = np.frombuffer(pixels, np.uint8).reshape(end_row - first_row, decoded_width, 3)
    return image, Box(top - first_row, left - decoded_left, scaled.height, scaled.width)


def _check_jpeg_strictly(data: bytes) -> None:
    """A JPEG Pillow is to decode, decoded once by libjpeg-turbo with every warning an error (CMYK files: 0.002%
    of ImageNet, so the second decode costs nothing in all)."""
    try:
        simplejpeg.decode_jpeg(data, colorspace="CMYK", strict=True)
    except ValueError as error:
        raise UnusableImage(_jpeg_failure(str(error))) from None


def png_chunks(data: bytes) -> list[tuple[bytes, int, int]]:
    """(type, where its data starts, its length) of each chunk up to IEND (or the end of a cut file). Checked
    before any decoder sees the file: OpenCV allocates a chunk's stated length before reading it (4 GB for one
    flipped byte in a 312-byte file), so a length past the file's end is refused here."""
    chunks, position, end = [], len(PNG_MAGIC), len(data)
    while position + 12 <= end:
        length, kind = struct.unpack_from(">I4s", data, position)
        if length > PNG_MAX_CHUNK or position + 12 + length > end:
            if PNG_IEND not in data[position:]:
                raise UnusableImage(f"truncated: the file ends inside its {_chunk_name(kind)} chunk")
            raise UnusableImage(f"corrupt PNG: its {_chunk_name(kind)} chunk claims {length} bytes, "
                                f"{position + 12 + length - end} past the file's end")
        chunks.append((kind, position + 8, length))
        position += 12 + length
        if kind == b"IEND":
            break
    return chunks


def _chunk_name(kind: bytes) -> str:
    return kind.decode("ascii") if kind.isalpha() else repr(kind)


def _png_image_data_complete(data: bytes, chunks: list[tuple[bytes, int, int]]) -> bool:
    """Whether the IDAT chunks inflate to every row IHDR announces. Pillow decodes a zlib stream that ends early
    (its end marker and IEND intact) without a word, the rows left black: libpng refuses it ('Not enough image
    data'), and so must the Pillow path."""
    width, height, depth, colour, interlaced = struct.unpack_from(">IIBBxxB", data, 16)
    bits = PNG_CHANNELS.get(colour, 4) * depth
    passes = ADAM7_PASSES if interlaced else ((0, 0, 1, 1),)
    needed = 0
    for column, row, column_step, row_step in passes:
        pass_width, pass_height = -(-(width - column) // column_step), -(-(height - row) // row_step)
        if pass_width > 0 and pass_height > 0:
            needed += pass_height * (1 + -(-pass_width * bits // 8))  # a filter byte, then the row's bytes
    inflater, produced = zlib.decompressobj(), 0
    try:
        for kind, start, length in chunks:
            if kind != b"IDAT":
                continue
            piece: bytes = memoryview(data)[start:start + length]  # type: ignore[assignment]
            while piece and produced < needed and not inflater.eof:
                produced += len(inflater.decompress(piece, min(INFLATE_PIECE, needed - produced)))
                piece = inflater.unconsumed_tail
    except zlib.error:
        return False
    return produced >= needed


def _may_lack_rows(image: Image.Image) -> bool:
    """Whether a decoded PNG could be one whose image data ended early: Pillow's image starts zeroed, and the
    rows (or, interlaced, the odd rows of the last pass) its data lacked stay zero, so one of the last two rows is
    all zero bytes. Only then is the stream inflated again to be sure: on a whole file that check alone cost
    36% of an RGBA decode and 60% of a palette one (measured in docs/benchmarks.md)."""
    if image.height <= 2:
        return True
    for row in (image.height - 2, image.height - 1):
        raw = image.crop((0, row, image.width, row + 1)).tobytes()
        if raw == bytes(len(raw)):
            return True
    return False


def _is_plain_png(data: bytes) -> bool:
    """An 8-bit grey or RGB PNG, from its IHDR (always the first chunk)."""
    return data[:8] == PNG_MAGIC and data[12:16] == b"IHDR" and len(data) >= 26 and data[24] == 8 \
        and data[25] in PLAIN_PNG_COLOUR_TYPES


def _png_pixels(data: bytes) -> np.ndarray:
    """Through libpng, when it has nothing to say: the same pixels as Pillow's decode, in less than half its time
    on small images (no Python per image). A file libpng decodes with a warning (a bad ancillary chunk, an odd
    colour profile) goes to Pillow, as every PNG did before. One it refuses is unusable, even where Pillow would
    decode it: a cut file (IEND included), or image data that ends before the last row (Pillow fills the rows
    left with black)."""
    width, height = struct.unpack(">II", data[16:24])
    # At 8 bits and 1 or 3 channels the decode's peak is about 12 bytes a pixel (measured, an APNG's two frames
    # included): at MAX_IMAGE_PIXELS 0.77 GB, under MAX_DECODE_BYTES.
    _check_pixels(height, width)
    if max(width, height) > LIBPNG_MAX_SIDE:
        raise _NeedsPillow
    image, said = _libpng_decode(data)
    if image is None:
        raise UnusableImage(_png_refusal(data, said))
    if said:
        raise _NeedsPillow
    return image


# Where libpng's stderr goes during a decode: (pid, memory file), one per process (a forked child makes its own: a
# shared file would share its offset and size).
_libpng_messages: tuple[int, int] | None = None
_descriptor_2 = threading.Lock()


def _libpng_decode(data: bytes) -> tuple[np.ndarray | None, str]:
    """(the RGB image or None, what libpng said). libpng writes its warnings and errors straight to descriptor 2,
    past OpenCV's log level: caught here, they would otherwise print a line per image and epoch. Descriptor 2 is
    the whole process's, so it is pointed away only where no other thread can write to it or decode meanwhile
    (a producer has one thread); elsewhere Pillow decodes. While it points away, a crash inside libpng loses its
    own message; the producer's death still names the file."""
    global _libpng_messages
    if threading.active_count() > 1 or not _descriptor_2.acquire(blocking=False):
        raise _NeedsPillow
    try:
        if _libpng_messages is None or _libpng_messages[0] != os.getpid():
            _libpng_messages = (os.getpid(), _memory_file())
        messages = _libpng_messages[1]
        if messages < 0:
            raise _NeedsPillow
        stderr = os.dup(2)
        try:
            os.dup2(messages, 2)
            image = cv2.imdecode(np.frombuffer(data, np.uint8), PNG_READ_FLAGS)
        except cv2.error:  # an OpenCV limit (OPENCV_IO_MAX_IMAGE_PIXELS, say): Pillow decides
            raise _NeedsPillow from None
        finally:
            os.dup2(stderr, 2)
            os.close(stderr)
            said = _take_messages(messages)
        return image, said
    finally:
        _descriptor_2.release()


def _memory_file() -> int:
    """A memory file for libpng's messages, or -1 where descriptor 2 is closed (the file would take its number and
    become the process's stderr for good)."""
    messages = os.memfd_create("stoker-libpng-messages", os.MFD_CLOEXEC)
    if messages > 2:
        return messages
    os.close(messages)
    return -1


def _take_messages(messages: int) -> str:
    """What libpng wrote, emptied for the next file: its last error (or warning), repeats folded, kept short."""
    size = os.fstat(messages).st_size
    if not size:
        return ""
    tail = os.pread(messages, 4096, max(0, size - 4096)).decode(errors="replace")
    os.ftruncate(messages, 0)
    os.lseek(messages, 0, os.SEEK_SET)  # descriptor 2 shared this offset while it pointed here
    lines = [line for line in tail.splitlines() if line.startswith(("libpng error: ", "libpng warning: "))]
    errors = [line for line in lines if line.startswith("libpng error: ")]
    last = (errors or lines or [tail.strip() or "libpng spoke"])[-1]
    return last.removeprefix("libpng error: ").removeprefix("libpng warning: ")[:MAX_REASON_CHARS]


def _png_refusal(data: bytes, said: str) -> str:
    reason = f" ({said})" if said else ""
    if PNG_IEND not in data:
        return f"truncated: the file ends before its IEND chunk{reason}"
    return f"corrupt PNG: libpng refused it{reason}"


def _jpeg_failure(message: str) -> str:
    if message.startswith("Premature end"):  # libjpeg's JWRN_JPEG_EOF: the data ran out before EOI
        return f"truncated: {message} (the file ends inside its image data)"
    return f"corrupt JPEG: {message}"


def _pillow_pixels(data: bytes, chunks: list[tuple[bytes, int, int]] | None = None) -> np.ndarray:
    """The whole image as RGB through Pillow; UnusableImage with the reason where it cannot be."""
    try:
        with Image.open(io.BytesIO(data), formats=PILLOW_FORMATS) as image:
            _check_pixels(image.height, image.width)
            _check_decode_bytes(image)
            pixels = to_rgb_array(image)
            lacking = chunks is not None and _may_lack_rows(image) and not _png_image_data_complete(data, chunks)
        if lacking:
            raise UnusableImage("truncated: its image data ends before the last row (a zlib stream that ends early)")
    except UnusableImage:
        raise
    except Image.DecompressionBombError as error:
        raise UnusableImage(f"decompression bomb: {error}") from None
    except Image.DecompressionBombWarning as error:
        raise UnusableImage(f"decompression bomb: {error}") from None
    except Image.UnidentifiedImageError:
        if chunks is not None:
            raise UnusableImage(_png_unopened(data, chunks)) from None
        raise UnusableImage(f"not an image in a supported format ({', '.join(PILLOW_FORMATS)})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as error:
        kind = "truncated" if "truncated" in str(error) else "corrupt image"  # Pillow: "image file is truncated"
        raise UnusableImage(f"{kind}: {error}") from None
    return pixels


def _png_unopened(data: bytes, chunks: list[tuple[bytes, int, int]]) -> str:
    """Why Pillow did not open a file that starts as a PNG: a checksum (Pillow checks every chunk's, a text
    chunk's included, and then calls the file no image at all), else what Pillow would not say."""
    for kind, start, length in chunks:
        stored = data[start + length:start + length + 4]
        if zlib.crc32(data[start - 4:start + length]) != int.from_bytes(stored, "big"):
            return f"corrupt PNG: its {_chunk_name(kind)} chunk fails its CRC check"
    return "corrupt PNG: Pillow could not read its header"


def _check_pixels(height: int, width: int) -> None:
    if height <= 0 or width <= 0:
        raise UnusableImage(f"empty image ({width}x{height})")
    if height * width > MAX_IMAGE_PIXELS:
        raise UnusableImage(f"decompression bomb: {width}x{height} exceeds {MAX_IMAGE_PIXELS} pixels")


WIDE_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")
# 16-bit grey to 8-bit, rounded: round(v * 255 / 65535) for every v, in integers. One lookup per pixel writes the
# uint8 result directly; float64 arithmetic held 8 bytes a pixel per temporary (1.5-2 GB for one large image).
WIDE_TO_8BIT = ((np.arange(65536, dtype=np.uint32) * 255 + 65535 // 2) // 65535).astype(np.uint8)
ROWS_PER_PASS_PIXELS = 1 << 20  # 32-bit images are clipped a band of rows at a time: temporaries stay ~4 MiB


def _is_transparent(image: Image.Image) -> bool:
    return image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info)


def decode_bytes(image: Image.Image) -> int:
    """Peak bytes of decoding `image` and converting it with to_rgb_array, from its header: Pillow's own copy
    (1 byte a pixel for 1/L/P, 2 for 16-bit, 4 for every other mode) plus the conversion's copies alive at once."""
    stored = 1 if image.mode in ("1", "L", "P") else 2 if image.mode.startswith("I;16") else 4
    if image.mode in WIDE_MODES:
        conversion = stored + 1 + 3  # the array Pillow hands numpy, the 8-bit grey, the RGB result
    elif _is_transparent(image):
        conversion = 4 + 4 + 4 + 4 + 3  # RGBA copy, white background, composite, its RGB, the array
    else:
        conversion = 4 + 3  # convert("RGB") (Pillow pads RGB to 4 bytes), the array
    return image.width * image.height * (stored + conversion)


def _check_decode_bytes(image: Image.Image) -> None:
    needed = decode_bytes(image)
    if needed > MAX_DECODE_BYTES:
        raise UnusableImage(f"too large to decode: {image.width}x{image.height} {image.mode} needs about "
                            f"{needed >> 20} MiB, over the {MAX_DECODE_BYTES >> 20} MiB one decode may take")


def to_rgb_array(image: Image.Image) -> np.ndarray:
    """Any Pillow mode as an (H, W, 3) uint8 array; 16-bit and 32-bit integer images are scaled, not clipped."""
    if image.mode in WIDE_MODES:
        gray = _wide_to_gray8(image)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if _is_transparent(image):
        # Transparent areas become white, as a viewer shows them, not whatever colour hides under alpha 0.
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(background, rgba).convert("RGB"))
    return np.asarray(image.convert("RGB"))


def _wide_to_gray8(image: Image.Image) -> np.ndarray:
    """16-bit (full range 0-65535), 32-bit integer (0-255, or 0-65535 when any value exceeds 255) and float
    (0-255, clipped) grey as 8-bit grey, in integer arithmetic except for the float mode's own values."""
    wide = np.asarray(image)
    if image.mode.startswith("I;16"):
        return WIDE_TO_8BIT[wide]
    gray = np.empty(wide.shape, np.uint8)
    # one band: (min, max) as numbers, not the per-band pairs the stub also allows
    peak = 65535 if image.mode == "I" and cast(tuple[float, float], image.getextrema())[1] > 255 else 255
    rows = max(1, ROWS_PER_PASS_PIXELS // max(1, wide.shape[1]))
    for top in range(0, wide.shape[0], rows):
        band = np.clip(wide[top:top + rows], 0, peak)
        gray[top:top + rows] = WIDE_TO_8BIT[band.astype(np.uint16)] if peak == 65535 else band
    return gray


def resize_box_into(image: np.ndarray, box: Box, flip: bool, out: np.ndarray, clock: StageClock | None = None) -> None:
    """Resize the box of `image` into `out` without an intermediate copy of the result."""
    started = time.thread_time()
    top = min(max(box.top, 0), image.shape[0] - 1)
    left = min(max(box.left, 0), image.shape[1] - 1)
    crop = image[top:top + box.height, left:left + box.width]
    # Area averaging only pays where bilinear would alias, at 2x shrink or more; after a reduced-size decode the
    # box is almost always under 2x the output, and bilinear is 6x faster there.
    far = crop.shape[0] >= 2 * out.shape[0] and crop.shape[1] >= 2 * out.shape[1]
    interpolation = cv2.INTER_AREA if far else cv2.INTER_LINEAR
    cv2.resize(crop, (out.shape[1], out.shape[0]), dst=out, interpolation=interpolation)
    if flip:
        cv2.flip(out, 1, dst=out)
    if clock is not None:
        clock.resize += time.thread_time() - started



def _crop(image: np.ndarray, box: Box) -> np.ndarray:
    top, left = min(max(box.top, 0), image.shape[0] - 1), min(max(box.left, 0), image.shape[1] - 1)
    return image[top:top + box.height, left:left + box.width]  # as resize_box_into crops


def _region_matches_whole_decode() -> bool:
    """Whether the extension's libjpeg (the system's) gives, in a crop's box, the pixels simplejpeg's own
    libjpeg-turbo gives: a batch must be the same bytes whichever decode built it, so a pair of builds that round
    differently must not both serve. A 4:2:0 image, a box away from every edge, at every scale used, decoded as a
    first load and, rewritten with restart markers, cut down to the box's MCUs as a later load."""
    assert _jpegcrop is not None
    rows, columns = np.mgrid[0:120, 0:160]
    pattern = np.stack([(rows * 7 + columns * 3) % 256, (rows * columns) % 256, (rows * 13) % 256], -1)
    data = simplejpeg.encode_jpeg(pattern.astype(np.uint8), quality=90, colorspace="RGB", colorsubsampling="420")
    box = Box(37, 45, 61, 83)
    for eighths in FAST_EIGHTHS:
        min_h, min_w = scaled_side(120, eighths), scaled_side(160, eighths)
        whole = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=min_h, min_width=min_w, strict=True)
        expected = _crop(whole, _scaled_box(box, whole.shape[0] / 120, whole.shape[1] / 160))
        for stored, to_end in ((data, True), (with_restart_markers(data), False)):
            region, within = _decode_region(stored, box, 120, 160, eighths, to_end)
            if not np.array_equal(_crop(region, within), expected):
                return False
    return True


if _jpegcrop is not None and not _region_matches_whole_decode():
    log.warning("the crop-aware JPEG decoder (_jpegcrop, built against the system's libjpeg) gives other pixels than "
                "simplejpeg's libjpeg-turbo here: JPEGs are decoded whole (rebuild against a matching libjpeg-turbo)")
    _jpegcrop = None  # type: ignore[assignment]

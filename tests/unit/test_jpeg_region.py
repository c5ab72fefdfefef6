"""Crop-aware JPEG decoding: the region libjpeg-turbo decodes holds the whole decode's pixels, so every crop and
augmentation gives the same bytes as decoding the image whole; damage anywhere in the file still refuses it."""

from __future__ import annotations

import io
import re
import zlib

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from stoker.data.pixels import imaging
from stoker.data.pixels.imaging import UnusableImage, load_into, scale_eighths
from tests.conftest import photograph_jpeg, scan_data_start

_jpegcrop = pytest.importorskip(
    "stoker.data.pixels._jpegcrop", reason="the crop-aware decoder was not built (it needs libjpeg-turbo's headers: "
    "apt-get install libjpeg62-turbo-dev, then make install)")

imaging.make_decode_warnings_errors()

ENCODINGS = {  # Pillow's options: each chroma layout libjpeg upsamples differently, progressive, restart markers
    "444": {"subsampling": 0}, "422": {"subsampling": 1}, "420": {"subsampling": 2},
    "progressive": {"progressive": True}, "restarts": {"restart_marker_rows": 1}, "grey": {},
    # a restart marker after every MCU, as Pillow writes it: a crop-aware decode cuts these down to the box
    "mcu-restarts": {"restart_marker_blocks": 1}, "mcu-restarts-422": {"restart_marker_blocks": 1, "subsampling": 1},
}


def jpeg(size: tuple[int, int], encoding: str, seed: int = 0) -> bytes:
    """A crop of a real photograph (never upscaled) at `size` (width, height), encoded as asked."""
    photo = Image.open(io.BytesIO(photograph_jpeg(seed % 2, False)))
    left, top = (seed * 37) % (photo.width - size[0] + 1), (seed * 23) % (photo.height - size[1] + 1)
    image = photo.crop((left, top, left + size[0], top + size[1]))
    if encoding == "grey":
        image = image.convert("L")
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90, **ENCODINGS[encoding.removeprefix("rewritten-")])
    if encoding.startswith("rewritten-"):  # as `stoker pack` stores it
        return imaging.with_restart_markers(buffer.getvalue())
    return buffer.getvalue()


CUTTABLE = ["mcu-restarts", "mcu-restarts-422", "rewritten-420", "rewritten-444", "rewritten-progressive",
            "rewritten-grey"]


SIZES = [(500, 375), (375, 500), (333, 257), (17, 9), (1, 40), (40, 1), (640, 40)]


@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_a_region_holds_the_whole_decodes_pixels_at_every_scale(encoding):
    rng, margin = np.random.default_rng(0), imaging.REGION_MARGIN
    for size in SIZES:
        data = jpeg(size, encoding)
        for eighths in range(1, 9):
            height, width = -(-size[1] * eighths // 8), -(-size[0] * eighths // 8)
            whole = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=height, min_width=width)
            assert whole.shape[:2] == (height, width)
            for _ in range(6):
                rows, columns = int(rng.integers(1, height + 1)), int(rng.integers(1, width + 1))
                top, left = int(rng.integers(0, height - rows + 1)), int(rng.integers(0, width - columns + 1))
                # with REGION_MARGIN pixels around the box, as imaging asks: the context fancy upsampling reads
                first_row, end_row = max(0, top - margin), min(height, top + rows + margin)
                first_column, end_column = max(0, left - margin), min(width, left + columns + margin)
                pixels, decoded_left, decoded_width = _jpegcrop.decode(
                    data, eighths, first_row, first_column, end_row - first_row, end_column - first_column)
                region = np.frombuffer(pixels, np.uint8).reshape(end_row - first_row, decoded_width, 3)
                assert decoded_left <= first_column and decoded_left + decoded_width >= end_column
                got = region[top - first_row:top - first_row + rows, left - decoded_left:left - decoded_left + columns]
                np.testing.assert_array_equal(got, whole[top:top + rows, left:left + columns])


@pytest.mark.parametrize("encoding", ["444", "422", "420", "grey", "rewritten-420"])
@pytest.mark.parametrize("eighths", [1, 2, 4, 8])
def test_a_narrow_box_decodes_only_the_columns_around_it(encoding, eighths):
    """Columns narrowed to the iMCU grid around the box (at most an iMCU of 32 scaled pixels more each side), on a
    first load and through a cut: the common layouts keep the saving at every scale used."""
    data = jpeg((500, 375), encoding)
    top, left, rows, columns = (value * eighths // 8 for value in (100, 200, 50, 40))
    for to_end in (True, False):
        pixels, decoded_left, decoded_width = _jpegcrop.decode(data, eighths, top, left, rows, columns, to_end)
        assert len(pixels) == rows * decoded_width * 3
        assert decoded_left <= left and decoded_left + decoded_width >= left + columns
        assert decoded_width <= columns + 2 * 4 * eighths < -(-500 * eighths // 8)


def _flat_jpeg(width: int, height: int, luma_sampling: int) -> bytes:
    """A baseline YCbCr JPEG, every coefficient zero (a flat grey 128), written byte by byte: its luma sampling
    factors as given (0x42: 4:1:0, which no Python encoder here writes), Huffman tables of one code each."""
    def segment(marker: int, payload: bytes) -> bytes:
        return bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload

    h, v = luma_sampling >> 4, luma_sampling & 15
    mcus = -(-width // (8 * h)) * -(-height // (8 * v))
    bits = "00" * (h * v + 2) * mcus  # per block: DC category 0 ("0"), then end of block ("0")
    bits += "1" * (-len(bits) % 8)
    scan = int(bits, 2).to_bytes(len(bits) // 8, "big")
    frame = bytes([8]) + height.to_bytes(2, "big") + width.to_bytes(2, "big") + bytes(
        [3, 1, luma_sampling, 0, 2, 0x11, 0, 3, 0x11, 0])
    one_code = bytes([1] + [0] * 15 + [0])  # one symbol (0) of one bit
    return (b"\xff\xd8" + segment(0xDB, bytes([0]) + bytes([1] * 64)) + segment(0xC0, frame)
            + segment(0xC4, bytes([0x00]) + one_code) + segment(0xC4, bytes([0x10]) + one_code)
            + segment(0xDA, bytes([3, 1, 0, 2, 0, 3, 0, 0, 63, 0])) + scan + b"\xff\xd9")


def test_a_layout_whose_columns_crop_would_read_unwritten_memory_decodes_whole_rows():
    """4:1:0 at 1/2 scale: libjpeg-turbo 2.1.5 enlarges the chroma by its inverse DCT and still upsamples it
    across, and jpeg_crop_scanline then sizes its rows without the enlargement (reading memory it never wrote);
    such rows are decoded whole, to the flat grey the file holds. 4:2:0 at the same scale is still narrowed."""
    data = _flat_jpeg(128, 64, 0x42)
    pixels, decoded_left, decoded_width = _jpegcrop.decode(data, 4, 4, 40, 8, 6)
    assert (decoded_left, decoded_width) == (0, 64) and set(pixels) == {128}
    assert _jpegcrop.decode(_flat_jpeg(128, 64, 0x22), 4, 4, 40, 8, 6)[2] < 64


def test_the_scale_is_the_smallest_simd_one_that_keeps_the_size_asked_and_simplejpeg_decodes_at_it():
    """libjpeg-turbo's SIMD scales are 1/8, 2/8, 4/8 and 8/8 (its other scales use plain-C inverse DCTs, slower than
    the whole image); the region's scale and the whole decode's must agree, or the pixels differ: checked at each
    threshold against the size simplejpeg decodes when asked for that scale's size."""
    for height, width in [(375, 500), (257, 333), (9, 17)]:
        data = jpeg((width, height), "420")
        edges = sorted({-(-side * eighths // 8) + step for side in (height, width) for eighths in range(1, 9)
                        for step in (0, 1)})
        for min_height in edges:
            for min_width in edges:
                eighths = scale_eighths(height, width, min_height, min_width)
                shape = (-(-height * eighths // 8), -(-width * eighths // 8))
                assert eighths in (1, 2, 4, 8)
                assert shape[0] >= min(min_height, height) and shape[1] >= min(min_width, width)
                smaller = eighths // 2  # the SIMD scale below it falls short of the size asked
                assert smaller == 0 or -(-height * smaller // 8) < min(min_height, height) or \
                    -(-width * smaller // 8) < min(min_width, width)
                assert simplejpeg.decode_jpeg(data, min_height=shape[0], min_width=shape[1]).shape[:2] == shape


@pytest.mark.parametrize("augment", ["standard", "none", "trivial", "randaug"])
@pytest.mark.parametrize("encoding", ["420", "444", "progressive", "grey"])
def test_crop_aware_decoding_gives_the_bytes_of_the_whole_decode(augment, encoding, monkeypatch):
    """Every augmentation, output size and file shape: the same bytes with the extension as without it."""
    files = [jpeg(size, encoding, seed) for seed, size in enumerate(SIZES)]
    for side in (224, 64):  # the small files' boxes are smaller than both: upscaled from the whole-size decode
        outputs = []
        for module in (_jpegcrop, None):
            monkeypatch.setattr(imaging, "_jpegcrop", module)
            rng = np.random.default_rng(7)
            out = np.zeros((len(files) * 12, side, side, 3), np.uint8)
            for index in range(len(out)):
                load_into(files[index % len(files)], out[index], augment, rng if augment != "none" else None)
            outputs.append(out)
        np.testing.assert_array_equal(outputs[0], outputs[1])


@pytest.mark.parametrize("progressive", [False, True], ids=["baseline", "progressive"])
def test_damage_outside_the_crop_still_refuses_the_file(progressive):
    """Rows above and below the box are entropy-decoded too: a zeroed stretch anywhere is seen, whatever the crop
    (stopping at the box's last row trained on the zeros for most crops)."""
    data = photograph_jpeg(0, progressive)
    start = scan_data_start(data)
    tenth = (len(data) - 2 - start) // 10
    for where in (1, 5, 8):
        zeroed = data[:start + where * tenth] + bytes(tenth) + data[start + (where + 1) * tenth:]
        rng = np.random.default_rng(where)
        for _ in range(40):
            with pytest.raises(UnusableImage, match="^(corrupt JPEG|truncated)"):
                load_into(zeroed, np.zeros((224, 224, 3), np.uint8), "standard", rng)


def test_a_decoder_that_gives_other_pixels_is_found_at_import(monkeypatch):
    """The extension links the system's libjpeg, simplejpeg its own: where the two round differently, the check
    run at import finds it (and JPEGs are then decoded whole), so a batch never depends on which decode built it."""
    assert imaging._region_matches_whole_decode()
    decode = _jpegcrop.decode

    def off_by_one(data, *args):
        pixels, left, width = decode(data, *args)
        return bytes(min(255, value + 1) for value in pixels), left, width

    monkeypatch.setattr(_jpegcrop, "decode", off_by_one)
    assert not imaging._region_matches_whole_decode()


@pytest.mark.parametrize("augment", ["standard", "none", "trivial"])
@pytest.mark.parametrize("encoding", ["420", "progressive", "restarts", *CUTTABLE])
def test_a_file_checked_before_gives_the_same_bytes_stopping_at_the_box(augment, encoding):
    """Once a file has loaded whole, its later loads may stop decoding at the box's last row: the same bytes."""
    files = [jpeg(size, encoding, seed) for seed, size in enumerate(SIZES)]
    outputs = []
    for checked_before in (False, True):
        rng = np.random.default_rng(11)
        out = np.zeros((len(files) * 8, 224, 224, 3), np.uint8)
        for index in range(len(out)):
            load_into(files[index % len(files)], out[index], augment, rng if augment != "none" else None,
                      checked_before=checked_before)
        outputs.append(out)
    np.testing.assert_array_equal(outputs[0], outputs[1])


def test_stopping_at_the_box_does_not_read_the_scan_below_it():
    """What `checked_before` trades: a zeroed stretch below the box is seen only when the scan is read to its end."""
    data = photograph_jpeg(0, False)
    start = scan_data_start(data)
    tenth = (len(data) - 2 - start) // 10
    damaged = data[:start + 8 * tenth] + bytes(tenth) + data[start + 9 * tenth:]
    height, width = simplejpeg.decode_jpeg_header(damaged)[:2]
    box = (8, 0, 0, height // 4, width)  # the top quarter: above the damage
    with pytest.raises(ValueError, match="[Cc]orrupt|[Pp]remature"):
        _jpegcrop.decode(damaged, *box)
    assert _jpegcrop.decode(damaged, *box, False) == _jpegcrop.decode(data, *box, False) == _jpegcrop.decode(data, *box)


@pytest.mark.parametrize("encoding", CUTTABLE)
def test_a_cut_to_the_mcus_around_the_box_holds_the_whole_decodes_pixels_at_every_scale(encoding):
    """A file with a restart marker after every MCU, once loaded before, is cut down to the MCUs around the box
    (with the margin imaging asks): the box's pixels are still those of simplejpeg's whole decode."""
    rng, margin = np.random.default_rng(1), imaging.REGION_MARGIN
    for seed, size in enumerate(SIZES):
        data = jpeg(size, encoding, seed)
        for eighths in range(1, 9):  # the C takes every scale; imaging asks the SIMD ones
            height, width = -(-size[1] * eighths // 8), -(-size[0] * eighths // 8)
            whole = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=height, min_width=width)
            for _ in range(8):
                rows = int(rng.integers(1, min(height, 3 if rng.random() < 0.3 else height) + 1))
                columns = int(rng.integers(1, min(width, 3 if rng.random() < 0.3 else width) + 1))
                top, left = int(rng.integers(0, height - rows + 1)), int(rng.integers(0, width - columns + 1))
                first_row, end_row = max(0, top - margin), min(height, top + rows + margin)
                first_column, end_column = max(0, left - margin), min(width, left + columns + margin)
                pixels, decoded_left, decoded_width = _jpegcrop.decode(
                    data, eighths, first_row, first_column, end_row - first_row, end_column - first_column, False)
                region = np.frombuffer(pixels, np.uint8).reshape(end_row - first_row, decoded_width, 3)
                got = region[top - first_row:top - first_row + rows, left - decoded_left:left - decoded_left + columns]
                np.testing.assert_array_equal(got, whole[top:top + rows, left:left + columns])


def _mcu_segments(data: bytes) -> list[tuple[int, int]]:
    """Where each MCU's entropy-coded bytes lie in a file with a restart marker after every MCU: between markers."""
    start, found = scan_data_start(data), []
    for marker in re.finditer(rb"\xff[\xd0-\xd7\xd9]", data[start:]):
        found.append((start, scan_data_start(data) + marker.start()))
        start = scan_data_start(data) + marker.end()
    return found


def test_a_cut_entropy_decodes_only_the_mcus_around_the_box():
    """Every MCU of the top half zeroed, and every MCU left and right of the box below it: the bottom quarter's box,
    loaded before, decodes to the same pixels (no byte of the damage is read), while a decode of the scan to its end
    refuses the file; a file without a marker after every MCU is read from the top as before and refused too."""
    for encoding in ("rewritten-420", "mcu-restarts"):
        data = jpeg((500, 375), encoding)
        segments = _mcu_segments(data)
        assert len(segments) == 32 * 24  # 500x375 in 16x16 MCUs
        damaged = bytearray(data)
        box = (8, 375 * 3 // 4, 100, 375 // 4, 200)  # rows 281-374, columns 100-299: MCU rows 17-23, columns 6-18
        outside = [k for k in range(len(segments)) if k // 32 < 16 or k % 32 < 5 or k % 32 > 19]
        for begin, end in [segments[k] for k in outside]:  # the top half, and every MCU left and right of the box
            damaged[begin:end] = bytes(end - begin)
        assert _jpegcrop.decode(bytes(damaged), *box, False) == _jpegcrop.decode(data, *box)
        with pytest.raises(ValueError, match="[Cc]orrupt|[Pp]remature"):
            _jpegcrop.decode(bytes(damaged), *box)
    rows = jpeg((500, 375), "restarts")
    start, third = scan_data_start(rows), len(rows) // 3
    with pytest.raises(ValueError, match="[Cc]orrupt|[Pp]remature"):
        _jpegcrop.decode(rows[:start] + bytes(third) + rows[start + third:], 8, 300, 0, 50, 500, False)


def test_a_sealed_file_is_cut_to_the_box_from_its_first_load_and_a_broken_seal_reads_it_whole():
    """`stoker pack` seals each JPEG it rewrote (the rewrite read every coefficient strictly) with the CRC-32 of its
    bytes: a first load that finds the seal intact is cut to the box's MCUs as a later load is; bytes changed since
    break the seal, and the first load reads the whole scan as for any file, so damage outside the crop refuses it.
    A seal made over damaged bytes (pack never writes one) shows what an intact seal trades."""
    data = jpeg((500, 375), "rewritten-420")
    at = data.index(imaging.SEAL) - 4  # the comment segment: marker, length, SEAL, 8 hex digits
    end = at + 4 + len(imaging.SEAL) + 8
    as_rewritten = data[:at] + data[end:]
    assert _header_markers(data)[b"\xff\xfe"] == [imaging.SEAL + b"%08x" % zlib.crc32(as_rewritten)]
    assert data[2:4] == b"\xff\xe0"  # JFIF's APP0 still first, as readers expect
    damaged = bytearray(as_rewritten)
    for k, (begin, stop) in enumerate(_mcu_segments(as_rewritten)):
        if k % 32 < 2 or k % 32 > 28:  # MCU columns left and right of the centre crop (columns 86-413)
            damaged[begin:stop] = bytes(stop - begin)
    expected, got = np.zeros((224, 224, 3), np.uint8), np.zeros((224, 224, 3), np.uint8)
    load_into(data, expected, "none", None)
    load_into(imaging.sealed(bytes(damaged)), got, "none", None)
    np.testing.assert_array_equal(got, expected)
    broken = data[:end] + bytes(damaged[at:])  # the seal over bytes changed since
    for file in (bytes(damaged), broken):
        with pytest.raises(UnusableImage, match="^(corrupt JPEG|truncated)"):
            load_into(file, np.zeros((224, 224, 3), np.uint8), "none", None)


@pytest.mark.parametrize("encoding", ["420", "422", "444", "progressive", "restarts", "grey"])
def test_rewriting_with_restart_markers_keeps_every_pixel(encoding):
    """The same coefficients, so simplejpeg (its own libjpeg-turbo) decodes the same pixels, whole and at a scale;
    written baseline with a restart interval of one MCU and no APPn marker but JFIF's."""
    for seed, size in enumerate(SIZES):
        data = jpeg(size, encoding, seed)
        rewritten = _jpegcrop.restart_every_mcu(data)
        assert rewritten is not None
        for scale in (1, 4):
            shape = (-(-size[1] * scale // 8), -(-size[0] * scale // 8))
            np.testing.assert_array_equal(
                simplejpeg.decode_jpeg(rewritten, min_height=shape[0], min_width=shape[1]),
                simplejpeg.decode_jpeg(data, min_height=shape[0], min_width=shape[1]))
        markers = _header_markers(rewritten)
        assert markers[b"\xff\xdd"] == [b"\x00\x01"]  # DRI: one MCU
        assert set(markers) & {b"\xff\xc0", b"\xff\xc1"} and not set(markers) & {b"\xff\xc2", b"\xff\xc9"}
        assert {m for m in markers if 0xE0 <= m[1] <= 0xEF} <= {b"\xff\xe0"}


def _header_markers(data: bytes) -> dict[bytes, list[bytes]]:
    """The marker segments before the scan: marker -> the payloads, read by their lengths."""
    found: dict[bytes, list[bytes]] = {}
    at = 2
    while data[at:at + 2] != b"\xff\xda":
        length = int.from_bytes(data[at + 2:at + 4], "big")
        found.setdefault(data[at:at + 2], []).append(data[at + 4:at + 2 + length])
        at += 2 + length
    return found


def _first_scans(data: bytes, scans: int) -> bytes:
    """A progressive JPEG ended after its first `scans` scans: valid, its later refinements never sent."""
    starts = [marker.start() for marker in re.finditer(rb"\xff\xda", data)]
    return data[:starts[scans]] + b"\xff\xd9"


def test_a_progressive_file_whose_refinements_never_came_is_kept_as_it_is():
    """libjpeg smooths the blocks of a progressive image whose coefficients' low bits were never sent; a baseline
    rewrite of the same coefficients would not, so the file is kept (None), and the pixels are the file's."""
    data = _first_scans(jpeg((333, 257), "progressive"), 6)
    assert simplejpeg.decode_jpeg(data).shape == (257, 333, 3)  # valid: decodes strictly
    assert _jpegcrop.restart_every_mcu(data) is None
    assert imaging.with_restart_markers(data) == data
    assert _jpegcrop.restart_every_mcu(jpeg((333, 257), "progressive")) is not None  # all 10 scans: rewritten


def test_rewriting_passes_over_other_colour_spaces_and_refuses_damage():
    buffer = io.BytesIO()
    Image.open(io.BytesIO(jpeg((64, 48), "420"))).convert("CMYK").save(buffer, "JPEG")
    assert _jpegcrop.restart_every_mcu(buffer.getvalue()) is None
    assert imaging.with_restart_markers(buffer.getvalue()) == buffer.getvalue()
    data = jpeg((500, 375), "420")
    for damaged in (data[:len(data) // 2], data[:len(data) // 2] + bytes(len(data) // 4) + data[-len(data) // 4:]):
        with pytest.raises(ValueError, match="[Cc]orrupt|[Pp]remature"):
            _jpegcrop.restart_every_mcu(damaged)
        assert imaging.with_restart_markers(damaged) == damaged


def test_crafted_files_through_the_cut_raise_or_decode_never_crash():
    """Bytes flipped in the header (sizes, sampling, the restart interval, the scan's components) and in the scan
    of a file with a restart marker after every MCU: each decode returns pixels or raises ValueError, and the
    process lives (20,000 more such cases ran clean under AddressSanitizer by hand; a small read past the file
    need not crash, so this alone does not prove there is none)."""
    data = jpeg((333, 257), "rewritten-420")
    scan = scan_data_start(data)
    rng = np.random.default_rng(3)
    outcomes = set()
    for trial in range(600):
        crafted = bytearray(data)
        for _ in range(int(rng.integers(1, 4))):
            where = int(rng.integers(2, scan)) if trial % 2 else int(rng.integers(scan, len(data)))
            crafted[where] = int(rng.integers(0, 256))
        if trial % 5 == 0:
            crafted = crafted[:int(rng.integers(scan - 20, len(crafted)))]
        try:
            pixels, left, width = _jpegcrop.decode(bytes(crafted), 8, 100, 50, 60, 80, False)
            outcomes.add("decoded")
        except ValueError:
            outcomes.add("refused")
    assert outcomes == {"decoded", "refused"}


def test_a_greyscale_file_that_declares_2x2_sampling_is_rewritten_1x1_and_cut():
    """One component's sampling factors mean nothing; written 1x1, its MCU is one block, so the rewrite can be
    cut (a 2x2 one would be rewritten and never cut); the pixels are the file's."""
    data = bytearray(jpeg((496, 368), "grey"))
    frame = data.index(b"\xff\xc0")
    assert data[frame + 9] == 1 and data[frame + 11] == 0x11
    data[frame + 11] = 0x22
    rewritten = _jpegcrop.restart_every_mcu(bytes(data))
    assert rewritten[rewritten.index(b"\xff\xc0") + 11] == 0x11
    np.testing.assert_array_equal(simplejpeg.decode_jpeg(rewritten, colorspace="GRAY"),
                                  simplejpeg.decode_jpeg(bytes(data), colorspace="GRAY"))
    segments = _mcu_segments(rewritten)
    assert len(segments) == 62 * 46  # one per 8x8 block
    damaged = bytearray(rewritten)
    for begin, end in segments[:len(segments) // 2]:
        damaged[begin:end] = bytes(end - begin)
    box = (8, 300, 100, 60, 200)  # below the damaged half
    assert _jpegcrop.decode(bytes(damaged), *box, False) == _jpegcrop.decode(rewritten, *box)

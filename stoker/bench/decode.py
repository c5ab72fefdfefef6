"""`stoker bench decode`: CPU milliseconds per image of decode + RandomResizedCrop + flip into a preallocated slot,
the producer's own work, crop-aware against whole-image decoding, on a folder's JPEGs as they are, packed by
`stoker pack` (each JPEG with a restart marker after every MCU and sealed: every load decodes only the box's MCUs)
and packed with `--max-side` (and `--raw-max-side`: small images as raw pixels), beside the bytes each set's shards
take, at one or several training sides (`--image-size 160 192 224`: what a lower side, or `--image-size-ramp`, saves
the feed). "crop-aware, loaded before" is a file's load from its second on (the ring's `loaded_of` mark: the scan
below the box unread). One process, one thread, the passes of every variant interleaved; each figure is the median
over passes of the process's CPU time per image, beside the stage clocks (`imaging.StageClock`) of the same passes,
whose sum must come within 10% of it."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stoker.data.formats.pack import Shrink

EXTENSIONS = (".jpg", ".jpeg")
PACKED = (*EXTENSIONS, ".npy")  # the image members of a pack: JPEGs, and raw pixels


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("decode", help="CPU ms per image: decode + random crop + flip, crop-aware against "
                                             "whole, original against --max-side packed")
    parser.add_argument("--data", type=Path, required=True, help="an ImageFolder of JPEGs (e.g. the ImageNet-like set "
                                                                  "of `stoker bench pipeline --generate`)")
    parser.add_argument("--max-side", type=int, nargs="*", default=[256], help="also pack the folder at these sides "
                                                                              "(default 256)")
    parser.add_argument("--raw-max-side", type=int, nargs="*", default=[256], help="also pack the folder at each "
                        "--max-side with these --raw-max-side (default 256: every image of a --max-side 256 set)")
    parser.add_argument("--image-size", type=int, nargs="+", default=[224], help="training sides, measured "
                                                                                 "interleaved (default 224)")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from stoker.data.formats.pack import Shrink

    with tempfile.TemporaryDirectory(prefix="stoker-bench-decode-") as scratch:
        sets = {"original": _packed(args.data, Path(scratch) / "original", Shrink(keep_bytes=True),
                                    _folder_jpegs(args.data)),
                "packed": _packed(args.data, Path(scratch) / "packed", Shrink())}
        for side in args.max_side:
            sets[f"--max-side {side}"] = _packed(args.data, Path(scratch) / str(side), Shrink(side))
            for raw in args.raw_max_side:
                sets[f"--max-side {side} --raw-max-side {raw}"] = _packed(args.data, Path(scratch) / f"{side}-{raw}",
                                                                            Shrink(side, raw_max_side=raw))
        reads = {name: read_ms_per_image(packed.places, args.passes) for name, packed in sets.items()}
    rows = measure({name: packed.images for name, packed in sets.items()}, args.image_size, args.passes)
    for row in rows:
        row["shard_bytes"], row["read_ms_per_image"] = sets[row["set"]].shard_bytes, reads[row["set"]]
        print(f"{row['image_size']:>4} px {row['set']:<34} {row['decoder']:<26} {row['cpu_ms_per_image']:6.3f} "
              f"ms/image (stages {row['stage_ms_per_image']:.3f}: decode {row['decode_ms_per_image']:.3f}, crop "
              f"and resize {row['resize_ms_per_image']:.3f}; passes {' '.join(f'{v:.3f}' for v in row['passes'])}); "
              f"shards {row['shard_bytes'] / 1e6:.1f} MB, pread {row['read_ms_per_image']:.3f} ms/image")
    if args.json:
        args.json.write_text(json.dumps({"image_size": args.image_size, "passes": args.passes, "rows": rows},
                                        indent=1) + "\n")
    return 0


def _folder_jpegs(folder: Path) -> list[bytes]:
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in EXTENSIONS)
    if not files:
        raise SystemExit(f"stoker: error: {folder}: no JPEG files")
    return [p.read_bytes() for p in files]


@dataclass
class Packed:
    images: list[bytes]  # what is timed
    shard_bytes: int
    places: list[tuple[Path, int, int]]  # (shard, offset, size) of each image member


def _packed(folder: Path, out: Path, shrink: Shrink, images: list[bytes] | None = None) -> Packed:
    """The image members of `folder` packed as `shrink` says (`images`, where given, are timed instead: the folder's
    own files), the bytes its shards take and where each member lies."""
    from stoker.data.formats.pack import pack

    found, places = [], []
    shards = pack(folder, out, 1 << 40, shrink=shrink)
    for shard in shards:
        with tarfile.open(shard) as archive:
            for member in archive.getmembers():
                if member.name.lower().endswith(PACKED):
                    found.append(archive.extractfile(member).read())  # type: ignore[union-attr]
                    places.append((shard, member.offset_data, member.size))
    return Packed(images if images is not None else found, sum(shard.stat().st_size for shard in shards), places)


def read_ms_per_image(places: list[tuple[Path, int, int]], passes: int) -> float:
    """CPU ms per image of a producer's read of a member from a shard in the page cache (one pread): the part of
    a sample's cost that grows with its bytes. The first pass fills the cache and is not counted."""
    spent = []
    handles = {path: os.open(path, os.O_RDONLY) for path in {path for path, _, _ in places}}
    try:
        for _ in range(passes + 1):
            started = time.process_time()
            for path, offset, size in places:
                os.pread(handles[path], size, offset)
            spent.append(time.process_time() - started)
    finally:
        for handle in handles.values():
            os.close(handle)
    return round(statistics.median(spent[1:]) * 1000 / max(1, len(places)), 4)


def measure(sets: dict[str, list[bytes]], sizes: Sequence[int], passes: int) -> list[dict[str, Any]]:
    import numpy as np

    from stoker.data.pixels import imaging

    crop_aware = imaging._jpegcrop
    decoders: dict[str, tuple[Any, bool]] = {"whole": (None, False)}  # name: (the extension or None, checked_before)
    if crop_aware is not None:
        decoders = {"crop-aware": (crop_aware, False), "crop-aware, loaded before": (crop_aware, True), **decoders}
    seconds: dict[tuple[int, str, str], list[tuple[float, float, float]]] = {}
    try:
        for number in range(passes):
            for (size, name, decoder) in [(z, n, d) for z in sizes for n in sets for d in decoders]:
                imaging._jpegcrop, checked_before = decoders[decoder]
                out = np.empty((size, size, 3), np.uint8)
                rng, clock = np.random.default_rng(number), imaging.StageClock()
                started = time.process_time()
                for data in sets[name]:
                    imaging.load_into(data, out, "standard", rng, clock, checked_before)
                spent = time.process_time() - started
                seconds.setdefault((size, name, decoder), []).append((spent, clock.decode, clock.resize))
    finally:
        imaging._jpegcrop = crop_aware
    return [_row(size, name, decoder, len(sets[name]), runs) for (size, name, decoder), runs in seconds.items()]


def _row(size: int, name: str, decoder: str, images: int, runs: list[tuple[float, float, float]]) -> dict[str, Any]:
    def per_image(values: Any) -> float:
        return round(statistics.median(values) * 1000 / images, 4)

    return {"image_size": size, "set": name, "decoder": decoder, "images": images,
            "cpu_ms_per_image": per_image(s for s, _, _ in runs),
            "stage_ms_per_image": per_image(d + r for _, d, r in runs),
            "decode_ms_per_image": per_image(d for _, d, _ in runs),
            "resize_ms_per_image": per_image(r for _, _, r in runs),
            "passes": [round(s * 1000 / images, 4) for s, _, _ in runs]}

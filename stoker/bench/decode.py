"""`stoker bench decode`: CPU milliseconds per image of decode + RandomResizedCrop + flip into a preallocated slot,
the producer's own work, crop-aware against whole-image decoding, on a folder's JPEGs as they are and packed with
`stoker pack --max-side`, at one or several training sides (`--image-size 160 192 224`: what a lower side, or
`--image-size-ramp`, saves the feed). One process, one thread, the passes of every variant interleaved; each figure
is the median over passes of the process's CPU time per image, beside the stage clocks (`imaging.StageClock`) of
the same passes, whose sum must come within 10% of it."""

from __future__ import annotations

import argparse
import json
import statistics
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXTENSIONS = (".jpg", ".jpeg")


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("decode", help="CPU ms per image: decode + random crop + flip, crop-aware against "
                                             "whole, original against --max-side packed")
    parser.add_argument("--data", type=Path, required=True, help="an ImageFolder of JPEGs (e.g. the ImageNet-like set "
                                                                  "of `stoker bench pipeline --generate`)")
    parser.add_argument("--max-side", type=int, nargs="*", default=[256], help="also pack the folder at these sides "
                                                                              "(default 256)")
    parser.add_argument("--image-size", type=int, nargs="+", default=[224], help="training sides, measured "
                                                                                 "interleaved (default 224)")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    sets = {"original": _folder_jpegs(args.data)}
    with tempfile.TemporaryDirectory(prefix="stoker-bench-decode-") as scratch:
        for side in args.max_side:
            sets[f"--max-side {side}"] = _packed_jpegs(args.data, Path(scratch) / str(side), side)
    rows = measure(sets, args.image_size, args.passes)
    for row in rows:
        print(f"{row['image_size']:>4} px {row['set']:<16} {row['decoder']:<11} {row['cpu_ms_per_image']:6.3f} "
              f"ms/image (stages {row['stage_ms_per_image']:.3f}: decode {row['decode_ms_per_image']:.3f}, crop "
              f"and resize {row['resize_ms_per_image']:.3f}; passes {' '.join(f'{v:.3f}' for v in row['passes'])})")
    if args.json:
        args.json.write_text(json.dumps({"image_size": args.image_size, "passes": args.passes, "rows": rows},
                                        indent=1) + "\n")
    return 0


def _folder_jpegs(folder: Path) -> list[bytes]:
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in EXTENSIONS)
    if not files:
        raise SystemExit(f"stoker: error: {folder}: no JPEG files")
    return [p.read_bytes() for p in files]


def _packed_jpegs(folder: Path, out: Path, side: int) -> list[bytes]:
    from stoker.data.formats.pack import Shrink, pack

    found = []
    for shard in pack(folder, out, 1 << 40, shrink=Shrink(side)):
        with tarfile.open(shard) as archive:
            for member in archive.getmembers():
                if member.name.lower().endswith(EXTENSIONS):
                    found.append(archive.extractfile(member).read())  # type: ignore[union-attr]
    return found


def measure(sets: dict[str, list[bytes]], sizes: Sequence[int], passes: int) -> list[dict[str, Any]]:
    import numpy as np

    from stoker.data.pixels import imaging

    crop_aware = imaging._jpegcrop
    decoders = {"crop-aware": crop_aware, "whole": None} if crop_aware is not None else {"whole": None}
    seconds: dict[tuple[int, str, str], list[tuple[float, float, float]]] = {}
    try:
        for number in range(passes):
            for (size, name, decoder) in [(z, n, d) for z in sizes for n in sets for d in decoders]:
                imaging._jpegcrop = decoders[decoder]  # type: ignore[assignment]
                out = np.empty((size, size, 3), np.uint8)
                rng, clock = np.random.default_rng(number), imaging.StageClock()
                started = time.process_time()
                for data in sets[name]:
                    imaging.load_into(data, out, "standard", rng, clock)
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

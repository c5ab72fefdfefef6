"""`stoker pack IMAGEFOLDER OUT_DIR`: an ImageFolder as WebDataset-layout tar shards, converted once.

Samples go in the folder's index order, so sample i of the shards is sample i of the folder (the same training run
either way), with headers that carry no time or owner (the same bytes whatever `--workers`); each JPEG is rewritten
losslessly with a restart marker after every MCU and sealed (the same pixels; a crop then decodes only its own MCUs,
from the file's first load on) unless `--keep-bytes`; `--max-side` stores the larger images smaller, `--raw-max-side`
the small ones as raw pixels. A pack is written whole or not at all: into a hidden folder renamed to OUT_DIR at the end
(an `s3://` prefix: uploaded, the index last), so an interrupted pack never trains as if complete. Each file is decoded
once as it is packed: one that cannot be is packed all the same (training skips and lists it), logged and counted in
what pack prints. Keys, `index.json` and the upload order: docs/contracts.md, the command line."""

from __future__ import annotations

import argparse
import glob
import io
import itertools
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import tarfile
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stoker.common import faults
from stoker.common.devices import available_cores
from stoker.common.procs import (
    CONTEXT,
    executor_processes,
    exit_with_parent,
    signals_blocked_for_children,
    signals_deferred,
)
from stoker.common.sizes import parse_size
from stoker.common.urls import check_url, data_location, is_remote
from stoker.common.waiting import waiting
from stoker.data.formats.folders import list_image_folder
from stoker.data.formats.shards import CLASSES_FILE, PACK_INDEX_FILE, write_pack_index
from stoker.data.pixels import imaging
from stoker.data.sources import log_refused
from stoker.data.transports import object_store

log = logging.getLogger(__name__)

TAR_BLOCK = 512
PROBE_SIDE = 16  # each file is decoded into this many pixels a side: a JPEG at 1/8 scale, cheap beside its read
DEFAULT_QUALITY = 90  # --max-side's JPEGs: FFCV's and most ImageNet copies' quality

Member = tuple[str, str, int]  # (source file, key, label)


# A raw image holds 3 bytes a pixel: 4096 x 4096 is 48 MiB, under the MAX_SAMPLE_BYTES one sample may hold.
MAX_RAW_SIDE = 4096


@dataclass(frozen=True)
class Shrink:
    """How training images are stored. `--max-side`, `--quality`: those whose longer side exceeds `max_side` as
    JPEGs at `quality` with that longer side (what ImageNet trainers do once: a copy at 256-500 px).
    `--raw-max-side`: those whose longer side, after `max_side`, is `raw_max_side` or less as their RGB pixels
    (a .npy member: no decode in training, FFCV's trick, for 3 bytes a pixel). The others are kept as they are,
    a JPEG rewritten losslessly with a restart marker after every MCU (the same pixels; a crop then entropy-decodes
    only its own MCUs) unless `keep_bytes` (`--keep-bytes`); a shrunk JPEG always has the markers."""

    max_side: int | None = None
    quality: int = DEFAULT_QUALITY
    raw_max_side: int | None = None
    keep_bytes: bool = False

    def __post_init__(self) -> None:
        if self.max_side is not None and self.max_side < 1:
            raise ValueError(f"--max-side {self.max_side}: expected a length in pixels, 1 or more")
        if not 1 <= self.quality <= 100:
            raise ValueError(f"--quality {self.quality}: expected a JPEG quality from 1 to 100")
        if self.raw_max_side is not None and not 1 <= self.raw_max_side <= MAX_RAW_SIDE:
            raise ValueError(f"--raw-max-side {self.raw_max_side}: expected a length in pixels from 1 to "
                             f"{MAX_RAW_SIDE} (raw pixels take 3 bytes each: {MAX_RAW_SIDE}x{MAX_RAW_SIDE} is 48 MiB)")

    def stores_raw(self, size: tuple[int, int]) -> bool:
        """Whether an image of header size `size` is stored as raw pixels."""
        stored = max(size) if self.max_side is None else min(max(size), self.max_side)
        return self.raw_max_side is not None and stored <= self.raw_max_side

    def rewrites(self, size: tuple[int, int]) -> bool:
        """Whether an image of header size `size` is stored other than as its file."""
        return (self.max_side is not None and max(size) > self.max_side) or self.stores_raw(size)

    @property
    def resizes(self) -> bool:
        """Whether any image may be stored at another size or as pixels (its header size is then asked)."""
        return self.max_side is not None or self.raw_max_side is not None


AS_THEY_ARE = Shrink()  # every image at its own size: the defaults of `stoker pack`


def pack(source: Path, out: Path, shard_size: int, workers: int = 0, overwrite: bool = False,
         classes: tuple[str, ...] | None = None, shrink: Shrink = AS_THEY_ARE,
         undecodable: list[tuple[str, str]] | None = None, placed: list[Path] | None = None) -> list[Path]:
    """Write the shards and classes.json; returns the shards' paths in order. Raises ValueError, before anything
    is written, for an OUT_DIR that holds files (unless `overwrite`). `classes`: label by these (a validation set
    takes the training set's), else by the folder's own class folders. `shrink`: store large images smaller; the
    shards are cut by the files' own sizes all the same (the same members in the same shards). `undecodable`
    gets (file, reason) of each file packed that cannot be decoded (each is logged); `placed` gets `out` once the
    pack is in place there, which a Ctrl-C or SIGTERM cannot split from the move itself."""
    _check_out_folder(out, overwrite)
    _say_when_kept_as_they_are(shrink)
    listing = list_image_folder(source, classes)
    log_refused(tuple(listing.skipped))
    members = [(listing.base + name, sample_key(name), label) for name, label in zip(listing.names, listing.labels)]
    _check_unique_keys(members)
    plan = split_into_shards(members, [os.path.getsize(path) for path, _, _ in members], shard_size)
    _remove_dead_partials(out)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    partial.mkdir(parents=True)
    try:
        width = max(6, len(str(len(plan) - 1)))
        targets = [partial / f"shard-{i:0{width}d}.tar" for i in range(len(plan))]
        with waiting(f"packing {len(members):,} files", total=len(plan), unit="shards") as progress:
            bad = _write_shards(targets, plan, min(workers or available_cores(), len(plan)), progress.advance,
                                shrink)
        for path, reason in bad:
            log.warning("%s: cannot be decoded (%s); packed all the same, training skips it", path, reason)
        if undecodable is not None:
            undecodable.extend(bad)
        (partial / CLASSES_FILE).write_text(json.dumps(list(listing.classes)) + "\n")
        write_pack_index(partial, targets)
        _move_into_place(partial, out, [] if placed is None else placed)
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone already when the pack completed
    return [out / target.name for target in targets]


def _check_out_folder(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: not a folder (expected OUT_DIR, where the shards go)")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out}: the folder holds files already (old shards would train beside the new ones); "
                         f"give an empty or new OUT_DIR, or --overwrite to replace what it holds")


def _remove_dead_partials(out: Path) -> None:
    """What a killed pack into `out` left: its hidden folder, and the old pack an --overwrite was removing, each
    named with the dead pack's pid."""
    name = glob.escape(out.name)
    for hidden in [*out.parent.glob(f".{name}.partial-*"), *out.parent.glob(f".{name}.old-*")]:
        pid = hidden.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(hidden, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _move_into_place(partial: Path, out: Path, placed: list[Path]) -> None:
    """`partial` becomes `out` in one rename, and `out` is added to `placed`; an old `out` (empty, or replaced by
    --overwrite) goes first, and comes back if the second rename fails. Ctrl-C and SIGTERM wait across the renames
    (between them `out` would be gone, its old pack hidden, and the new one removed by the interrupted pack's
    cleanup), then act."""
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    try:
        with signals_deferred(set(WORKER_IGNORES)):
            moved_old = out.is_dir()
            if moved_old:
                os.rename(out, old)
            try:
                os.rename(partial, out)
            except BaseException:
                if moved_old:
                    os.rename(old, out)
                raise
            placed.append(out)
    finally:
        if placed and placed[-1] == out:  # also when a signal waited: the old pack was replaced
            shutil.rmtree(old, ignore_errors=True)  # interrupted here: the next pack into `out` removes the rest


def _write_shards(targets: list[Path], plan: list[list[Member]], workers: int, advance,
                  shrink: Shrink = AS_THEY_ARE) -> list[tuple[str, str]]:
    """Every shard written; the files that cannot be decoded, with why, in order."""
    bad: list[tuple[str, str]] = []
    if workers <= 1:
        for target, shard in zip(targets, plan):
            bad.extend(write_shard(target, shard, shrink))
            advance()
        return bad
    # Ctrl-C and SIGTERM blocked while the workers start: one that came before a worker's initializer ran would
    # print that worker's traceback. It waits, and is taken as soon as every worker holds it ignored.
    pool = ProcessPoolExecutor(workers, mp_context=CONTEXT, initializer=_worker_start)
    try:
        with signals_blocked_for_children(set(WORKER_IGNORES)):
            # submits every shard, which starts every worker
            results = pool.map(write_shard, targets, plan, itertools.repeat(shrink))
        for found in results:
            bad.extend(found)
            advance()
    finally:
        _stop_workers(pool)
    return bad


# A scheduler's SIGTERM reaches every process of the job, as Ctrl-C the terminal's group: the pack stops as one.
WORKER_IGNORES = (signal.SIGINT, signal.SIGTERM)


def _worker_start() -> None:
    """Workers die with the parent (a killed pack leaves no orphans) and leave Ctrl-C and SIGTERM to it (no
    traceback each, and no worker lost before the parent stops the pack)."""
    exit_with_parent()
    for ignored in WORKER_IGNORES:
        signal.signal(ignored, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(WORKER_IGNORES))  # blocked by the parent while it started us


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Done: the workers exit. Interrupted: they are killed (SIGKILL: they ignore SIGTERM), not left to write the
    shard each holds."""
    processes = executor_processes(pool)
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=10)


def sample_key(relative: str) -> str:
    """`n01440764/n01440764_10026.JPEG` -> `n01440764/n01440764_10026`; dots would end a WebDataset key early."""
    stem = os.path.splitext(relative)[0]
    return stem.replace(".", "_")


def _check_unique_keys(members: list[Member]) -> None:
    seen: dict[str, str] = {}
    for path, key, _ in members:
        if key in seen:
            raise ValueError(f"{path} and {seen[key]} would share the key {key!r} (same name, other extension)")
        seen[key] = path


def split_into_shards(members: list[Member], sizes: list[int], shard_size: int) -> list[list[Member]]:
    """Consecutive runs of members, each shard at most `shard_size` bytes (or one member, if that is larger)."""
    shards: list[list[Member]] = [[]]
    used = 0
    for member, size in zip(members, sizes):
        cost = 2 * TAR_BLOCK + -(-size // TAR_BLOCK) * TAR_BLOCK + TAR_BLOCK  # image header + data, .cls
        if shards[-1] and used + cost > shard_size:
            shards.append([])
            used = 0
        shards[-1].append(member)
        used += cost
    return shards


def write_shard(target: Path, members: list[Member], shrink: Shrink = AS_THEY_ARE) -> list[tuple[str, str]]:
    """The shard written; returns (file, reason) of each member that cannot be decoded."""
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    imaging.make_decode_warnings_errors()
    probe = np.empty((PROBE_SIDE, PROBE_SIDE, 3), np.uint8)
    bad = []
    with tarfile.open(temporary, "w", format=tarfile.GNU_FORMAT) as archive:
        for path, key, label in members:
            faults.simulated_delay(faults.READ_LATENCY_ENV)  # tests stretch a pack to signal it midway
            with open(path, "rb") as handle:
                data = handle.read()
            stored, extension, reason = _stored_form(data, shrink, probe)
            if reason is not None:
                bad.append((path, reason))
            _add(archive, key + (extension or os.path.splitext(path)[1].lower()), stored)
            _add(archive, key + ".cls", str(label).encode())
    os.replace(temporary, target)
    return bad


def _stored_form(data: bytes, shrink: Shrink, probe: np.ndarray) -> tuple[bytes, str | None, str | None]:
    """(what the member holds, its extension where not the file's own, why the file cannot be decoded or None).
    Each file is decoded once, as a producer decodes it: into `probe` where it is kept as it is, else whole for
    `shrink` (that decode is the check). A file training skips is stored as it is: never made into a clean image
    by another decoder's rules."""
    size = imaging.stored_size(data) if shrink.resizes else None
    try:
        if size is None or not shrink.rewrites(size):
            imaging.load_into(data, probe, "none", None)
            return _with_restarts(data, shrink), None, None
        pixels = imaging.shrunk_pixels(data, size, shrink.max_side)
    except imaging.UnusableImage as error:
        return data, None, str(error)
    if shrink.stores_raw(size):
        return imaging.encode_raw(pixels), imaging.RAW_EXTENSION, None
    return imaging.with_restart_markers(imaging.encode_jpeg(pixels, shrink.quality)), ".jpg", None  # no bytes to keep


def _with_restarts(data: bytes, shrink: Shrink) -> bytes:
    return data if shrink.keep_bytes else imaging.with_restart_markers(data)


def _say_when_kept_as_they_are(shrink: Shrink) -> None:
    if not imaging.can_rewrite_jpegs() and not shrink.keep_bytes:
        log.warning("the crop-aware JPEG decoder (_jpegcrop) is not built here: JPEGs are stored as they are, without "
                    "the restart markers that let a crop decode only its own part (pip install -e . with "
                    "libjpeg-turbo's headers, Debian's libjpeg62-turbo-dev, builds it)")


def _add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    archive.addfile(info, io.BytesIO(data))


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("pack", help="write an ImageFolder as WebDataset-layout tar shards")
    parser.add_argument("source", type=Path, metavar="IMAGEFOLDER", help="the folder to pack: one subfolder per "
                        "class, its images inside (as --data takes it)")
    parser.add_argument("out", type=data_location, metavar="OUT_DIR", help="where the shards go: a new or empty "
                        "folder, or an s3:// (gs://) prefix (the pack is uploaded)")
    parser.add_argument("--val", type=Path, metavar="VAL_IMAGEFOLDER", help="also pack this validation folder, "
                        "labelled with the training classes, into OUT_DIR/val")
    parser.add_argument("--shard-size", default="1GB", metavar="SIZE", help="largest shard: bytes, or a number "
                        "with K, M, G or T (decimal: 1GB = 10^9 bytes), e.g. 500MB or 70KB; default 1GB")
    parser.add_argument("--workers", type=int, default=0, help="processes writing shards (default: every core)")
    parser.add_argument("--overwrite", action="store_true", help="replace what OUT_DIR holds (default: refuse a "
                                                                "folder that holds files)")
    parser.add_argument("--max-side", type=int, metavar="PX", help="store training images whose longer side exceeds "
                        "PX as JPEGs with that longer side (never upscaled; smaller files kept as they are; --val "
                        "kept whole, at the resolution validation needs): less to decode each epoch")
    parser.add_argument("--quality", type=int, metavar="Q", help=f"JPEG quality of the images --max-side shrinks "
                        f"(default {DEFAULT_QUALITY})")
    parser.add_argument("--raw-max-side", type=int, metavar="PX", help="store training images whose longer side "
                        "(after --max-side) is PX or less as raw RGB pixels (.npy members: no decode each epoch, for "
                        "3 bytes a pixel; --val kept as it is)")
    parser.add_argument("--keep-bytes", action="store_true", help="store each kept file's bytes as they are (by "
                        "default a JPEG is rewritten losslessly, the same pixels, with a restart marker after every "
                        "MCU, so that a crop decodes only the part of the file it covers: less CPU per image)")
    parser.set_defaults(run=pack_command)


def pack_command(args: argparse.Namespace) -> int:
    args.undecodable = []  # every pack() of the command adds its files that cannot be decoded
    args.placed = []  # and each folder it put in place
    try:
        if not args.source.is_dir():
            raise ValueError(f"{args.source}: not a folder (expected an ImageFolder root)")
        shard_size = parse_size("shard_size", args.shard_size)
        args.shrink = _shrink(args)
        if args.val is not None and not args.val.is_dir():  # before the training pack, not after it
            raise ValueError(f"val={str(args.val)!r}: not a folder (expected an ImageFolder root)")
        if is_remote(args.out):
            where, shards, val_shards = _pack_to_store(args, shard_size)
        else:
            where = str(args.out)
            shards = pack(args.source, args.out, shard_size, args.workers, args.overwrite, shrink=args.shrink,
                          undecodable=args.undecodable, placed=args.placed)
            val_shards = _pack_validation(args, shard_size)
    except ValueError as error:
        print(f"stoker: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"stoker: pack interrupted; {_what_was_written(args)}", file=sys.stderr)
        return 130
    _print_use(where, shards, val_shards, len(args.undecodable))
    return 0


def _shrink(args: argparse.Namespace) -> Shrink:
    if args.max_side is None and args.quality is not None:
        raise ValueError("--quality is the quality of the images --max-side shrinks: give --max-side too")
    return Shrink(args.max_side, DEFAULT_QUALITY if args.quality is None else args.quality, args.raw_max_side,
                  args.keep_bytes)


def _print_use(where: str, shards: list[Path], val_shards: list[Path], undecodable: int) -> None:
    """What was written under `where` (a folder or a prefix) and the `--data` (and `--val`) that trains on it."""
    use = f"--data {shlex.quote(where + '/' + shard_pattern(Path(), shards).name)}"
    if val_shards:
        use += f" --val {shlex.quote(f'{where}/{VAL_FOLDER}/' + shard_pattern(Path(), val_shards).name)}"
    print(f"wrote {len(shards)} shard(s), {CLASSES_FILE} and {PACK_INDEX_FILE} to {where}"
          + (f", {len(val_shards)} validation shard(s) to {where}/{VAL_FOLDER}" if val_shards else "")
          + (f"; {undecodable} file(s) cannot be decoded (logged above): packed, and skipped by training"
             if undecodable else "")
          + f"; train with {use}")


VAL_FOLDER = "val"


def _pack_to_store(args: argparse.Namespace, shard_size: int) -> tuple[str, list[Path], list[Path]]:
    """Pack into a temporary folder, then upload it under the S3 (or GCS) prefix `args.out`: the shards first,
    `classes.json` and `index.json` last, so a reader that finds the index finds every shard it names. Refused
    where the prefix holds objects, unless --overwrite (which then removes those the new pack does not write).
    Returns the prefix and the shards and validation shards as they were packed locally."""
    out = str(args.out).rstrip("/")
    check_url("out", out)
    if out.startswith(("http://", "https://")):
        raise ValueError(f"out={out!r}: HTTP servers take no uploads; pack into a folder and serve it")
    held = set(object_store.objects_under(out + "/"))
    if held and not args.overwrite:
        raise ValueError(f"out={out!r}: the prefix holds {len(held)} object(s) already (old shards would train beside "
                         f"the new ones); give an empty prefix, or --overwrite to replace what it holds")
    with tempfile.TemporaryDirectory(prefix="stoker-pack-") as scratch:
        local = Path(scratch) / "out"
        args = argparse.Namespace(**{**vars(args), "out": local})
        shards = pack(args.source, local, shard_size, args.workers, False, shrink=args.shrink,
                      undecodable=args.undecodable)
        val_shards = _pack_validation(args, shard_size)
        files = sorted(p for p in local.rglob("*") if p.is_file())
        last = {CLASSES_FILE, PACK_INDEX_FILE}
        written = []
        with waiting(f"uploading to {out}", total=len(files), unit="files") as progress:
            for file in [f for f in files if f.name not in last] + [f for f in files if f.name in last]:
                written.append(f"{out}/{file.relative_to(local).as_posix()}")
                object_store.upload(file, written[-1])
                progress.advance()
    for stale in held - set(written):
        object_store.delete(stale)
    return out, shards, val_shards


def _pack_validation(args: argparse.Namespace, shard_size: int) -> list[Path]:
    if args.val is None:
        return []
    classes = tuple(json.loads((args.out / CLASSES_FILE).read_text()))
    return pack(args.val, args.out / VAL_FOLDER, shard_size, args.workers, args.overwrite, classes,
                shrink=Shrink(keep_bytes=args.keep_bytes), undecodable=args.undecodable, placed=args.placed)


def _what_was_written(args: argparse.Namespace) -> str:
    """What an interrupted pack leaves at OUT_DIR, and what to do about it."""
    if is_remote(args.out):  # objects appear one by one: what was uploaded stays, index.json (uploaded last) not
        return (f"the objects uploaded so far stay under {args.out}, without its {PACK_INDEX_FILE}: pack again with "
                "--overwrite")
    if not args.placed:
        return f"nothing was written to {args.out}"
    if args.val is not None and len(args.placed) == 1:
        return (f"{args.out} holds the whole training set, without the validation set {args.out / VAL_FOLDER}: pack "
                "again with --overwrite for both")
    return f"{args.out} was complete before it stopped"


def shard_pattern(folder: Path, shards: list[Path]) -> Path:
    """The brace pattern naming these shards (`shard-{000000..000007}.tar`), or the one shard's path."""
    if len(shards) == 1:
        return folder / shards[0].name
    first, last = shards[0].stem.split("-")[-1], shards[-1].stem.split("-")[-1]
    return folder / f"shard-{{{first}..{last}}}.tar"

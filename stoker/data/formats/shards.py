"""WebDataset-layout tar shards: which shards a `--data` value names, and the member index of each shard.

A sample is `KEY.jpg` (or another image extension) with `KEY.cls` holding its integer label, KEY being the
member's path up to the first dot of its file name, as WebDataset defines it. Each shard is read once with the
standard library's `tarfile` to find where every member's bytes lie; producers then read a sample with one `pread`.
Samples are numbered in shard order, then member order: the plan picks samples exactly as it picks files.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import mmap
import os
import re
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stoker.common.files import replace_durably
from stoker.common.urls import check_url, is_remote
from stoker.common.waiting import waiting
from stoker.data.formats.folders import IMAGE_EXTENSIONS, Skipped
from stoker.data.index import (
    MTIME_GUARD_NS,
    SHARDS_FOLDER,
    Packed,
    PackedIndex,
    cache_key,
    file_stamp,
    index_cache_dir,
    input_stamps,
    load_cached,
    warn_once,
    write_entry,
)
from stoker.data.pixels.imaging import MAX_SAMPLE_BYTES, RAW_EXTENSION, is_raw_pixels, too_large
from stoker.data.transports import object_store

log = logging.getLogger(__name__)

CLASSES_FILE = "classes.json"
TAR_BLOCK = 512
_ZERO_BLOCK = bytes(TAR_BLOCK)
_PLAIN_KINDS = (b"0", b"\0", b"5", b"7")  # regular file (three spellings) and directory
IMAGE_SUFFIXES = frozenset(e.lstrip(".") for e in IMAGE_EXTENSIONS)
# The raw pixels `stoker pack --raw-max-side` stores (imaging.raw_pixels): a key's image where it has no image file.
# Beside one, a .npy is another of the sample's fields (WebDataset shards carry features so) and is not looked at.
RAW_SUFFIX = RAW_EXTENSION.lstrip(".")
RAW_HEAD_BYTES = 256  # enough for the .npy header np.save writes (128 bytes)
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_ALTERNATIVES = re.compile(r"\{([^{}]*,[^{}]*)\}")
_OCTAL = re.compile(rb"[0-7]+")  # a size field: int(_, 8) would also take '-1000', '+7' and '1_0'
_DECIMAL = re.compile(rb"[0-9]+")
# tarfile reads a pax header's or GNU long name's body whole, before anything checks it: one claiming 3 GiB took
# 3.3 GB and minutes. Real ones hold a few hundred bytes; and each in a chain is a level of recursion in tarfile.
_EXTENSION_KINDS = {b"x": "pax header", b"X": "pax header", b"g": "pax global header", b"L": "GNU long name",
                    b"K": "GNU long link name"}
MAX_EXTENSION_BYTES = 1 << 20
MAX_EXTENSION_CHAIN = 16
MAX_LABEL_BYTES = 32  # a .cls holds one number: anything longer is not a label
MAX_LABEL_DIGITS = 9  # labels are int64 in the index; far below that, a label this long names no real class
# Without classes.json the class count is the largest label plus one: one stray label must not build a model of a
# million outputs. Beyond this, write classes.json beside the shards (`stoker pack` always does).
MAX_CLASSES_WITHOUT_LIST = 10_000
COMPRESSED_SUFFIXES = (".gz", ".tgz", ".bz2", ".xz", ".zst", ".zstd", ".lz4")


def expand_braces(pattern: str) -> list[str]:
    """`train-{000000..000003}.tar` -> four names (zero padding kept), `{a,b}` -> two; several braces multiply."""
    found = [m for m in (_RANGE.search(pattern), _ALTERNATIVES.search(pattern)) if m is not None]
    if not found:
        return [pattern]
    match = min(found, key=lambda m: m.start())  # the leftmost brace varies slowest, as in the shell
    if match.re is _RANGE:
        first, last = match.group(1), match.group(2)
        if int(last) < int(first):
            raise ValueError(f"data={pattern!r}: the range {{{first}..{last}}} counts down")
        width = len(first) if first.startswith("0") else 0
        choices = [str(n).zfill(width) for n in range(int(first), int(last) + 1)]
    else:
        choices = match.group(1).split(",")
    head, tail = pattern[:match.start()], pattern[match.end():]
    return list(itertools.chain.from_iterable(expand_braces(head + c + tail) for c in choices))


def shard_paths(spec: Path | str) -> list[str] | None:
    """The shards `spec` names (a brace pattern, one .tar, a folder of .tar files, a list file; or the URL of
    one, a brace pattern of URLs, an S3 prefix), or None for an ImageFolder. Raises ValueError naming what is
    missing."""
    if is_remote(spec):
        return _remote_shards(str(spec))
    spec = Path(spec)
    text = str(spec)
    if spec.is_dir():  # first: a folder's name may hold a brace
        paths = sorted(str(p) for p in spec.iterdir() if p.suffix.lower() == ".tar" and p.is_file())
        if not paths:
            _refuse_compressed(text, [p.name for p in spec.iterdir() if p.is_file()])
            return None
    elif _RANGE.search(text) or _ALTERNATIVES.search(text):
        paths = expand_braces(text)
    elif spec.suffix.lower() == ".tar":
        paths = [text]
    elif spec.is_file():
        _refuse_compressed(text, [spec.name])
        paths = _read_list_file(spec)
    else:
        raise ValueError(f"data={text!r}: no such folder, shard or list file")
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"data={text!r}: {len(missing)} of {len(paths)} shards do not exist, e.g. {missing[0]!r}")
    return paths


def _remote_shards(spec: str) -> list[str]:
    """The objects a URL names, each asked for its version now: a missing or forbidden one is an error before any
    process starts."""
    check_url("data", spec)
    if _RANGE.search(spec) or _ALTERNATIVES.search(spec):
        urls = expand_braces(spec)
    elif spec.lower().endswith(".tar"):
        urls = [spec]
    elif spec.endswith("/"):
        urls = object_store.list_tars(spec)
        if not urls:
            raise ValueError(f"data={spec!r}: no .tar object under this prefix")
    else:
        _refuse_compressed(spec, [spec.rsplit("/", 1)[-1]])
        raise ValueError(f"data={spec!r}: expected .tar shards (train-{{0000..0127}}.tar), one .tar, or an S3 "
                         f"prefix ending in /")
    object_store.forget_versions(urls + [_beside(urls[0], PACK_INDEX_FILE), _beside(urls[0], CLASSES_FILE)])
    _pack_indexes.clear()  # each load asks again: objects may have been replaced since this process last asked
    object_store.stat_all(urls)
    return urls


def _refuse_compressed(data: str, names: list[str]) -> None:
    """Compressed shards have no offsets to read a sample at: say so, and how to make plain ones."""
    compressed = [n for n in names if n.lower().endswith(COMPRESSED_SUFFIXES)]
    if compressed and all(".tar" in n.lower() or n.lower().endswith(".tgz") for n in compressed):
        raise ValueError(f"data={data!r}: compressed shards ({compressed[0]!r}) are not read: a sample is read "
                         f"at its offset in a plain .tar; decompress them (gunzip -k, xz -dk, zstd -d) or write "
                         f"plain ones with `stoker pack IMAGEFOLDER OUT_DIR`")


def _read_list_file(spec: Path) -> list[str]:
    """One shard per line (relative to the list file's folder); blank lines and # comments ignored."""
    try:
        text = spec.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"data={str(spec)!r}: neither a folder, a .tar shard nor a list file of shards (it is "
                         f"not UTF-8 text)") from None
    lines = [line.strip() for line in text.splitlines()]
    paths = [os.path.join(spec.parent, line) for line in lines if line and not line.startswith("#")]
    if not paths:
        raise ValueError(f"data={str(spec)!r}: the list file names no shards")
    return paths


def load_shards(paths: list[str], classes: tuple[str, ...] | None = None, cache: Path | None = None,
                copies: object_store.LocalCopies | None = None) -> PackedIndex:
    """The packed index of these shards, from the cache while every shard keeps its modification time (a remote
    one its ETag); remote shards are read from `copies` once copied there."""
    cache = cache or index_cache_dir()
    paths = [p if is_remote(p) else os.path.realpath(p) for p in paths]
    classes_file = _beside(paths[0], CLASSES_FILE)
    key = cache_key("shards", paths, classes)
    cached = load_cached(cache, key)
    if cached is None:
        started = time.time_ns()
        # classes.json is stamped also while it does not exist: one written later must be read.
        inputs = paths + [classes_file]
        packed = index_shards(paths, classes or _classes_beside(classes_file), cache / SHARDS_FOLDER, copies)
        _pack_indexes.clear()  # read for this index only: not held for the run
        cached = write_entry(cache, key, packed, input_stamps(inputs, started))
    return cached.reading_copies(copies) if copies is not None else cached


def _beside(shard: str, name: str) -> str:
    """The file `name` in the shard's folder (a URL's folder for a remote shard)."""
    if is_remote(shard):
        return shard.rsplit("/", 1)[0] + "/" + name
    return os.path.join(os.path.dirname(shard), name)


def _classes_beside(classes_file: str) -> tuple[str, ...] | None:
    text = _read_small(classes_file, MAX_CLASSES_FILE_BYTES)
    if text is None:
        return None
    try:
        names = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{classes_file}: not a JSON list of class names ({error})") from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{classes_file}: expected a JSON list of class names")
    return tuple(names)


REMOTE_INDEX_THREADS = 8  # shards indexed at once: each waits on a whole fetch or a round trip, not on a core
DEAD_FETCH_S = 3600  # a shard being fetched to be indexed this long ago was a killed run's
MAX_CLASSES_FILE_BYTES = 64 << 20  # a million long class names; a file past this is refused before it is read


def _read_small(path: str, limit: int) -> bytes | None:
    """A small file beside the shards, local or remote; None when it does not exist."""
    if is_remote(path):
        return object_store.fetch(path, limit)
    try:
        size = os.path.getsize(path)
        if size > limit:
            raise ValueError(f"{path}: {size} bytes, more than the {limit} such a file may hold")
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def index_shards(paths: list[str], classes: tuple[str, ...] | None, cache: Path | None = None,
                 copies: object_store.LocalCopies | None = None) -> Packed:
    """Every shard's samples in order; without class names, classes are '0'..'max label'. With `cache`, each
    shard's members are kept there, so a set with one shard added or changed reads only that shard again."""
    members = ShardMembers()

    stop = threading.Event()  # set on an error or Ctrl-C: the shards being fetched stop at their next chunk

    def one(path: str) -> ShardMembers:
        return _one_shard_cached(path, cache, copies, stop) if cache else index_one_shard(path, copies, stop)

    # Remote shards wait on the network (a whole shard fetched, or a round trip): several at once, kept in order.
    workers = REMOTE_INDEX_THREADS if any(is_remote(p) for p in paths) else 1
    with waiting("indexing shards", total=len(paths), unit="shards") as progress, \
            ThreadPoolExecutor(workers, thread_name_prefix="stoker-index") as pool:
        try:
            for shard_id, found in enumerate(pool.map(one, paths)):
                members.extend(found, shard_id)
                progress.advance()
        finally:
            stop.set()
    labels = np.asarray(members.labels, dtype=np.int64)
    bound = len(classes) if classes is not None else MAX_CLASSES_WITHOUT_LIST
    outside = labels >= bound
    if outside.any():
        members.drop(outside, (lambda label: f"label outside the {bound} classes") if classes is not None else
                     (lambda label: f"label {label} is not below {MAX_CLASSES_WITHOUT_LIST}, the most classes read "
                                    f"without {CLASSES_FILE} beside the shards (write one to have more)"))
        labels = labels[~outside]
    if classes is None:
        classes = tuple(str(i) for i in range(int(labels.max(initial=-1)) + 1))
    if not members.keys:
        raise ValueError(f"data={paths[0]!r}...: no sample (KEY.jpg|png|... with KEY.cls) in {len(paths)} shard(s)")
    remote_versions = {p: object_store.stat(p) for p in paths if is_remote(p)}  # as asked at this load
    versions = [remote_versions[p].etag if p in remote_versions else "" for p in paths]
    sizes = [remote_versions[p].size if p in remote_versions else 0 for p in paths]
    return Packed("", members.keys, labels, classes, members.skipped, paths, np.asarray(members.shard_ids),
                  np.asarray(members.starts), np.asarray(members.sizes), versions, sizes)


@dataclass
class ShardMembers:
    """Samples as columns: key, label, shard, where its image's bytes lie; and what was refused."""

    keys: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    shard_ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.skipped = [s if isinstance(s, Skipped) else Skipped(*s) for s in self.skipped]  # read back from JSON

    def add(self, key: str, label: int, shard_id: int, start: int, size: int) -> None:
        pairs: tuple[tuple[list[Any], Any], ...] = ((self.keys, key), (self.labels, label), (self.shard_ids, shard_id),
                                                    (self.starts, start), (self.sizes, size))
        for column, value in pairs:
            column.append(value)

    def extend(self, shard: ShardMembers, shard_id: int) -> None:
        """Append one shard's members (indexed alone, as shard 0) as shard `shard_id`."""
        pairs: tuple[tuple[list[Any], list[Any]], ...] = (
            (self.keys, shard.keys), (self.labels, shard.labels), (self.starts, shard.starts),
            (self.sizes, shard.sizes), (self.skipped, shard.skipped), (self.shards, shard.shards))
        for mine, theirs in pairs:
            mine.extend(theirs)
        self.shard_ids.extend([shard_id] * len(shard.keys))

    def drop(self, mask: np.ndarray, reason: Callable[[int], str]) -> None:
        """Remove the samples under `mask`, each listed with `reason(its label)`."""
        for position in np.flatnonzero(mask):
            self.skipped.append(Skipped(f"{self.shards[self.shard_ids[position]]}:{self.keys[position]}",
                                        reason(self.labels[position])))
        keep = np.flatnonzero(~mask).tolist()
        columns: tuple[list[Any], ...] = (self.keys, self.labels, self.shard_ids, self.starts, self.sizes)
        for column in columns:
            column[:] = [column[i] for i in keep]


Member = tuple[str, int, int]  # (name, offset of its data, size)


def _one_shard_cached(path: str, cache: Path, copies: object_store.LocalCopies | None = None,
                      stop: threading.Event | None = None) -> ShardMembers:
    """A shard's members from the cache while its stamp (size, mtime, ctime, inode; a remote one's size, ETag and
    its pack index's version, which may have been corrected since) holds and the kept file its checksum, else read
    and kept."""
    started, stamp = time.time_ns(), file_stamp(path)
    if is_remote(path) and isinstance(stamp, list):
        stamp = [*stamp, file_stamp(_beside(path, PACK_INDEX_FILE))]
    saved = cache / f"{cache_key(path, stamp)}.json"
    kept = _read_kept(saved)
    if kept is not None:
        return kept
    members = index_one_shard(path, copies, stop)
    settled = isinstance(stamp, list) and (is_remote(path) or stamp[1] < started - MTIME_GUARD_NS)
    if settled:  # a local shard changed in the last seconds may still be being written: read again next time
        skipped = [[item.path, item.reason] for item in members.skipped]
        payload = json.dumps({**members.__dict__, "skipped": skipped}).encode()
        try:
            cache.mkdir(parents=True, exist_ok=True)
            replace_durably(saved, payload + b"\n" + hashlib.sha256(payload).hexdigest().encode())
        except OSError as error:
            warn_once(f"unwritable {cache}", "the shard index cache %s cannot be written (%s): shards are read "
                      "again at every start", cache, error.strerror or error)
    return members


def _read_kept(saved: Path) -> ShardMembers | None:
    """A shard's kept members, None when absent; a file that fails its checksum is removed, with a warning."""
    try:
        payload, _, digest = saved.read_bytes().rpartition(b"\n")
    except OSError:
        return None
    try:
        if hashlib.sha256(payload).hexdigest().encode() != digest:
            raise ValueError("checksum")
        return ShardMembers(**json.loads(payload))
    except (ValueError, TypeError):
        log.warning("the kept index of a shard, %s, is damaged: reading the shard again", saved)
        saved.unlink(missing_ok=True)
        return None


def index_one_shard(path: str, copies: object_store.LocalCopies | None = None, stop: threading.Event | None = None
                    ) -> ShardMembers:
    """The shard's samples (as shard 0); members that do not make a sample are listed, and a truncated shard is
    indexed up to its last whole member. A remote shard's come from its pack index, or from a local copy already
    in `copies`, else from the shard fetched whole into a temporary file (copies are the `CopyFiller`'s to make)."""
    if not is_remote(path):
        return _index_local(path, path)
    version = object_store.stat(path)
    packed = pack_index_members(path, version)
    if packed is not None:
        return packed
    if copies is not None:
        with contextlib.suppress(FileNotFoundError):  # evicted by another run meanwhile: fetched as if never copied
            return _index_local(str(copies.path(path, version.etag)), path)
    with tempfile.TemporaryDirectory(prefix=".shard-", dir=_fetch_folder()) as scratch:
        target = Path(scratch) / "shard.tar"
        if not object_store.download(path, version, target, lambda: stop is None or not stop.is_set()):
            raise ValueError(f"{path}: indexing stopped")
        return _index_local(str(target), path)


def _fetch_folder() -> str | None:
    """Where a shard is fetched to be indexed: the index cache (not /tmp, often memory, and a shard may be
    gigabytes), clear of what a killed run left there; None (the system's temporary folder) where it cannot be
    written."""
    folder = index_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for left in folder.glob(".shard-*"):
            if left.stat().st_mtime < time.time() - DEAD_FETCH_S:
                shutil.rmtree(left, ignore_errors=True)
    except OSError:
        return None
    return str(folder)


# ---- the index `stoker pack` writes beside its shards -------------------------------------------------------------

PACK_INDEX_FILE = "index.json"
PACK_INDEX_FORMAT = "stoker-shard-index/1"
MAX_PACK_INDEX_BYTES = 256 << 20  # about 60 bytes a sample: 4 million samples; a larger one is not read (the
# shards are then fetched whole to index them): parsed, JSON takes ten times its size in memory
_MD5 = re.compile(r'^"?([0-9a-f]{32})"?$')


def write_pack_index(folder: Path, shards: list[Path]) -> None:
    """Each shard's members (as `index_one_shard` finds them), size and MD5 in `folder/index.json`: a run that
    reads the shards remotely takes them from here instead of fetching every shard whole to index it."""
    entries = {}
    for shard in shards:
        members = index_one_shard(str(shard))
        with open(shard, "rb") as handle:
            md5 = hashlib.file_digest(handle, "md5").hexdigest()
        entries[shard.name] = {"size": shard.stat().st_size, "md5": md5, "keys": members.keys,
                               "labels": members.labels, "starts": members.starts, "sizes": members.sizes,
                               "skipped": [[item.path[len(str(shard)):], item.reason] for item in members.skipped]}
    (folder / PACK_INDEX_FILE).write_text(json.dumps({"format": PACK_INDEX_FORMAT, "shards": entries}))


_pack_indexes: dict[str, dict | None] = {}  # per folder URL, read once per load
_pack_indexes_lock = threading.Lock()


def pack_index_members(url: str, version: object_store.Version) -> ShardMembers | None:
    """The shard's members from the pack index beside it, when there is one that describes this very object (its
    size, and its MD5 where the ETag is one, as S3's is for an object uploaded in one part); else None."""
    folder, name = url.rsplit("/", 1)
    with _pack_indexes_lock:  # the indexing threads: one of them reads it, the others wait for it
        if folder not in _pack_indexes:
            _pack_indexes[folder] = _read_pack_index(f"{folder}/{PACK_INDEX_FILE}")
    entry = (_pack_indexes[folder] or {}).get(name)
    if not isinstance(entry, dict) or entry.get("size") != version.size:
        return None
    md5 = _MD5.match(version.etag)
    if md5 is not None and md5.group(1) != entry.get("md5"):
        return None
    try:
        return _checked_members(url, entry, version.size)
    except (TypeError, ValueError, LookupError) as error:
        log.warning("%s/%s: its entry for %s is not usable (%s): the shard is read whole to index it", folder,
                    PACK_INDEX_FILE, name, error)
        return None


def _read_pack_index(url: str) -> dict | None:
    try:
        text = object_store.fetch(url, MAX_PACK_INDEX_BYTES)
        if text is None:
            return None
        found = json.loads(text)
    except ValueError as error:
        log.warning("%s cannot be used (%s): each shard is read whole to index it", url, error)
        return None
    if not isinstance(found, dict) or found.get("format") != PACK_INDEX_FORMAT or not isinstance(found.get("shards"),
                                                                                                  dict):
        log.warning("%s is not a %s file: each shard is read whole to index it", url, PACK_INDEX_FORMAT)
        return None
    return found["shards"]


def _checked_members(url: str, entry: dict, shard_size: int) -> ShardMembers:
    """The entry's columns as the shard's members, each value checked before it places a read."""
    keys, labels, starts, sizes = (entry[column] for column in ("keys", "labels", "starts", "sizes"))
    if not (len(keys) == len(labels) == len(starts) == len(sizes)):
        raise ValueError("its columns differ in length")
    if not all(isinstance(k, str) for k in keys):
        raise ValueError("a key is not text")
    for column in (labels, starts, sizes):
        if not all(type(v) is int and 0 <= v < 1 << 62 for v in column):
            raise ValueError("a label, start or size is not a non-negative integer")
    if any(label >= 10**MAX_LABEL_DIGITS for label in labels):
        raise ValueError("a label is far beyond any class count")
    if any(start + size > shard_size for start, size in zip(starts, sizes)):
        raise ValueError("a member lies beyond the shard's end")
    skipped = [Skipped(url + suffix, reason) for suffix, reason in entry["skipped"]]
    members = ShardMembers(skipped=skipped, shards=[url])
    for key, label, start, size in zip(keys, labels, starts, sizes, strict=True):
        if size > MAX_SAMPLE_BYTES:  # the index may claim any size: a read of it would be held whole in memory
            members.skipped.append(Skipped(f"{url}:{key}", too_large(size)))
        else:
            members.add(key, label, 0, start, size)
    return members


def _index_local(file: str, path: str) -> ShardMembers:
    """`file`'s samples, named as the shard `path`."""
    into = ShardMembers(shards=[path])
    with open(file, "rb") as handle:
        data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(handle.fileno()).st_size else b""
    try:
        found = _plain_members(data)
        if found is None:
            found = _tarfile_members(file, data)
        members, truncated = found
        if truncated:
            into.skipped.append(Skipped(path, f"truncated shard: indexed its first {len(members)} members, then "
                                              f"{truncated}"))
        groups, repeated = _group_by_key(members)
        for key, parts in groups.items():
            sample = _sample(data, parts) if key not in repeated else _repeated(key, repeated[key])
            if isinstance(sample, str):
                into.skipped.append(Skipped(f"{path}:{key}", sample))
                continue
            into.add(key, sample[0], 0, sample[1][1], sample[1][2])
            for other in _other_images(parts, sample[1]):
                into.skipped.append(Skipped(f"{path}:{other}", f"a second image of the key {key!r}, not used (the "
                                                               f"sample is {sample[1][0]!r})"))
    except tarfile.ReadError as error:
        into.skipped.append(Skipped(path, f"not a readable tar file: {error}"))
    finally:
        if isinstance(data, mmap.mmap):
            data.close()
    return into


def _group_by_key(members: list[Member]) -> tuple[dict[str, dict[str, Member]], dict[str, list[str]]]:
    """Members by key, then by suffix (lower case); and, per key, the suffixes that appear more than once (a
    tar appended to, two writers): which of them is meant cannot be known, so such a key is no sample."""
    groups: dict[str, dict[str, Member]] = {}
    repeated: dict[str, list[str]] = {}
    for member in members:
        key, _, suffix = _split_name(member[0])
        parts = groups.setdefault(key, {})
        if suffix.lower() in parts:
            repeated.setdefault(key, []).append(member[0])
        parts[suffix.lower()] = member
    return groups, repeated


def _repeated(key: str, names: list[str]) -> str:
    return f"the shard holds {', '.join(repr(n) for n in sorted(set(names)))} more than once: which is meant is " \
           f"unknown, so the key {key!r} is not used"


def _other_images(parts: dict[str, Member], used: Member) -> list[str]:
    return [member[0] for suffix, member in parts.items() if suffix in IMAGE_SUFFIXES and member is not used]


def _plain_members(data) -> tuple[list[Member], str] | None:
    """Regular files of a tar whose headers are all plain ustar or GNU ones, read straight from the headers (tarfile
    decodes every field of every header: 300 us a sample, minutes for ImageNet), and why the archive stopped early
    ('' if it did not); None when a header needs tarfile (pax or GNU long names, base-256 sizes)."""
    members: list[Member] = []
    offset, end = 0, len(data)
    while offset + TAR_BLOCK <= end:
        header = data[offset:offset + TAR_BLOCK]
        if header == _ZERO_BLOCK:
            return members, ""
        kind, magic = header[156:157], header[257:263]
        if kind not in _PLAIN_KINDS or magic not in (b"ustar\0", b"ustar ") or header[124] & 0x80:
            return None
        if not _checksum_holds(header):
            return members, "a damaged header (its checksum does not add up)"
        field = header[124:136].split(b"\0")[0].strip() or b"0"
        if not _OCTAL.fullmatch(field):  # '-1000' would step back onto the same header, forever
            return members, f"a damaged header (its size {field[:12]!r} is not an octal number)"
        size = int(field, 8)
        start = offset + TAR_BLOCK
        if start + size > end:
            return members, "a member cut short"
        if kind != b"5":
            name = header[:100].split(b"\0", 1)[0]
            if magic == b"ustar\0" and header[345] != 0:  # POSIX: a long path is split into prefix/name
                name = header[345:500].split(b"\0", 1)[0] + b"/" + name
            members.append((name.decode("utf-8", "surrogateescape"), start, size))
        offset = start + -(-size // TAR_BLOCK) * TAR_BLOCK
    return members, ("a header cut short" if offset < end else "no end-of-archive marker")


def _checksum_holds(header: bytes) -> bool:
    """The stored checksum is the sum of the header's bytes with its own field counted as spaces."""
    try:
        stored = int(header[148:156].split(b"\0")[0].strip(), 8)
    except ValueError:
        return False
    return sum(header) - sum(header[148:156]) + 8 * ord(" ") == stored


def _tarfile_members(path: str, data) -> tuple[list[Member], str]:
    """Members read with tarfile, each header it is about to read checked first (`_header_problem`)."""
    members: list[Member] = []
    problem = _header_problem(data, 0)
    if problem:  # tarfile.open reads the first member already
        return members, problem
    checked = 0
    with tarfile.open(path, "r:") as archive:
        while True:
            if archive.offset > checked:  # not yet when open's first member is still to be handed out
                checked = archive.offset
                problem = _header_problem(data, checked)
                if problem:
                    return members, problem
            try:
                member = archive.next()
            except tarfile.ReadError as error:  # a header cut short
                return members, f"a header cut short ({error})"
            if member is None:  # an end-of-archive block, or (tarfile does not tell) a header cut or damaged
                return members, _end_problem(data, archive.offset)
            if member.size < 0:  # a pax 'size' keyword of -1000: tarfile would step back and read headers again
                return members, f"a damaged header at byte {member.offset} (its size {member.size} is negative)"
            if member.offset_data + member.size > len(data):
                return members, "a member cut short"
            if member.isfile():
                members.append((member.name, member.offset_data, member.size))


def _header_problem(data, offset: int) -> str:
    """Why the header at `offset`, with the pax headers and GNU long names chained before the member it
    describes, must not reach tarfile ('' if nothing): a size that is no octal or base-256 number, an extension
    header over MAX_EXTENSION_BYTES (tarfile would read it whole into memory), a chain over MAX_EXTENSION_CHAIN.
    Damage that costs nothing to read (a checksum, a cut) is left to tarfile."""
    start = offset
    for _ in range(MAX_EXTENSION_CHAIN + 1):
        header = data[offset:offset + TAR_BLOCK]
        if len(header) < TAR_BLOCK or header == _ZERO_BLOCK:
            return ""
        size = _size_field(header)
        if size is None:
            return f"a damaged header at byte {offset} (its size {bytes(header[124:136])!r} is not an octal number)"
        kind = _EXTENSION_KINDS.get(header[156:157])
        if kind is None:
            return ""
        if size > MAX_EXTENSION_BYTES:
            return f"a damaged header at byte {offset} (a {kind} of {size} bytes: real ones hold a few hundred, " \
                   f"and more than {MAX_EXTENSION_BYTES} is not read)"
        offset += TAR_BLOCK + -(-size // TAR_BLOCK) * TAR_BLOCK
    return f"a damaged header at byte {start} (more than {MAX_EXTENSION_CHAIN} pax headers or GNU long names " \
           f"before one member)"


def _size_field(header: bytes) -> int | None:
    """A header's size: octal digits, or GNU's base-256 (a first byte of 0x80); None for anything else (a sign,
    a negative base-256 number)."""
    if header[124] == 0x80:
        return int.from_bytes(header[125:136], "big")
    field = header[124:136].split(b"\0")[0].strip() or b"0"
    return int(field, 8) if _OCTAL.fullmatch(field) else None


def _end_problem(data, offset: int) -> str:
    """'' when the archive ends where tarfile stopped with its end-of-archive marker, else what went wrong."""
    block = bytes(data[offset:offset + TAR_BLOCK])
    if block == _ZERO_BLOCK:
        return ""
    return "a header cut short" if len(block) < TAR_BLOCK else "a damaged header, or no end-of-archive marker"


def _split_name(name: str) -> tuple[str, str, str]:
    """(key, '.', suffix): the key ends at the first dot of the file name, folders included."""
    dot = name.find(".", name.rfind("/") + 1)
    return (name, "", "") if dot < 0 else (name[:dot], ".", name[dot + 1:])


def _sample(data, parts: dict[str, Member]) -> tuple[int, Member] | str:
    """(label, image member), or why these members are not a sample."""
    image = next((parts[s] for s in parts if s in IMAGE_SUFFIXES), parts.get(RAW_SUFFIX))
    if image is not None and image is parts.get(RAW_SUFFIX) and not is_raw_pixels(
            bytes(data[image[1]:image[1] + min(image[2], RAW_HEAD_BYTES)])):
        image = None  # another array (a WebDataset's features), not pixels pack wrote
    if image is None:
        return f"no image member (found {', '.join(sorted('.' + s for s in parts))})"
    if image[2] > MAX_SAMPLE_BYTES:
        return f"{image[0]}: {too_large(image[2])}"
    label_member = parts.get("cls")
    if label_member is None:
        return "no .cls label member"
    _, start, size = label_member
    if size > MAX_LABEL_BYTES:
        return f".cls holds {size} bytes, not an integer label"
    text = bytes(data[start:start + size]).strip(b" \t\r\n")
    if not _DECIMAL.fullmatch(text):  # int() would also take '+3', '1_0' and ' ３'
        return f".cls holds {text[:20]!r}, not an integer label (a plain decimal number)"
    if len(text.lstrip(b"0")) > MAX_LABEL_DIGITS:
        return f".cls holds the label {text[:20].decode()}, far beyond any class count"
    return int(text), image

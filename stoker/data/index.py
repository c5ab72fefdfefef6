"""The packed sample index: one read-only entry in the cache folder that the controller and every producer map.

An entry holds the sample names as one bytes buffer with offsets, the labels as an array, and for tar shards where
each sample lies (shard, offset, size). Producers receive the entry's folder, not the names: pickling a
`PackedIndex` sends a path, and each process maps the same files, so a producer's memory and start time do not
grow with the dataset (the pages are the page cache's, shared by all).

An entry is reused while its data is unchanged: for an ImageFolder, while every directory it read keeps its
modification time (adding, removing or renaming a file changes its directory's); for shards, while every shard
keeps its size, modification time, change time and inode (a shard replaced by `cp -p`, `rsync -t`, `tar x` or
`mv` keeps its mtime, not its ctime or inode), and while `classes.json` stays as it was (absent included).
Entries are written to a temporary folder, fsynced and renamed, and the pointer to the current entry (which holds
each file's SHA-256) is written after them, durably, so a reader never sees half an index; an entry that fails
its checksums is built again, with one warning. Where the cache cannot be written, the index is kept in memory.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stoker.common import faults
from stoker.common.files import replace_durably, write_durably
from stoker.common.urls import is_remote
from stoker.data.formats.builtin_data import cache_root
from stoker.data.formats.folders import Skipped, list_image_folder
from stoker.data.pixels.imaging import UNREADABLE, UnusableImage
from stoker.data.transports import object_store

log = logging.getLogger(__name__)

INDEX_VERSION = 5  # 2: stamps with size, ctime and inode; checksums; labels read strictly. 3: the root stamped
# 4: samples over 64 MiB refused; Parquet rows that name a file read from it; a blob's samples named by their file
# 5: a shard's KEY.npy with no image file of its key is the key's image (raw pixels, `pack --raw-max-side`)
# A directory changed within this long before its listing may have changed again inside the same timestamp tick
# (filesystems keep times as coarse as 1-2 s): such a listing is used but never trusted from the cache.
MTIME_GUARD_NS = 2_000_000_000
STALE_ENTRY_S = 24 * 3600  # superseded entries are removed after a day: a running job's new producers map them
MAX_OPEN_SHARDS = 128
SHARDS_FOLDER = "shards"  # each shard's members, kept by `data.formats.shards` (small; kept until removed by hand)
UNSTABLE_REFUSALS = ("unreadable folder", "broken symlink")
ABSENT = "absent"  # the stamp of an input that did not exist: it must still not exist
_warned: set[str] = set()  # one warning per problem and process, not one per shard or split


@dataclass
class Packed:
    """An index before it is written: names, labels and, for shards, where each sample's bytes lie."""

    base: str  # prefix of every file name ('' for shards)
    names: list[str]
    labels: list[int] | np.ndarray
    classes: tuple[str, ...]
    skipped: list[Skipped] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)
    shard_ids: np.ndarray | None = None
    starts: np.ndarray | None = None
    sizes: np.ndarray | None = None
    versions: list[str] = field(default_factory=list)  # each remote shard's ETag ('' for a local one)
    shard_sizes: list[int] = field(default_factory=list)  # and its size (0 for a local one)
    origins: list[str] = field(default_factory=list)  # what names each shard's samples, where not the shard (a
    # Parquet file's, not the blob in the cache its bytes were copied to); empty: the shards themselves


class PackedIndex:
    """Samples of one split: `paths[i]` names sample i (a file, or `shard.tar:KEY`), `labels[i]` its class,
    `read(i)` its bytes. Read-only, memory-mapped; pickles as the entry's folder."""

    def __init__(self, folder: Path | None, part: str | None = None, memory: dict | None = None,
                 copies: object_store.LocalCopies | None = None) -> None:
        """From the entry `folder`, or (`folder` None) from `memory`: the arrays and meta of an entry the cache
        could not hold, which then travel to producers whole. Remote shards are read from `copies` once there."""
        self.folder, self.part, self._memory = (Path(folder) if folder is not None else None), part, memory
        self.copies = copies
        self._ahead: dict[int, Future[bytes]] = {}
        if memory is None:
            # A shared lock for as long as this process maps the entry: a later start's clean-up leaves it alone.
            self._in_use = open(self._file("meta.json"), "rb")  # noqa: SIM115 (closed with this object)
            fcntl.flock(self._in_use, fcntl.LOCK_SH)
            meta = json.loads(self._in_use.read())
        else:
            meta = memory["meta"]
        self.classes: tuple[str, ...] = tuple(meta["classes"])
        self.base: str = meta["base"]
        self.shards: tuple[str, ...] = tuple(meta["shards"])
        self.versions: tuple[str, ...] = tuple(meta.get("versions") or ("",) * len(self.shards))
        self.sizes: tuple[int, ...] = tuple(meta.get("sizes") or (0,) * len(self.shards))  # a remote shard's bytes
        self.origins: tuple[str, ...] = tuple(meta.get("origins") or self.shards)  # what a sample's name starts with
        self._names = self._array("names.npy")
        self._offsets = self._array("offsets.npy")
        self._ids = self._array(f"{part}.ids.npy") if part else None
        self.labels = self._array(f"{part}.labels.npy" if part else "labels.npy")
        if self.shards:
            self._where = self._array("where.npy")  # (shard, start, size) per sample
        self.paths: Sequence[str] = _Names(self)

    def _array(self, name: str) -> np.ndarray:
        return self._memory[name] if self._memory is not None else _mapped(self._file(name))

    def _file(self, name: str) -> Path:
        assert self.folder is not None, "an index in memory has no files"
        return self.folder / name

    def _as_memory(self) -> dict:
        """This whole index's arrays and meta, copied into memory."""
        memory: dict = {file: np.asarray(self._array(file)) for file in ("names.npy", "offsets.npy", "labels.npy")}
        if self.shards:
            memory["where.npy"] = np.asarray(self._where)
        memory.update(meta={"classes": list(self.classes), "base": self.base, "shards": list(self.shards),
                            "versions": list(self.versions), "sizes": list(self.sizes),
                            "origins": list(self.origins)},
                      skipped=[[s.path, s.reason] for s in self.skipped])
        return memory

    def __reduce__(self):
        return PackedIndex, (self.folder, self.part, self._memory, self.copies)

    def reading_copies(self, copies: object_store.LocalCopies) -> PackedIndex:
        return PackedIndex(self.folder, self.part, self._memory, copies)

    def remote_shards(self) -> list[tuple[str, str, int]]:
        """(url, ETag, size) of each remote shard, in order, as the index was made from them."""
        return [(shard, version, size) for shard, version, size in zip(self.shards, self.versions, self.sizes)
                if version]

    @property
    def streamed(self) -> bool:
        """Whether samples come over a network (remote shards, read by ranges until a local copy is complete)."""
        return any(self.versions)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def skipped(self) -> tuple[Skipped, ...]:
        """Entries the scan refused; the whole index's, whatever the part."""
        rows = self._memory["skipped"] if self._memory is not None else \
            json.loads(self._file("skipped.json").read_text())
        return tuple(Skipped(path, reason) for path, reason in rows)

    def position(self, sample: int) -> int:
        return int(self._ids[sample]) if self._ids is not None else sample

    def name(self, position: int) -> str:
        raw = bytes(self._names[self._offsets[position]:self._offsets[position + 1] - 1])  # without its NUL
        if self.shards:
            return f"{self.origins[int(self._where[position, 0])]}:{os.fsdecode(raw)}"
        return self.base + os.fsdecode(raw)

    def read_ahead(self, samples: Sequence[int]) -> None:
        """Start fetching these samples' bytes together (remote shards only, those not already on their way): a
        part of them then waits about one round trip, not one per sample. `read` hands each over."""
        if not self.streamed:
            return
        wanted, members = [], []
        for sample in samples:
            if sample not in self._ahead:
                shard, start, size = (int(v) for v in self._where[self.position(sample)])
                if self.versions[shard]:
                    wanted.append(sample)
                    members.append((self.shards[shard], self.versions[shard], start, size))
        self._ahead.update(zip(wanted, object_store.read_all_later(members, self.copies), strict=True))

    def read(self, sample: int) -> bytes:
        ahead = self._ahead.pop(sample, None) if self._ahead else None
        if ahead is not None:
            return ahead.result()  # raises what reading it raised
        return self._read_now(sample)

    def _read_now(self, sample: int) -> bytes:
        position = self.position(sample)
        if not self.shards:
            return read_file(self.name(position))
        shard, start, size = (int(v) for v in self._where[position])
        if self.versions[shard]:
            return object_store.read_range(self.shards[shard], self.versions[shard], start, size, self.copies)
        return read_member(self.shards[shard], start, size)

    def subset(self, name: str, ids: np.ndarray) -> PackedIndex:
        """The samples `ids` of this index as a split of its own, written beside it once (for a seed and a
        fraction, the same ids every time)."""
        assert self.part is None, "a split is taken from a whole index"
        ids = np.asarray(ids, dtype=np.int64)
        labels = np.asarray(self.labels)[ids]
        if self._memory is not None:
            return PackedIndex(None, name, {**self._memory, f"{name}.ids.npy": ids, f"{name}.labels.npy": labels},
                               self.copies)
        ids_file, labels_file = self._file(f"{name}.ids.npy"), self._file(f"{name}.labels.npy")
        # Both compared, not trusted: a flipped bit in a cached label would train a sample under another class.
        if not (_holds(ids_file, ids) and _holds(labels_file, labels)):
            try:
                _save_atomically(labels_file, labels)
                _save_atomically(ids_file, ids)
            except OSError as error:
                _warn_unwritable(ids_file.parent, error)
                return PackedIndex(None, None, self._as_memory(), self.copies).subset(name, ids)
        return PackedIndex(self.folder, name, copies=self.copies)


def _holds(path: Path, expected: np.ndarray) -> bool:
    try:
        return bool(np.array_equal(np.load(path, mmap_mode="r"), expected))
    except (OSError, ValueError, EOFError):  # missing, cut short, not an array
        return False


def _mapped(path: Path) -> np.ndarray:
    """A read-only array over the mapped file. A plain ndarray view, not the np.memmap itself: memmap's Python
    __getitem__ costs microseconds on every index, and a producer indexes several times per image."""
    return np.load(path, mmap_mode="r").view(np.ndarray)


class _Names(Sequence[str]):
    """`index.paths`: names decoded one at a time from the mapped buffer, never a list of a million strings."""

    def __init__(self, index: PackedIndex) -> None:
        self._index = index

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, sample):
        if isinstance(sample, slice):
            return [self[i] for i in range(*sample.indices(len(self)))]
        return self._index.name(self._index.position(int(sample)))

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(len(self)))


# ---- reading a sample ------------------------------------------------------------------------------------------

def read_file(path: str) -> bytes:
    faults.simulated_delay(faults.READ_LATENCY_ENV)
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        raise UnusableImage("file vanished (deleted during the run)") from None
    except OSError as error:
        raise UnusableImage(f"{UNREADABLE} {error.strerror or error}") from None


_open_shards: dict[str, int] = {}


def read_member(shard: str, start: int, size: int) -> bytes:
    """One tar member's bytes by offset (`pread`: no seek state, no reading ahead into other members)."""
    faults.simulated_delay(faults.READ_LATENCY_ENV)
    try:
        data = os.pread(_shard_fd(shard), size, start)
    except OSError as error:
        raise UnusableImage(f"unreadable shard {shard}: {error.strerror or error}") from None
    if len(data) != size:
        raise UnusableImage(f"shard {shard} is shorter than its index (changed during the run?)")
    return data


def _shard_fd(shard: str) -> int:
    fd = _open_shards.get(shard)
    if fd is None:
        if len(_open_shards) >= MAX_OPEN_SHARDS:  # bounded: close all, reopen what is needed
            for old in _open_shards.values():
                os.close(old)
            _open_shards.clear()
        fd = _open_shards[shard] = os.open(shard, os.O_RDONLY)
    return fd


# ---- the cache ---------------------------------------------------------------------------------------------------

def index_cache_dir() -> Path:
    return cache_root() / "index"


def load_image_folder(root: Path, classes: tuple[str, ...] | None = None, cache: Path | None = None) -> PackedIndex:
    """The packed index of an ImageFolder, from the cache while no directory it read has changed."""
    cache = cache or index_cache_dir()
    key = cache_key("folder", os.path.realpath(root), classes)
    entry = _cached(cache, key)
    if entry is not None:
        return PackedIndex(entry)
    started = time.time_ns()
    listing = list_image_folder(root, classes)
    packed = Packed(listing.base, listing.names, listing.labels, listing.classes, listing.skipped)
    inputs = input_stamps(listing.folders, started)
    # A folder made readable, or a link target created, changes no directory's time: list such a tree every run.
    inputs += [[s.path, None] for s in listing.skipped if s.reason.startswith(UNSTABLE_REFUSALS)]
    return write_entry(cache, key, packed, inputs)


ENTRY_FILES = {"names.npy", "offsets.npy", "labels.npy", "skipped.json", "meta.json"}  # every entry's (`_entry_files`)


def _entry_files_present(entry: Path) -> set[str]:
    return ENTRY_FILES | ({"where.npy"} if (entry / "where.npy").exists() else set())  # shards' entries have it


def load_cached(cache: Path, key: str) -> PackedIndex | None:
    entry = _cached(cache, key)
    return PackedIndex(entry) if entry is not None else None


def cache_key(*parts) -> str:
    text = json.dumps([INDEX_VERSION, *parts], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def file_stamp(path: str) -> list | str | None:
    """[size, mtime, ctime, inode], ABSENT for no such file, None when it cannot be asked. The mtime alone is
    kept by `cp -p`, `rsync -t` and `tar x`; the ctime and inode are the file system's own, and `mv` changes them.
    A remote object's is [size, ETag]."""
    if is_remote(path):
        return _object_stamp(path)
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return ABSENT
    except OSError:
        return None
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


def _object_stamp(url: str) -> list | str | None:
    try:
        version = object_store.stat(url)
    except ValueError as error:
        # S3 answers 403 for an absent object
        refused = object_store.NO_SUCH_OBJECT in str(error) or object_store.ACCESS_REFUSED in str(error)
        return ABSENT if refused else None
    return [version.size, version.etag]


def input_stamps(paths: list[str], started_ns: int) -> list[list]:
    """(path, stamp) of each input; None where it changed too close to the listing to be trusted."""
    stamps: list[list] = []
    for path in paths:
        stamp = file_stamp(path)
        recent = isinstance(stamp, list) and len(stamp) == 4 and stamp[1] >= started_ns - MTIME_GUARD_NS
        stamps.append([path, None if recent else stamp])
    return stamps


def _cached(cache: Path, key: str) -> Path | None:
    """The entry the pointer names, if every input it was made from still has its recorded stamp and every file
    of the entry its checksum."""
    try:
        pointer = json.loads((cache / f"{key}.json").read_text())
        inputs, name, digests = pointer["inputs"], pointer["entry"], pointer["sha256"]
        entry = cache / name
        # The entry must be this key's (a pointer copied from another folder's key once trained on that folder's
        # files) and each of its files must have a checksum (an empty list turned the check off).
        if not (isinstance(name, str) and name.startswith(f"{key}-") and os.path.basename(name) == name
                and isinstance(digests, dict) and _entry_files_present(entry) <= set(digests)):
            log.warning("the index cache pointer %s does not name an entry of its own with every file's checksum: "
                        "indexing again", cache / f"{key}.json")
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if any(stamp is None or file_stamp(path) != stamp for path, stamp in inputs):
        return None
    damaged = next((name for name, digest in digests.items() if _digest(entry / name) != digest), None)
    if damaged is not None:
        log.warning("the index cache entry %s is damaged (%s does not match its checksum): indexing again",
                    entry, damaged)
        if not _mapped_by_a_live_process(entry):
            shutil.rmtree(entry, ignore_errors=True)
        return None
    return entry


def _digest(path: Path) -> str | None:
    try:
        with open(path, "rb") as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest()
    except OSError:
        return None


def write_entry(cache: Path, key: str, packed: Packed, inputs: list[list]) -> PackedIndex:
    """Write the entry's files to a temporary folder, fsync and rename it into place, then point the key at it
    (the pointer written and fsynced last: a power cut leaves the old pointer or a whole entry). Where the cache
    cannot be written (read-only, full), the index is kept in memory for this run, with a warning."""
    files = _entry_files(packed)
    name = f"{key}-{uuid.uuid4().hex[:12]}"
    temporary = cache / f".{name}.tmp"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        temporary.mkdir()
        for file, data in files.items():
            write_durably(temporary / file, data)
        _fsync_folder(temporary)
        os.rename(temporary, cache / name)
        _fsync_folder(cache)
        digests = {file: hashlib.sha256(data).hexdigest() for file, data in files.items()}
        replace_durably(cache / f"{key}.json", json.dumps({"entry": name, "inputs": inputs,
                                                           "sha256": digests}).encode())
    except OSError as error:
        shutil.rmtree(temporary, ignore_errors=True)
        _warn_unwritable(cache, error)
        return PackedIndex(None, None, _in_memory(files))
    _remove_stale(cache, keep=name)
    return PackedIndex(cache / name)


def _entry_files(packed: Packed) -> dict[str, bytes]:
    blob = _join_names(packed.names)
    ends = np.flatnonzero(blob == 0)  # one NUL after every name: a name cannot hold one
    arrays = {"names.npy": blob, "offsets.npy": np.concatenate([[0], ends + 1]).astype(np.int64),
              "labels.npy": np.asarray(packed.labels, dtype=np.int64)}
    if packed.shards:
        columns = [np.asarray(column) for column in (packed.shard_ids, packed.starts, packed.sizes)]
        arrays["where.npy"] = np.stack(columns, axis=1).astype(np.int64)
    files = {file: _npy_bytes(array) for file, array in arrays.items()}
    files["skipped.json"] = json.dumps([[s.path, s.reason] for s in packed.skipped]).encode()
    files["meta.json"] = json.dumps({"version": INDEX_VERSION, "classes": list(packed.classes),
                                     "base": packed.base, "shards": packed.shards,
                                     "versions": packed.versions, "sizes": packed.shard_sizes,
                                     "origins": packed.origins}).encode()
    return files


def _in_memory(files: dict[str, bytes]) -> dict:
    memory: dict = {file: np.load(io.BytesIO(data)) for file, data in files.items() if file.endswith(".npy")}
    memory.update(meta=json.loads(files["meta.json"]), skipped=json.loads(files["skipped.json"]))
    return memory


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def warn_once(problem: str, message: str, *args) -> None:
    if problem not in _warned:
        _warned.add(problem)
        log.warning(message, *args)


def _warn_unwritable(cache: Path, error: OSError) -> None:
    warn_once(f"unwritable {cache}", "the index cache %s cannot be written (%s): this run keeps its index in "
              "memory (each producer gets a copy; set STOKER_CACHE to a writable folder to share one)",
              cache, error.strerror or error)


def _join_names(names: list[str]) -> np.ndarray:
    """Every name and a NUL after it, in one buffer, encoded as the filesystem encodes file names."""
    text = "\0".join(names) + "\0"
    return np.frombuffer(text.encode(sys.getfilesystemencoding(), "surrogateescape"), dtype=np.uint8)


def _save_atomically(path: Path, array: np.ndarray) -> None:
    replace_durably(path, _npy_bytes(array))


def _remove_stale(cache: Path, keep: str) -> None:
    """Entries a day past being current go: superseded ones of this key, and those of data that no longer exists.
    (Not at once, and never one a live process maps: a run still going may start a producer that maps it.)"""
    cutoff = time.time() - STALE_ENTRY_S
    current = {keep}
    for pointer in cache.glob("*.json"):
        try:
            stamp = json.loads(pointer.read_text())
            gone = pointer.stat().st_mtime < cutoff and not all(is_remote(p) or os.path.exists(p)
                                                                for p, _ in stamp["inputs"])
        except (OSError, ValueError, KeyError):
            continue
        if gone:
            pointer.unlink(missing_ok=True)
        else:
            current.add(stamp["entry"])
    for entry in cache.iterdir():
        try:
            stale = entry.name not in current and entry.name != SHARDS_FOLDER and entry.stat().st_mtime < cutoff
        except OSError:  # another start removed it meanwhile
            continue
        if entry.is_dir() and stale and not _mapped_by_a_live_process(entry):
            shutil.rmtree(entry, ignore_errors=True)


def _mapped_by_a_live_process(entry: Path) -> bool:
    try:
        with open(entry / "meta.json", "rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no meta.json: a half-written entry, nothing maps it
        return False
    return False

"""Parquet image datasets (Hugging Face's layout among them) and `datasets.save_to_disk` folders as packed indexes.

A file's image bytes are copied out once, a batch of rows at a time, into a blob in the index cache named by the
file's stamp, and the index is an ordinary shard index over the blobs: producers read a sample with one `pread`, so
every guarantee of shards holds, and no producer decompresses a page of images per sample or needs pyarrow. Blobs,
columns and checks: docs/data.md, "Parquet"."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from stoker.common.files import replace_durably
from stoker.common.urls import check_url, is_remote
from stoker.common.waiting import waiting
from stoker.data.formats.folders import Skipped
from stoker.data.formats.shards import MAX_CLASSES_WITHOUT_LIST, ShardMembers, expand_braces
from stoker.data.index import (
    ABSENT,
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
from stoker.data.pixels.imaging import MAX_SAMPLE_BYTES, too_large
from stoker.data.transports import object_store

IMAGE_COLUMNS = ("image", "img")  # tried in turn, then the only column that can hold images
LABEL_COLUMNS = ("label", "labels")
PARQUET_SUFFIX = ".parquet"
BLOB_FOLDER = "parquet"  # under the index cache's SHARDS_FOLDER
SAVED_STATE, SAVED_INFO, DATASET_DICT = "state.json", "dataset_info.json", "dataset_dict.json"
HUB_DATA_FOLDER = "data"  # the Hugging Face Hub keeps a dataset's Parquet files in data/
_HUB_FILE = re.compile(r"^(?P<split>.+)-(?P<number>\d+)-of-(?P<count>\d+)\.parquet$", re.IGNORECASE)
VAL_SPLITS = ("validation", "val", "valid", "test")
PARQUET_MAGIC, ENCRYPTED_MAGIC, ARROW_FILE_MAGIC = b"PAR1", b"PARE", b"ARROW1"
# A footer (the file's metadata, every row group's) of a million rows is a few MB; one claiming more is damage, and
# pyarrow would read it whole into memory before anything else could look.
MAX_FOOTER_BYTES = 64 << 20
MAX_METADATA_BYTES = 64 << 20  # the Hugging Face metadata, state.json, dataset_info.json: read whole, then parsed
MAX_ROWS_PER_FILE = 1 << 31
MAX_REFUSED_ROWS = 100_000  # each is listed (an object and a line of summary.json): a file of nulls is refused whole
# Images are compressed already: a column chunk claiming to expand more than this from its stored bytes is damaged
# or a decompression bomb; and the blob of a file never grows past this many times the file (dictionary-encoded
# repeats of one image included).
MAX_EXPANSION = 64
EXPANSION_SLACK = 1 << 20  # page headers and offsets of a small chunk may outweigh its compressed bytes
BATCH_ROWS = 256  # rows decoded at a time: memory stays a batch of images, whatever a row group holds
# What a batch's images may take decoded: a dictionary-encoded column repeats its values, and 256 rows of a 4 MiB
# one took 1.9 GB before any size was checked. A row group with a dictionary of N bytes is read BATCH_BYTES // N
# rows at a time (a value is never longer than its dictionary).
BATCH_BYTES = 64 << 20
READ_BUFFER_BYTES = 1 << 20  # pyarrow streams a column chunk through this instead of reading it whole


@dataclass(frozen=True)
class Columns:
    """The image and label columns asked for (None: the defaults)."""

    image: str | None = None
    label: str | None = None


DEFAULT_COLUMNS = Columns()


# ---- what `--data` names ----------------------------------------------------------------------------------------

def parquet_files(spec: Path | str) -> list[str] | None:
    """The Parquet files `spec` names, in order (one .parquet; a folder of them, or of the Hugging Face Hub's
    data/SPLIT-00000-of-00003.parquet; a glob or brace pattern; the URL of one, or a brace pattern of URLs), or
    the Arrow files of a `datasets.save_to_disk` folder; None when `spec` names no Parquet data (an ImageFolder,
    shards). Raises ValueError naming what is missing, or which split to name."""
    if is_remote(spec):
        return _remote_files(str(spec))
    path = Path(spec)
    if path.is_dir():
        return _folder_files(path)
    if not str(path).lower().endswith(PARQUET_SUFFIX):
        return None
    return _pattern_files(str(path))


def _remote_files(spec: str) -> list[str] | None:
    """The objects a URL names, each asked for its version now: a missing or forbidden one is an error before
    any process starts."""
    check_url("data", spec)
    if spec.endswith("/") and not spec.lower().startswith("http"):  # an S3 or GCS prefix (HTTP has no listing)
        urls = sorted(u for u in object_store.objects_under(spec)  # those right under it: a split's sub-folder is not
                      if u.lower().endswith(PARQUET_SUFFIX) and "/" not in u[len(spec):])  # this split's
        if not urls:
            return None  # shards, perhaps: shards.py says what the prefix lacks
    else:
        urls = expand_braces(spec)
    if not all(url.lower().endswith(PARQUET_SUFFIX) for url in urls):
        return None
    object_store.forget_versions(urls)  # each load asks again: objects may have been replaced since
    object_store.stat_all(urls)
    return urls


def _pattern_files(text: str) -> list[str]:
    paths: list[str] = []
    for pattern in expand_braces(text):
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise ValueError(f"data={text!r}: no file matches {pattern!r}")
            paths += matches
        else:
            paths.append(pattern)
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing and len(paths) == 1:
        raise ValueError(f"data={text!r}: no such Parquet file")
    if missing:
        raise ValueError(f"data={text!r}: {len(missing)} of {len(paths)} Parquet files do not exist, e.g. "
                         f"{missing[0]!r}")
    return paths


def _folder_files(folder: Path) -> list[str] | None:
    if (folder / DATASET_DICT).is_file():
        _refuse_dataset_dict(folder)
    if (folder / SAVED_STATE).is_file() and (folder / SAVED_INFO).is_file():
        return _saved_files(folder)
    for place in (folder, folder / HUB_DATA_FOLDER):
        names = sorted(p.name for p in place.iterdir() if p.suffix.lower() == PARQUET_SUFFIX and p.is_file()) \
            if place.is_dir() else []
        if names:
            _check_one_split(folder, place, names)
            return [str(place / name) for name in names]
    return None


def _refuse_dataset_dict(folder: Path) -> None:
    """A DatasetDict holds several splits: training on all of them at once (test set included) is never meant."""
    listed = _small_json(folder / DATASET_DICT).get("splits")
    if not (isinstance(listed, list) and listed and all(isinstance(s, str) for s in listed)):
        listed = sorted(p.name for p in folder.iterdir() if (p / SAVED_STATE).is_file())
    train = next((s for s in ("train", "training") if s in listed), listed[0] if listed else "train")
    val = next((s for s in VAL_SPLITS if s in listed), None)
    meant = f"--data {folder / train}" + (f" --val {folder / val}" if val else "")
    raise ValueError(f"data={str(folder)!r}: a DatasetDict of the splits {', '.join(listed)} (datasets' "
                     f"save_to_disk of several splits); name one split's folder: {meant}")


def _saved_files(folder: Path) -> list[str]:
    """The Arrow files of a `save_to_disk` folder, in the order its state.json gives (the dataset's row order)."""
    state = folder / SAVED_STATE
    entries = _small_json(state).get("_data_files")
    if not (isinstance(entries, list) and entries
            and all(isinstance(e, dict) and isinstance(e.get("filename"), str) for e in entries)):
        raise ValueError(f"{state}: expected datasets' state.json, with the list of its data files (_data_files)")
    names = [e["filename"] for e in entries]
    outside = [n for n in names if os.path.basename(n) != n or n in ("", ".", "..")]
    if outside:
        raise ValueError(f"{state}: names a data file outside its folder ({outside[0]!r})")
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise ValueError(f"data={str(folder)!r}: {len(missing)} of the {len(names)} data files its state.json names "
                         f"do not exist, e.g. {missing[0]!r}")
    return [str(folder / name) for name in names]


def _small_json(path: Path) -> dict:
    """A small JSON object datasets writes; {} when it is not one. One too large to be real is refused unread."""
    try:
        size = path.stat().st_size
        if size > MAX_METADATA_BYTES:
            raise ValueError(f"{path}: {size} bytes, more than the {MAX_METADATA_BYTES} such a file may hold")
        loaded = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not readable JSON ({error})") from None
    return loaded if isinstance(loaded, dict) else {}


def _check_one_split(folder: Path, place: Path, names: list[str]) -> None:
    """Hub-named files (train-00000-of-00003.parquet) of one split only, and all of them: a folder holding the test
    split beside the training one, or a download cut short, would otherwise train as if complete."""
    splits: dict[str, list[re.Match]] = {}
    for name in names:
        match = _HUB_FILE.match(name)
        if match is not None:
            splits.setdefault(match["split"], []).append(match)
    if len(splits) > 1:
        train = next((s for s in ("train", "training") if s in splits), next(iter(splits)))
        val = next((s for s in VAL_SPLITS if s in splits), None)
        meant = f"--data {place / _split_pattern(splits[train])}" + \
                (f" --val {place / _split_pattern(splits[val])}" if val else "")
        raise ValueError(f"data={str(folder)!r}: holds the splits {', '.join(sorted(splits))}; name one: {meant}")
    for split, matches in splits.items():
        count = int(matches[0]["count"])
        numbers = {int(m["number"]) for m in matches}
        absent = sorted(set(range(count)) - numbers)
        if absent or any(int(m["count"]) != count for m in matches):
            raise ValueError(f"data={str(folder)!r}: holds {len(matches)} of the {count} files of the split "
                             f"{split!r}" + (f" (number {absent[0]} is missing)" if absent else
                                             " (their names disagree on the count)"))


def _split_pattern(matches: list[re.Match]) -> str:
    """The brace pattern naming one split's files: train-{00000..00002}-of-00003.parquet."""
    if len(matches) == 1:
        return matches[0].string
    first, last = matches[0], matches[-1]
    return f"{first['split']}-{{{first['number']}..{last['number']}}}-of-{first['count']}{PARQUET_SUFFIX}"


# ---- the index --------------------------------------------------------------------------------------------------

@dataclass
class FileRows:
    """One file's rows as shard 0 of its blob (named by the file, for refusals), and its ClassLabel names."""

    rows: ShardMembers
    blob: str
    class_names: tuple[str, ...] | None


def load_parquet(paths: list[str], classes: tuple[str, ...] | None = None, cache: Path | None = None,
                 columns: Columns = DEFAULT_COLUMNS) -> PackedIndex:
    """The packed index of these files' rows, from the cache while every file and every blob keeps its stamp."""
    cache = cache or index_cache_dir()
    paths = [p if is_remote(p) else os.path.realpath(p) for p in paths]
    key = cache_key("parquet", paths, classes, columns.image, columns.label)
    cached = load_cached(cache, key)
    if cached is not None:
        return cached
    started = time.time_ns()
    per_file = _files_rows(paths, columns, cache / SHARDS_FOLDER / BLOB_FOLDER, started)
    packed = _packed(paths, per_file, classes)
    # A blob's stamp is taken as it is, not guarded: it was written whole (renamed into place) before this.
    inputs = input_stamps(paths + _info_files(paths), started) + [[blob, file_stamp(blob)] for blob in packed.shards]
    return write_entry(cache, key, packed, inputs)


def _info_files(paths: list[str]) -> list[str]:
    """dataset_info.json beside `save_to_disk` files: its class names are read where the schema has none."""
    return sorted({os.path.join(os.path.dirname(p), SAVED_INFO) for p in paths if _is_arrow(p)})


def _is_arrow(path: str) -> bool:
    return not path.lower().endswith(PARQUET_SUFFIX)


def _files_rows(paths: list[str], columns: Columns, folder: Path, started: int) -> list[FileRows]:
    per_file: list[FileRows] = []
    with waiting("copying images out of Parquet", total=len(paths), unit="files") as progress:
        for path in paths:
            per_file.append(_file_rows(path, columns, folder, started))
            progress.advance()
    return per_file


def _packed(paths: list[str], per_file: list[FileRows], classes: tuple[str, ...] | None) -> Packed:
    names = _agreed_names(paths, per_file)
    rows = ShardMembers()
    for shard_id, found in enumerate(per_file):
        rows.extend(found.rows, shard_id)
    classes = _labels_as_classes(rows, names, classes)
    if not rows.keys:
        first = f" (the first refusal: {rows.skipped[0].path}: {rows.skipped[0].reason})" if rows.skipped else ""
        raise ValueError(f"data={paths[0]!r}{'...' if len(paths) > 1 else ''}: no usable row (an image and a label) "
                         f"in {len(paths)} file(s){first}")
    return Packed("", rows.keys, np.asarray(rows.labels, dtype=np.int64), classes, rows.skipped,
                  [t.blob for t in per_file], np.asarray(rows.shard_ids), np.asarray(rows.starts),
                  np.asarray(rows.sizes), [""] * len(per_file), origins=list(paths))


def _agreed_names(paths: list[str], per_file: list[FileRows]) -> tuple[str, ...] | None:
    """The files' ClassLabel names; files of one dataset that disagree would label the same class two ways."""
    named = [(path, t.class_names) for path, t in zip(paths, per_file) if t.class_names is not None]
    for path, names in named[1:]:
        if names != named[0][1]:
            raise ValueError(f"{path} and {named[0][0]} name different classes in their Hugging Face metadata "
                             f"(expected the files of one dataset)")
    return named[0][1] if named else None


def _labels_as_classes(rows: ShardMembers, names: tuple[str, ...] | None,
                       classes: tuple[str, ...] | None) -> tuple[str, ...]:
    """The classes of the index, each row's label made an index into them; rows without one are refused. With
    `classes` (the training data's, for --val) and names of its own, a row's class is found by name."""
    bound = len(names) if names is not None else len(classes) if classes is not None else MAX_CLASSES_WITHOUT_LIST
    labels = np.asarray(rows.labels, dtype=np.int64)
    if names is not None:
        outside = f"label {{}} is outside the {bound} classes the file's ClassLabel names"
    elif classes is not None:
        outside = f"label {{}} is outside the {bound} classes of the training data"
    else:
        outside = (f"label {{}} is not below {MAX_CLASSES_WITHOUT_LIST}, the most classes read without class names "
                   f"(give the label column a ClassLabel with names)")
    rows.drop(labels >= bound, outside.format)
    if names is not None and classes is not None and names != classes:
        position = {name: k for k, name in enumerate(classes)}
        mapping = np.asarray([position.get(name, -1) for name in names], dtype=np.int64)
        rows.drop(mapping[np.asarray(rows.labels, dtype=np.int64)] < 0,
                  lambda label: f"class {names[label]!r} is not a class of the training data")
        rows.labels = mapping[np.asarray(rows.labels, dtype=np.int64)].tolist()
    if classes is not None:
        return classes
    if names is not None:
        return names
    return tuple(str(i) for i in range(max(rows.labels, default=-1) + 1))


def _file_rows(source: str, columns: Columns, folder: Path, started: int) -> FileRows:
    """One file's rows, from what was kept of its blob while the file keeps its stamp, else copied out again."""
    stamp = file_stamp(source)
    if not isinstance(stamp, list):
        raise ValueError(f"{source}: " + ("no such file" if stamp == ABSENT else "cannot be asked for its size"))
    name = cache_key("parquet-rows", source, stamp, columns.image, columns.label)
    # A file changed in the last seconds may still be being written: its blob is its own, never found again.
    settled = len(stamp) == 2 or stamp[1] < started - MTIME_GUARD_NS
    kept = folder / f"{name}.json"
    if settled:
        found = _read_kept(kept)
        if found is not None:
            return found
    blob = folder / f"{name}{'' if settled else '-' + uuid.uuid4().hex[:12]}.{_short_name(source)}.bin"
    with _readable(source, folder) as local:
        found = _copy_out(local, source, columns, blob)
    if settled:
        _keep(kept, found)
    return found


def _short_name(source: str) -> str:
    """The file's name, in the blob's: a sample's name (BLOB:row N) then says which file it came from."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", source.rstrip("/").rsplit("/", 1)[-1])[-60:]


@contextmanager
def _readable(source: str, folder: Path) -> Iterator[str]:
    """A local path to read `source` from: itself, or a whole download of the remote object (beside the blobs:
    the same disk, and not a memory-backed /tmp)."""
    if not is_remote(source):
        yield source
        return
    version = object_store.stat(source)
    _make_folder(folder, source)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=folder) as scratch:
        target = Path(scratch) / "object"
        object_store.download(source, version, target)
        yield str(target)


def _make_folder(folder: Path, source: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _unwritable(source, folder, error) from None


def _unwritable(source: str, folder: Path, error: OSError) -> ValueError:
    return ValueError(f"{source}: its images cannot be copied into {folder} ({error.strerror or error}); Parquet "
                      f"data is read from a copy of its image bytes kept there: free room, or set STOKER_CACHE to a "
                      f"writable folder with room")


def _read_kept(kept: Path) -> FileRows | None:
    """A file's kept rows, while its blob is whole; None when absent, damaged (removed) or the blob is gone."""
    try:
        payload, _, digest = kept.read_bytes().rpartition(b"\n")
    except OSError:
        return None
    try:
        if hashlib.sha256(payload).hexdigest().encode() != digest:
            raise ValueError("checksum")
        saved = json.loads(payload)
        found = FileRows(ShardMembers(**saved["rows"]), saved["blob"], _names_or_none(saved["class_names"]))
        whole = os.path.getsize(found.blob) == saved["blob_size"]
    except (ValueError, TypeError, KeyError):
        warn_once(f"damaged {kept}", "the kept rows of a Parquet file, %s, are damaged: copying its images again",
                  kept)
        kept.unlink(missing_ok=True)
        return None
    except OSError:  # the blob was removed by hand
        return None
    return found if whole else None


def _names_or_none(names: Any) -> tuple[str, ...] | None:
    return tuple(names) if names is not None else None


def _keep(kept: Path, found: FileRows) -> None:
    rows = {**found.rows.__dict__, "skipped": [[s.path, s.reason] for s in found.rows.skipped]}
    payload = json.dumps({"rows": rows, "blob": found.blob, "blob_size": os.path.getsize(found.blob),
                          "class_names": found.class_names}).encode()
    try:
        replace_durably(kept, payload + b"\n" + hashlib.sha256(payload).hexdigest().encode())
    except OSError as error:
        warn_once(f"unwritable {kept.parent}", "the Parquet rows cache %s cannot be written (%s): images are copied "
                  "out again at every start", kept.parent, error.strerror or error)


# ---- copying the images out ------------------------------------------------------------------------------------

def _arrow() -> Any:
    """pyarrow, imported only when Parquet or Arrow data is read: the CLI and the producers start without it."""
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet  # noqa: F401 (reached as pyarrow.parquet)
    except ImportError:
        raise ValueError("reading Parquet or Arrow data needs pyarrow: pip install 'stoker[parquet]'") from None
    return pyarrow


@dataclass
class _Opened:
    """A file's schema, its record batches of the named columns, and the most image bytes it may give."""

    schema: Any
    batches: Callable[[list[str]], Iterator[Any]]
    budget: int


def _copy_out(file: str, source: str, columns: Columns, blob: Path) -> FileRows:
    """Every usable row's image bytes into `blob` (written beside it and renamed: a reader sees all of it or
    nothing), and the rows found, named as `source`."""
    opener = _open_parquet if source.lower().endswith(PARQUET_SUFFIX) else _open_arrow
    with opener(file, source) as opened:
        image = _image_column(opened.schema, columns.image, source)
        label = _label_column(opened.schema, columns.label, source)
        names = _class_names(opened.schema, label, source)
        rows = ShardMembers(shards=[source])
        _write_blob(blob, source, lambda out: _copy_rows(opened, image, label, source, rows, out))
    if names is None and _is_arrow(source):
        names = _saved_info_names(source, label)
    return FileRows(rows, str(blob), names)


def _write_blob(blob: Path, source: str, fill: Callable[[BinaryIO], None]) -> None:
    _make_folder(blob.parent, source)
    partial = blob.with_name(f".{blob.name}.{os.getpid()}.part")
    try:
        with open(partial, "wb") as out:
            fill(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, blob)
    except OSError as error:  # only the blob's own writes: reading errors arrive as ValueError (`_guarded`)
        raise _unwritable(source, blob.parent, error) from None
    finally:
        partial.unlink(missing_ok=True)


def _copy_rows(opened: _Opened, image: str, label: str, source: str, rows: ShardMembers, out: BinaryIO) -> None:
    """A batch at a time: its image bytes in one write, then each usable row's place in the blob (and the files
    rows name, after them). Only the bytes the file stores count against its budget."""
    row = written = stored = 0
    for batch in opened.batches([image, label]):
        if len(batch) == 0:
            continue
        images, named = _image_values(batch.column(image))
        labels, labelled = _label_values(batch.column(label), source)
        ends = np.frombuffer(images.buffers()[1], dtype=np.int64)[images.offset:images.offset + len(images) + 1]
        first, last = int(ends[0]), int(ends[-1])
        stored += last - first
        if stored > opened.budget:
            raise ValueError(f"{source}: holds more image bytes than {opened.budget}, {MAX_EXPANSION} times what it "
                             f"stores: damaged, or a decompression bomb")
        if last > first:
            out.write(memoryview(images.buffers()[2])[first:last])
        starts, sizes = written + ends[:-1] - first, np.diff(ends)
        written += last - first
        present = images.is_valid().to_numpy(zero_copy_only=False).copy()
        written, unread = _copy_named_files(named, present, starts, sizes, written, source, out)
        usable = present & labelled & (labels >= 0) & (sizes > 0)
        refused = np.flatnonzero(~usable)
        if len(rows.skipped) + len(refused) > MAX_REFUSED_ROWS:  # rows of nulls cost a file nothing to claim
            raise ValueError(f"{source}: more than {MAX_REFUSED_ROWS} rows without a usable image or label: not "
                             f"an image dataset, or damaged")
        for i in refused.tolist():
            reason = unread.get(i) or _row_refusal(bool(present[i]), int(sizes[i]), bool(labelled[i]),
                                                   int(labels[i]))
            rows.skipped.append(Skipped(f"{source}:row {row + i}", reason))
        kept = np.flatnonzero(usable)
        rows.keys.extend(f"row {row + i}" for i in kept.tolist())
        rows.labels.extend(labels[kept].tolist())
        rows.shard_ids.extend([0] * len(kept))
        rows.starts.extend(starts[kept].tolist())
        rows.sizes.extend(sizes[kept].tolist())
        row += len(batch)


# How a user stores the images in the Parquet file itself (`datasets` writes paths alone for an Image column made
# from file paths; push_to_hub embeds them, to_parquet does not).
EMBED_HINT = ("to store the images in the file, write it with `datasets`: from datasets.table import "
              "embed_table_storage; ds.with_format('arrow').map(embed_table_storage, batched=True)"
              ".with_format(None).to_parquet(...)")


def _copy_named_files(named: Any, present: np.ndarray, starts: np.ndarray, sizes: np.ndarray, written: int,
                      source: str, out: BinaryIO) -> tuple[int, dict[int, str]]:
    """Rows that hold no bytes but name a file (Hugging Face's Image made from paths): each file that lies under
    the Parquet file's folder is copied into the blob after the batch's bytes, and the row made to point at it
    (`present`, `starts`, `sizes` updated in place). Returns the bytes written by then, and why each other row
    naming a file was not read."""
    unread: dict[int, str] = {}
    if named is None:
        return written, unread
    for i in np.flatnonzero(~present).tolist():
        path = named[i].as_py()
        if not path:
            continue
        found = _named_file(path, source)
        if isinstance(found, str):
            unread[i] = found
            continue
        out.write(found)
        present[i], starts[i], sizes[i] = True, written, len(found)
        written += len(found)
    return written, unread


def _named_file(path: str, source: str) -> bytes | str:
    """The bytes of the image file a row names, or why it is not read: only files under the Parquet file's own
    folder (named relative to it, or absolute inside it) are, never through '..', nor for a remote file."""
    if is_remote(source):
        return f"no image bytes (the row names a file, {path!r}: a remote Parquet file's rows must hold their " \
               f"images; {EMBED_HINT})"
    root = Path(source).resolve().parent
    named = Path(path)
    target = (named if named.is_absolute() else root / named).resolve()
    if ".." in named.parts or root not in target.parents:
        return f"no image bytes, and the file the row names, {path!r}, is not under the Parquet file's folder " \
               f"{root} (only files there are read; {EMBED_HINT})"
    try:
        with open(target, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > MAX_SAMPLE_BYTES:
                return f"the file the row names, {path!r}: {too_large(size)}"
            return handle.read(size)
    except OSError as error:
        return f"no image bytes, and the file the row names, {path!r}, cannot be read ({error.strerror or error})"


def _row_refusal(present: bool, size: int, labelled: bool, label: int) -> str:
    if not present:
        return "no image (null)"
    if size == 0:
        return "an empty image (0 bytes)"
    if not labelled:
        return "no label (null)"
    return f"label {label} is negative: no class (-1 marks an unlabelled row)"


def _image_values(column: Any) -> tuple[Any, Any]:
    """(the image bytes as one large_binary array, the struct's `path` field or None); a null struct is a null
    image (`flatten` carries the struct's nulls into its fields)."""
    pa = _arrow()
    named = None
    if pa.types.is_struct(column.type):
        fields = column.flatten()
        images = fields[column.type.get_field_index("bytes")]
        at = column.type.get_field_index("path")
        named = fields[at] if at >= 0 else None
    else:
        images = column
    return images.cast(pa.large_binary()), named


def _label_values(column: Any, source: str) -> tuple[np.ndarray, np.ndarray]:
    """(labels as int64, whether each is there)."""
    pa = _arrow()
    labelled = column.is_valid().to_numpy(zero_copy_only=False)
    try:
        labels = column.fill_null(0).cast(pa.int64()).to_numpy(zero_copy_only=False)
    except pa.ArrowInvalid:
        raise ValueError(f"{source}: the label column holds integers beyond int64, no class indices") from None
    return labels, labelled


# ---- reading the formats ----------------------------------------------------------------------------------------

@contextmanager
def _open_parquet(file: str, source: str) -> Iterator[_Opened]:
    """A Parquet file whose frame and claims have been checked, streamed a batch of rows at a time."""
    pa = _arrow()
    size = _check_parquet_frame(file, source)
    try:
        handle = pa.parquet.ParquetFile(file, pre_buffer=False, buffer_size=READ_BUFFER_BYTES)
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"{source}: not a readable Parquet file ({object_store.describe(error)})") from None
    with closing(handle):
        def batches(names: list[str]) -> Iterator[Any]:
            _check_claims(handle.metadata, source, size, names)
            return _guarded(_bounded_batches(handle, file, names), source)
        yield _Opened(handle.schema_arrow, batches, MAX_EXPANSION * size)


def _bounded_batches(handle: Any, file: str, names: list[str]) -> Iterator[Any]:
    """Each row group's batches, of rows few enough that their decoded values stay within BATCH_BYTES."""
    for group in range(handle.metadata.num_row_groups):
        rows = _batch_rows(handle.metadata.row_group(group), file, names)
        yield from handle.iter_batches(batch_size=rows, row_groups=[group], columns=names, use_threads=False)


def _batch_rows(group: Any, file: str, names: list[str]) -> int:
    """BATCH_ROWS, or fewer where a read column's dictionary holds values so long that a batch of rows repeating
    the longest would pass BATCH_BYTES (its page's size, as its header says, bounds every value in it)."""
    longest = 0
    for column_id in range(group.num_columns):
        chunk = group.column(column_id)
        if chunk.has_dictionary_page and chunk.path_in_schema.split(".", 1)[0] in names:
            page = _dictionary_page_size(file, chunk.dictionary_page_offset)
            longest = max(longest, chunk.total_uncompressed_size if page is None else page)
    return max(1, min(BATCH_ROWS, BATCH_BYTES // longest)) if longest else BATCH_ROWS


def _dictionary_page_size(file: str, offset: int) -> int | None:
    """The uncompressed size a dictionary page's header gives (Thrift's compact protocol: its fields 1, the page
    type, and 2, that size, both i32 as zigzag varints); None where the header is not that."""
    with open(file, "rb") as handle:
        handle.seek(offset)
        header = handle.read(32)
    at, field = 0, 0
    while at < len(header) and field < 2:
        kind, at = header[at], at + 1
        if kind & 0x0F != 5 or kind >> 4 == 0:  # not a short-form i32 field: not the header expected
            return None
        field += kind >> 4
        value = shift = 0
        while at < len(header) and header[at] & 0x80:
            value, shift, at = value | (header[at] & 0x7F) << shift, shift + 7, at + 1
        if at >= len(header):
            return None
        value, at = value | header[at] << shift, at + 1
        if field == 2:
            size = (value >> 1) ^ -(value & 1)
            return size if size >= 0 else None
    return None


def _check_parquet_frame(file: str, source: str) -> int:
    """The file's size, once its first and last bytes say Parquet and its footer claims no more than it holds."""
    with open(file, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        head = handle.read(4)
        handle.seek(max(0, size - 8))
        tail = handle.read(8)
    if ENCRYPTED_MAGIC in (head, tail[4:]):
        raise ValueError(f"{source}: an encrypted Parquet file (not read)")
    if size < 12 or head != PARQUET_MAGIC or tail[4:] != PARQUET_MAGIC:
        raise ValueError(f"{source}: not a Parquet file (expected one that begins and ends with PAR1)")
    footer = int.from_bytes(tail[:4], "little")
    if footer > MAX_FOOTER_BYTES:
        raise ValueError(f"{source}: its footer claims {footer} bytes of metadata, more than the {MAX_FOOTER_BYTES} "
                         f"read (damaged?)")
    if footer + 12 > size:
        raise ValueError(f"{source}: its footer claims {footer} bytes, more than the file holds (cut short?)")
    return size


def _check_claims(metadata: Any, source: str, size: int, names: list[str]) -> None:
    """Row counts that add up, and the chunks of the columns read lying inside the file without claiming to expand
    past MAX_EXPANSION: checked before pyarrow sizes a buffer by them."""
    if not 0 <= metadata.num_rows <= MAX_ROWS_PER_FILE:
        raise ValueError(f"{source}: claims {metadata.num_rows} rows (damaged?)")
    counted = 0
    for group_id in range(metadata.num_row_groups):
        group = metadata.row_group(group_id)
        if group.num_rows < 0:
            raise ValueError(f"{source}: row group {group_id} claims {group.num_rows} rows (damaged)")
        counted += group.num_rows
        for column_id in range(group.num_columns):
            chunk = group.column(column_id)
            if chunk.path_in_schema.split(".", 1)[0] in names:
                _check_chunk(chunk, f"{source}: row group {group_id}'s column {chunk.path_in_schema}", size)
    if counted != metadata.num_rows:
        raise ValueError(f"{source}: its row groups hold {counted} rows, its footer says {metadata.num_rows} (damaged)")


def _check_chunk(chunk: Any, what: str, size: int) -> None:
    offsets = [o for o in (chunk.dictionary_page_offset, chunk.data_page_offset) if o is not None]
    start, stored, claimed = min(offsets, default=-1), chunk.total_compressed_size, chunk.total_uncompressed_size
    if start < 0 or stored < 0 or start + stored > size:
        raise ValueError(f"{what} claims {stored} bytes at byte {start}, outside the file's {size} (damaged)")
    if claimed > MAX_EXPANSION * stored + EXPANSION_SLACK:
        raise ValueError(f"{what} claims to expand from {stored} stored bytes to {claimed}, more than {MAX_EXPANSION} "
                         f"times: damaged, or a decompression bomb")


@contextmanager
def _open_arrow(file: str, source: str) -> Iterator[_Opened]:
    """An Arrow stream (datasets' save_to_disk writes these) or Arrow file, memory-mapped: its batches are read in
    place, so no claim in it sizes an allocation; the IPC file format is taken too."""
    pa = _arrow()
    try:
        mapped = pa.memory_map(file)
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"{source}: cannot be read ({object_store.describe(error)})") from None
    with closing(mapped):
        try:
            is_file = mapped.read(len(ARROW_FILE_MAGIC)) == ARROW_FILE_MAGIC
            mapped.seek(0)
            reader = pa.ipc.open_file(mapped) if is_file else pa.ipc.open_stream(mapped)
        except (pa.ArrowException, OSError) as error:
            raise ValueError(f"{source}: not an Arrow stream as datasets' save_to_disk writes "
                             f"({object_store.describe(error)})") from None

        def batches(names: list[str]) -> Iterator[Any]:
            every = (reader.get_batch(i) for i in range(reader.num_record_batches)) if is_file else iter(reader)
            return _guarded((batch.select(names) for batch in every), source)
        yield _Opened(reader.schema, batches, MAX_EXPANSION * max(mapped.size(), 1))


def _guarded(batches: Iterator[Any], source: str) -> Iterator[Any]:
    """Batches, a reading error (damage past the footer, a page cut short) becoming a ValueError naming the file."""
    pa = _arrow()
    try:
        yield from batches
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"{source}: damaged, cannot be read past its start ({object_store.describe(error)})") from None


# ---- columns and class names ------------------------------------------------------------------------------------

def _holds_images(kind: Any) -> bool:
    """Binary, or a struct with a binary `bytes` field (Hugging Face's Image)."""
    pa = _arrow()
    if pa.types.is_struct(kind):
        at = kind.get_field_index("bytes")
        return at >= 0 and _holds_images(kind.field(at).type) and not pa.types.is_struct(kind.field(at).type)
    return bool(pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
                or (hasattr(pa.types, "is_binary_view") and pa.types.is_binary_view(kind)))


def _image_column(schema: Any, wanted: str | None, source: str) -> str:
    found = {field.name: field.type for field in schema}
    if wanted is not None:
        if wanted not in found or not _holds_images(found[wanted]):
            raise ValueError(f"{source}: image_column={wanted!r}, but "
                             + (f"that column holds {found[wanted]}" if wanted in found else "no column has that name")
                             + f" (expected image bytes: binary, or a struct with a binary 'bytes' field; its columns: "
                               f"{_listed(found)})")
        return wanted
    named = next((name for name in IMAGE_COLUMNS if name in found and _holds_images(found[name])), None)
    candidates = [name for name, kind in found.items() if _holds_images(kind)]
    if named is None and len(candidates) != 1:
        raise ValueError(f"{source}: no image column (expected a column 'image' of binary or struct<bytes, path>, "
                         f"as Hugging Face's Image; give --image-column to name another; its columns: "
                         f"{_listed(found)})")
    return named or candidates[0]


def _label_column(schema: Any, wanted: str | None, source: str) -> str:
    pa = _arrow()
    found = {field.name: field.type for field in schema}
    name = wanted or next((n for n in LABEL_COLUMNS if n in found), None)
    if name is None or name not in found:
        asked = f"label_column={wanted!r}, but no column has that name" if wanted else "no label column"
        raise ValueError(f"{source}: {asked} (expected integer class indices in a column 'label' or 'labels'"
                         + ("" if wanted else ", or --label-column naming another")
                         + f"; its columns: {_listed(found)})")
    if not pa.types.is_integer(found[name]):
        raise ValueError(f"{source}: the label column {name!r} holds {found[name]} (expected integer class indices, "
                         f"as Hugging Face's ClassLabel)")
    return name


def _listed(found: dict[str, Any]) -> str:
    shown = [f"{name} ({kind})" for name, kind in list(found.items())[:20]]
    return ", ".join(shown) + (f" and {len(found) - 20} more" if len(found) > 20 else "") if shown else "none"


def _class_names(schema: Any, label: str, source: str) -> tuple[str, ...] | None:
    """The label column's ClassLabel names from the schema's Hugging Face metadata; None without them."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if raw is None:
        return None
    if len(raw) > MAX_METADATA_BYTES:
        raise ValueError(f"{source}: its Hugging Face metadata holds {len(raw)} bytes, more than the "
                         f"{MAX_METADATA_BYTES} read (damaged?)")
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{source}: its Hugging Face metadata is not JSON ({error})") from None
    info = meta.get("info") if isinstance(meta, dict) else None
    return _label_names(info.get("features") if isinstance(info, dict) else None, label, source)


def _saved_info_names(source: str, label: str) -> tuple[str, ...] | None:
    """The ClassLabel names of dataset_info.json beside a `save_to_disk` file (older datasets kept them there
    only)."""
    info = Path(os.path.dirname(source)) / SAVED_INFO
    return _label_names(_small_json(info).get("features"), label, str(info)) if info.is_file() else None


def _label_names(features: Any, label: str, source: str) -> tuple[str, ...] | None:
    feature = features.get(label) if isinstance(features, dict) else None
    if not (isinstance(feature, dict) and feature.get("_type") == "ClassLabel" and "names" in feature):
        return None
    names = feature["names"]
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError(f"{source}: the ClassLabel of {label!r} does not name its classes as a list of strings")
    if len(set(names)) != len(names):
        raise ValueError(f"{source}: the ClassLabel of {label!r} names a class twice")
    return tuple(names)

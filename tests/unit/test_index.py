"""The packed index: cached while the tree is unchanged, rescanned when it changes, one copy shared by processes."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from stoker.common.procs import CONTEXT
from stoker.data import index as stoker_index
from stoker.data.formats.folders import scan_image_folder, split_validation
from stoker.data.index import PackedIndex, load_image_folder
from stoker.data.sources import split_source

AN_HOUR_AGO = 3600


def make_tree(root, per_class: int = 5) -> None:
    for label in ("ant", "bee", "cow"):
        (root / label / "sub").mkdir(parents=True)
        for i in range(per_class):
            (root / label / f"{i}.jpg").write_bytes(f"{label} {i}".encode())
        (root / label / "sub" / "deep.png").write_bytes(label.encode())


def settle(root) -> None:
    """Date every folder an hour back: a folder changed just before its listing is never trusted from the cache
    (a change in the same timestamp tick would go unseen), and the tests must not wait for the clock."""
    stamp = os.stat(root).st_mtime - AN_HOUR_AGO
    for folder, _, _ in os.walk(root):
        os.utime(folder, (stamp, stamp))


def test_index_matches_the_scan_names_labels_and_bytes(tmp_path):
    make_tree(tmp_path / "data")
    index = load_image_folder(tmp_path / "data", cache=tmp_path / "cache")
    scan = scan_image_folder(tmp_path / "data")
    assert list(index.paths) == list(scan.paths) and index.labels.tolist() == scan.labels.tolist()
    assert index.classes == scan.classes
    assert index.read(3) == open(scan.paths[3], "rb").read()


def test_unchanged_tree_comes_from_the_cache(tmp_path):
    make_tree(tmp_path / "data")
    settle(tmp_path / "data")
    first = load_image_folder(tmp_path / "data", cache=tmp_path / "cache")
    second = load_image_folder(tmp_path / "data", cache=tmp_path / "cache")
    assert second.folder == first.folder  # a rescan writes a new entry


def test_a_tree_changed_just_before_the_scan_is_not_trusted(tmp_path):
    make_tree(tmp_path / "data")
    first = load_image_folder(tmp_path / "data", cache=tmp_path / "cache")
    assert load_image_folder(tmp_path / "data", cache=tmp_path / "cache").folder != first.folder


def test_changed_tree_is_rescanned(tmp_path):
    root = tmp_path / "data"
    make_tree(root)
    settle(root)
    before = load_image_folder(root, cache=tmp_path / "cache")
    (root / "bee" / "sub" / "new.jpg").write_bytes(b"new")
    (root / "cow" / "0.jpg").unlink()
    settle(root)  # other times than recorded, still old: only the comparison of times can see the change
    after = load_image_folder(root, cache=tmp_path / "cache")
    assert len(after) == len(before)
    assert any(p.endswith("bee/sub/new.jpg") for p in after.paths)
    assert not any(p.endswith("cow/0.jpg") for p in after.paths)


def test_a_class_folder_added_after_a_run_is_seen_by_the_next(tmp_path):
    root = tmp_path / "data"
    make_tree(root)
    settle(root)
    before = load_image_folder(root, cache=tmp_path / "cache")
    shutil.copytree(root / "cow", root / "zebra")  # of the folders the first run read, only the root's time moves
    after = load_image_folder(root, cache=tmp_path / "cache")
    assert after.classes == (*before.classes, "zebra")
    assert len(after) == len(before) + sum(1 for p in (root / "cow").rglob("*") if p.is_file())


def _child_reads(index: PackedIndex, sample: int, answers) -> None:
    with open("/proc/self/maps") as handle:
        mapped = handle.read()
    answers.send((index.paths[sample], hashlib.sha256(index.read(sample)).hexdigest(),
                  str(index.folder / "names.npy") in mapped, int(index.labels[sample])))


def test_producers_map_one_packed_index_instead_of_receiving_the_paths(tmp_path):
    root = tmp_path / "data"
    make_tree(root, per_class=400)
    index, _ = split_source(load_image_folder(root, cache=tmp_path / "cache"), 0.25, seed=3)
    assert len(pickle.dumps(index)) < 500  # a folder name, whatever the number of files (1203 here)
    receive, send = CONTEXT.Pipe(duplex=False)
    child = CONTEXT.Process(target=_child_reads, args=(index, 700, send))
    child.start()
    path, digest, mapped, label = receive.recv()
    child.join(timeout=30)
    assert mapped  # the child maps the entry's file: nothing of the names travelled in the pickle
    assert path == index.paths[700] and label == index.labels[700]
    assert digest == hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_packed_split_holds_out_the_same_files_as_the_in_memory_split(tmp_path):
    root = tmp_path / "data"
    make_tree(root, per_class=20)
    train, val = split_source(load_image_folder(root, cache=tmp_path / "cache"), 0.2, seed=7)
    expected_train, expected_val = split_validation(scan_image_folder(root), 0.2, seed=7)
    assert list(val.paths) == list(expected_val.paths) and list(train.paths) == list(expected_train.paths)
    assert np.array_equal(train.labels, expected_train.labels)


def test_a_tree_with_a_broken_link_is_listed_again_every_run(tmp_path):
    """Creating the link's target changes no directory's time: only a new listing can see the file appear."""
    root = tmp_path / "data"
    make_tree(root)
    os.symlink(root / "ant" / "later.jpg", root / "ant" / "link.jpg")
    settle(root)
    times = {folder: os.stat(folder).st_mtime_ns for folder, _, _ in os.walk(root)}
    assert len(load_image_folder(root, cache=tmp_path / "cache")) == 18
    (root / "ant" / "sub" / "deep.png").rename(root / "ant" / "later.jpg")
    for folder, mtime in times.items():  # every directory as recorded: only the link's target differs
        os.utime(folder, ns=(mtime, mtime))
    assert len(load_image_folder(root, cache=tmp_path / "cache")) == 19  # later.jpg, and link.jpg now resolves


def test_a_superseded_entry_is_removed_only_once_no_live_process_maps_it(tmp_path, monkeypatch):
    monkeypatch.setattr(stoker_index, "STALE_ENTRY_S", -1)  # superseded is stale at once (it is a day, normally)
    make_tree(tmp_path / "data")  # changed just now: every load lists it again and supersedes the entry before
    mapped = load_image_folder(tmp_path / "data", cache=tmp_path / "cache")  # a long run still maps this one
    dropped = load_image_folder(tmp_path / "data", cache=tmp_path / "cache")
    dropped_folder = dropped.folder
    del dropped
    gc.collect()
    load_image_folder(tmp_path / "data", cache=tmp_path / "cache")
    assert mapped.folder.exists() and mapped.read(0) == b"ant 0"
    assert not dropped_folder.exists()


# ---- the cache checks what it hands out, and is not needed to run -----------------------------

def cached_entry(tmp_path) -> tuple:
    make_tree(tmp_path / "data")
    settle(tmp_path / "data")
    index = load_image_folder(tmp_path / "data", cache=tmp_path / "cache")
    return index.folder, scan_image_folder(tmp_path / "data")


def flip_one_bit_in_every_label(path) -> None:
    """The labels' int64 values are the file's last bytes: flip the lowest bit of each (0<->1, 2<->3)."""
    labels = np.load(path)
    data = bytearray(path.read_bytes())
    start = len(data) - labels.nbytes
    for i in range(len(labels)):
        data[start + 8 * i] ^= 1
    path.write_bytes(bytes(data))


def test_a_flipped_bit_in_cached_labels_is_caught_and_the_entry_rebuilt_with_one_warning(tmp_path, caplog):
    entry, scan = cached_entry(tmp_path)
    flip_one_bit_in_every_label(entry / "labels.npy")
    assert np.load(entry / "labels.npy").tolist() != scan.labels.tolist()
    with caplog.at_level("WARNING", logger="stoker.data.index"):
        again = load_image_folder(tmp_path / "data", cache=tmp_path / "cache")
    assert again.labels.tolist() == scan.labels.tolist() and again.folder != entry
    assert [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()] != []
    assert len(caplog.records) == 1
    assert load_image_folder(tmp_path / "data", cache=tmp_path / "cache").folder == again.folder  # rebuilt once


def test_a_cut_or_empty_cached_array_is_rebuilt_not_a_crash(tmp_path):
    """What a power cut after an unsynced write leaves: every later run crashed until the cache was deleted."""
    entry, scan = cached_entry(tmp_path)
    (entry / "names.npy").write_bytes((entry / "names.npy").read_bytes()[:40])
    (entry / "labels.npy").write_bytes(b"")
    again = load_image_folder(tmp_path / "data", cache=tmp_path / "cache")
    assert list(again.paths) == list(scan.paths) and again.labels.tolist() == scan.labels.tolist()


def test_a_flipped_bit_in_a_cached_split_is_caught(tmp_path):
    make_tree(tmp_path / "data", per_class=20)
    settle(tmp_path / "data")
    train, val = split_source(load_image_folder(tmp_path / "data", cache=tmp_path / "cache"), 0.2, seed=7)
    expected = train.labels.tolist()
    labels_file = train.folder / f"{train.part}.labels.npy"
    del train, val
    flip_one_bit_in_every_label(labels_file)
    train, _ = split_source(load_image_folder(tmp_path / "data", cache=tmp_path / "cache"), 0.2, seed=7)
    assert train.labels.tolist() == expected


@pytest.mark.parametrize("forge", ["another folder's pointer", "no checksums", "an entry outside the cache"])
def test_a_pointer_that_does_not_name_its_own_checked_entry_is_not_trusted(tmp_path, forge):
    for name in ("data", "other"):
        make_tree(tmp_path / name, per_class=2 if name == "other" else 5)
        settle(tmp_path / name)
    cache = tmp_path / "cache"
    mine, other = (load_image_folder(tmp_path / name, cache=cache) for name in ("data", "other"))
    pointer = cache / f"{mine.folder.name.rsplit('-', 1)[0]}.json"
    theirs = json.loads((cache / f"{other.folder.name.rsplit('-', 1)[0]}.json").read_text())
    own = json.loads(pointer.read_text())
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep.txt").write_text("a folder the cache must never remove")
    if forge == "no checksums":  # and a damaged entry they would have caught
        flip_one_bit_in_every_label(mine.folder / "labels.npy")
    forged = {"another folder's pointer": theirs, "no checksums": {**own, "sha256": {}},
              "an entry outside the cache": {**own, "entry": "../elsewhere"}}[forge]
    del mine, other
    pointer.write_text(json.dumps(forged))
    again = load_image_folder(tmp_path / "data", cache=cache)
    scan = scan_image_folder(tmp_path / "data")
    assert list(again.paths) == list(scan.paths) and again.labels.tolist() == scan.labels.tolist()
    assert (tmp_path / "elsewhere" / "keep.txt").exists()


def test_the_pointer_is_written_after_the_entry_is_on_the_disk(tmp_path, monkeypatch):
    """A power cut must leave the old pointer or a whole entry: every file of the entry and its folder are
    fsynced before the pointer's rename."""
    events, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", str(b))) or real_replace(a, b))
    make_tree(tmp_path / "data")
    index = load_image_folder(tmp_path / "data", cache=tmp_path / "cache")
    pointer = next(i for i, (kind, path) in enumerate(events) if kind == "replace" and path.endswith(".json")
                   and os.path.dirname(path) == str(tmp_path / "cache"))
    synced = {os.path.basename(path) for kind, path in events[:pointer] if kind == "fsync"}
    assert {"names.npy", "offsets.npy", "labels.npy", "meta.json", "skipped.json"} <= synced
    assert any(kind == "fsync" and path == str(tmp_path / "cache") for kind, path in events[pointer:])
    assert index.labels.tolist() == scan_image_folder(tmp_path / "data").labels.tolist()


def _child_labels(index: PackedIndex, answers) -> None:
    answers.send((list(index.paths), index.labels.tolist(), index.read(2)))


@pytest.mark.parametrize("where", ["under a file", "/sys"])
def test_an_unwritable_cache_runs_from_memory_with_one_warning(tmp_path, caplog, where):
    (tmp_path / "a-file").write_bytes(b"")
    cache = tmp_path / "a-file" / "cache" if where == "under a file" else Path("/sys/stoker-index-cache")
    make_tree(tmp_path / "data", per_class=20)
    scan = scan_image_folder(tmp_path / "data")
    with caplog.at_level("WARNING", logger="stoker.data.index"):
        index = load_image_folder(tmp_path / "data", cache=cache)
        train, val = split_source(index, 0.2, seed=7)
    assert index.labels.tolist() == scan.labels.tolist() and list(index.paths) == list(scan.paths)
    assert len(caplog.records) <= 1 and all("in memory" in r.getMessage() for r in caplog.records)
    receive, send = CONTEXT.Pipe(duplex=False)
    child = CONTEXT.Process(target=_child_labels, args=(train, send))  # a producer gets the index whole
    child.start()
    paths, labels, data = receive.recv()
    child.join(timeout=30)
    assert paths == list(train.paths) and labels == train.labels.tolist() and data == train.read(2)
    assert len(train) + len(val) == len(scan)

"""The packed index: cached while the tree is unchanged, rescanned when it changes, one copy shared by processes."""

from __future__ import annotations

import gc
import hashlib
import os
import pickle

import numpy as np

from stoker.common.procs import CONTEXT
from stoker.data import index as stoker_index
from stoker.data.dataset import scan_image_folder, split_validation
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

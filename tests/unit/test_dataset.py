"""The ImageFolder scan never leaves its root and always ends."""

from __future__ import annotations

import os

import pytest

from stoker.data.formats.folders import scan_image_folder, split_validation
from tests.helpers.trees import make_unreadable_folder


def make_tree(root):
    for label in ("cat", "dog"):
        (root / label / "nested").mkdir(parents=True)
        for i in range(3):
            (root / label / f"{i}.jpg").write_bytes(b"x")
        (root / label / "nested" / "deep.png").write_bytes(b"x")
        (root / label / "notes.txt").write_text("not an image")


def test_scan_finds_images_with_labels(tmp_path):
    make_tree(tmp_path)
    index = scan_image_folder(tmp_path)
    assert index.classes == ("cat", "dog")
    assert len(index) == 8 and list(index.labels).count(1) == 4


def test_symlinks_leaving_the_root_and_loops_are_refused(tmp_path):
    root = tmp_path / "data"
    make_tree(root)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.jpg").write_bytes(b"x")
    os.symlink(outside / "secret.jpg", root / "cat" / "escape.jpg")
    os.symlink(outside, root / "cat" / "escape_dir")
    os.symlink(root / "cat", root / "cat" / "nested" / "loop")
    os.symlink(root / "dog" / "self.jpg", root / "dog" / "self.jpg")
    index = scan_image_folder(root)
    reasons = {os.path.basename(s.path): s.reason for s in index.skipped}
    assert "leaves the data root" in reasons["escape.jpg"]
    assert "leaves the data root" in reasons["escape_dir"]
    assert "loop" in reasons["loop"] and "loop" in reasons["self.jpg"]
    assert not any("secret" in p for p in index.paths)
    assert len(index) == 8


def test_a_link_into_another_class_or_to_the_root_is_refused_not_labelled_as_its_folder(tmp_path):
    root = tmp_path / "data"
    make_tree(root)
    os.symlink("../dog", root / "cat" / "more")  # dog's images would all train as cat
    os.symlink("..", root / "cat" / "up")  # and every class's
    os.symlink("0.jpg", root / "dog" / "nested" / "again")  # a link within its own class is its own business
    (root / "shared").mkdir()
    (root / "shared" / "x.jpg").write_bytes(b"x")
    index = scan_image_folder(root, classes=("cat", "dog"))
    reasons = {os.path.basename(s.path): s.reason for s in index.skipped}
    assert "another class's folder" in reasons["more"] and "data root" in reasons["up"]
    by_class = {name: sorted(os.path.relpath(p, root) for p, label in zip(index.paths, index.labels)
                             if label == number) for number, name in enumerate(index.classes)}
    assert by_class["cat"] == ["cat/0.jpg", "cat/1.jpg", "cat/2.jpg", "cat/nested/deep.png"]
    assert len(by_class["dog"]) == 4 and all(p.startswith("dog/") for p in by_class["dog"])


def test_empty_root_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no class sub-folders"):
        scan_image_folder(tmp_path)


def test_validation_split_is_stratified_and_disjoint(tmp_path):
    make_tree(tmp_path)
    train, val = split_validation(scan_image_folder(tmp_path), 0.25, seed=0)
    assert set(train.paths).isdisjoint(val.paths)
    assert sorted(val.labels.tolist()) == [0, 1]


def test_every_refused_entry_is_listed_with_its_reason(tmp_path):
    root = tmp_path / "data"
    make_tree(root)
    outside = tmp_path / "outside"
    (outside / "cls").mkdir(parents=True)
    os.symlink(outside / "cls", root / "escaping_class")  # a class folder that is really elsewhere
    too_deep = make_unreadable_folder(root / "dog" / "nested")
    index = scan_image_folder(root)
    reasons = {s.path: s.reason for s in index.skipped}
    assert "leaves the data root" in reasons[os.path.join(os.path.realpath(root), "escaping_class")]
    unreadable = [path for path, reason in reasons.items() if reason.startswith("unreadable folder")]
    assert len(unreadable) == 1 and too_deep.startswith(os.path.dirname(unreadable[0]))
    assert index.classes == ("cat", "dog") and len(index) == 8


def _images(folder, count=2):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"{i}.jpg").write_bytes(b"x")


def test_an_empty_class_folder_is_an_error_naming_it(tmp_path):
    make_tree(tmp_path)
    (tmp_path / "empty_one").mkdir()  # torchvision's ImageFolder refuses it too; it would be an 11th output
    with pytest.raises(ValueError, match="class folder.*without any image file.*empty_one"):
        scan_image_folder(tmp_path)


def test_a_validation_class_the_training_data_lacks_is_listed_file_by_file(tmp_path, caplog):
    from stoker.data.sources import log_refused

    make_tree(tmp_path)
    _images(tmp_path / "dgo", 5)  # a typo of dog
    index = scan_image_folder(tmp_path, classes=("cat", "dog"))
    refused = [s for s in index.skipped if "'dgo' is not a class of the training data" in s.reason]
    assert sorted(os.path.basename(s.path) for s in refused) == [f"{i}.jpg" for i in range(5)]
    assert len(index) == 8
    with caplog.at_level("WARNING"):
        log_refused(index.skipped)
    warned = [r.getMessage() for r in caplog.records if "dgo" in r.getMessage()]
    assert len(warned) == 4 and "2 more files" in warned[-1]  # three files shown, then how many more


def test_the_parent_of_train_and_val_is_refused_saying_what_was_meant(tmp_path):
    for split in ("train", "val"):
        make_tree(tmp_path / split)
    with pytest.raises(ValueError, match=f"--data {tmp_path / 'train'} --val {tmp_path / 'val'}"):
        scan_image_folder(tmp_path)


def test_class_folders_that_hold_the_same_class_folders_are_refused(tmp_path):
    for part in ("photos_2019", "photos_2020"):
        for label in ("cat", "dog"):
            _images(tmp_path / part / label)
    with pytest.raises(ValueError, match="look like datasets"):
        scan_image_folder(tmp_path)

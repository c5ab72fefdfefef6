"""Dataset index: an ImageFolder scan (one sub-folder per class) that always ends and never leaves its root."""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm"})
# Folder names of a dataset's splits: class folders named so mean --data names the folder above the splits.
SPLIT_NAMES = frozenset({"train", "training", "val", "valid", "validation", "test", "testing", "eval"})


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str

    def as_json(self) -> dict[str, str]:
        return {"path": self.path, "reason": self.reason}


@dataclass(frozen=True)
class ImageIndex:
    """Files and integer labels; position in `paths` is the sample id."""

    paths: tuple[str, ...]
    labels: np.ndarray
    classes: tuple[str, ...]
    skipped: tuple[Skipped, ...] = field(default=())

    def __len__(self) -> int:
        return len(self.paths)

    def subset(self, ids: np.ndarray) -> ImageIndex:
        return ImageIndex(tuple(self.paths[i] for i in ids), self.labels[ids], self.classes, self.skipped)


def scan_image_folder(root: Path, classes: tuple[str, ...] | None = None) -> ImageIndex:
    """Index `root/<class>/**/<image>`; symlinks leaving the root, symlink loops and unreadable folders are
    refused and listed in `skipped`."""
    listing = list_image_folder(root, classes)
    return ImageIndex(tuple(listing.paths), np.asarray(listing.labels, dtype=np.int64), listing.classes,
                      tuple(listing.skipped))


@dataclass
class Listing:
    """What one walk of an ImageFolder found: file names relative to `base` (the root's real path and a
    separator), labels, refused entries, and the real directories read (for the index cache)."""

    base: str
    classes: tuple[str, ...] = ()
    names: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    folders: list[str] = field(default_factory=list)
    # Per class folder: images directly in it, and the names of its sub-folders (to tell a misplaced root).
    top_images: dict[int, int] = field(default_factory=dict)
    top_subfolders: dict[int, tuple[str, ...]] = field(default_factory=dict)

    @property
    def paths(self) -> list[str]:
        return [self.base + name for name in self.names]


def list_image_folder(root: Path, classes: tuple[str, ...] | None = None) -> Listing:
    """One `os.scandir` per directory; `realpath` and `stat` only for entries that are symlinks (a plain tree
    cannot loop or leave its root, and the directory entry already says file or folder)."""
    root_real = os.path.realpath(root)
    listing = Listing(root_real + os.sep)
    try:
        top = sorted(os.scandir(root_real), key=lambda e: e.name)
    except OSError as error:
        raise ValueError(f"data={str(root)!r}: cannot list the folder ({error.strerror})") from None
    listing.folders.append(root_real)  # a class folder added or removed changes the root's time, not theirs
    found = {}
    for entry in top:
        kind, real = _classify(entry, root_real, root_real)
        if kind == "dir":
            found[entry.name] = real
        elif kind not in ("image", ""):
            listing.skipped.append(Skipped(entry.path, kind))
    class_names = classes or tuple(found)
    if not class_names:
        raise ValueError(f"data={str(root)!r}: no class sub-folders (expected ImageFolder layout root/<class>/<image>)")
    if classes is None:
        _check_not_a_parent_of_splits(root, class_names)
    listing.classes = class_names
    visited: set[str] = set()
    owners = {found[name]: label for label, name in enumerate(class_names) if name in found}
    for label, name in enumerate(class_names):
        if name in found:
            _walk_files(name, found[name], label, listing, visited, root_real, owners)
    if not listing.names:
        raise ValueError(f"data={str(root)!r}: no image files with extensions {sorted(IMAGE_EXTENSIONS)}")
    if classes is None:
        _check_class_folders(root, listing)
    _refuse_unknown_classes(found, class_names, listing, visited, root_real)
    return listing


def _check_not_a_parent_of_splits(root: Path, class_names: tuple[str, ...]) -> None:
    """Class folders named like splits (train/, val/): training "train vs val" is never what was meant."""
    if all(name.lower() in SPLIT_NAMES for name in class_names):
        named = {name.lower(): name for name in class_names}
        train = next((named[n] for n in ("train", "training") if n in named), class_names[0])
        val = next((named[n] for n in ("val", "valid", "validation") if n in named), None)
        meant = f"--data {root / train}" + (f" --val {root / val}" if val else "")
        raise ValueError(f"data={str(root)!r}: its class folders ({', '.join(class_names)}) are named like a "
                         f"dataset's splits; you probably meant {meant}")


def _check_class_folders(root: Path, listing: Listing) -> None:
    """Every class folder of the training data holds images (an empty one would be an output no image has, as
    torchvision's ImageFolder refuses too), and the classes are not datasets of their own (every class folder
    holding the same sub-folders and no image: the parent of several ImageFolders)."""
    counts = np.bincount(np.asarray(listing.labels, dtype=np.int64), minlength=len(listing.classes))
    refused_under = {s.path[len(listing.base):].split(os.sep, 1)[0] for s in listing.skipped}
    empty = [name for name, count in zip(listing.classes, counts) if count == 0 and name not in refused_under]
    if empty:
        folders = ", ".join(str(root / name) for name in empty)
        raise ValueError(f"data={str(root)!r}: class folder(s) without any image file ({folders}); remove them or "
                         f"add images (extensions {', '.join(sorted(IMAGE_EXTENSIONS))})")
    inner = set(listing.top_subfolders.values())
    if (len(listing.classes) > 1 and not any(listing.top_images.values()) and len(inner) == 1
            and len(shared := next(iter(inner))) > 1):
        raise ValueError(f"data={str(root)!r}: every class folder ({', '.join(listing.classes)}) holds the same "
                         f"sub-folders ({', '.join(shared)}) and no image of its own: these look like datasets, "
                         f"not classes; you probably meant --data {root / listing.classes[0]}")


def _refuse_unknown_classes(found: dict[str, str], class_names: tuple[str, ...], listing: Listing,
                            visited: set[str], root_real: str) -> None:
    """Validation folders of classes the training data does not have: each of their files is listed as refused
    (with the class in the reason), so a misspelt folder does not shrink the validation set unseen."""
    for name in sorted(set(found) - set(class_names)):
        extra = Listing(listing.base)
        _walk_files(name, found[name], -1, extra, visited, root_real)
        reason = f"class folder {name!r} is not a class of the training data"
        listing.skipped.extend(Skipped(path, reason) for path in extra.paths)
        listing.skipped.extend(extra.skipped)
        listing.folders.extend(extra.folders)


def _inside(path_real: str, root_real: str) -> bool:
    return path_real == root_real or path_real.startswith(root_real + os.sep)


def _walk_files(top: str, top_real: str, label: int, listing: Listing, visited: set[str], root_real: str,
                owners: dict[str, int] | None = None) -> None:
    """Depth-first, sorted, each real directory read once: the scan ends whatever the links. A folder's files
    come before its sub-folders'. Plain files and folders take no system call beyond the listing itself. `owners`
    (a class folder's real path -> its label): a link into another class's folder, or to the root, is refused,
    since its images would take this class's label."""
    pending = [(top, top_real)]
    while pending:
        relative, real = pending.pop()
        folder = listing.base + relative
        if real in visited:
            listing.skipped.append(Skipped(folder, "symlink loop: folder already visited"))
            continue
        visited.add(real)
        try:
            with os.scandir(folder) as listed:
                entries = list(listed)
        except OSError as error:
            listing.skipped.append(Skipped(folder, f"unreadable folder: {error.strerror}"))
            continue
        listing.folders.append(real)
        images, subfolders = _sort_entries(entries, real, root_real, listing.skipped)
        if owners:
            subfolders = _own_class_only(folder, real, subfolders, label, owners, root_real, listing.skipped)
        if relative == top:
            listing.top_images[label] = len(images)
            listing.top_subfolders[label] = tuple(sorted(name for name, _ in subfolders))
        prefix = relative + os.sep
        listing.names.extend([prefix + name for name in sorted(images)])
        listing.labels.extend([label] * len(images))
        pending.extend((prefix + name, target) for name, target in sorted(subfolders, reverse=True))


def _own_class_only(folder: str, folder_real: str, subfolders: list[tuple[str, str]], label: int,
                    owners: dict[str, int], root_real: str, skipped: list[Skipped]) -> list[tuple[str, str]]:
    """The sub-folders that lie in this class's own folder, or in no class folder: a plain sub-folder needs no
    look (its real path is under its parent's); a link's target is checked against each folder above it."""
    kept = []
    for name, real in subfolders:
        owner = label if real == os.path.join(folder_real, name) else _owner(real, owners, root_real)
        if owner is None or owner == label:
            kept.append((name, real))
        elif real == root_real:
            skipped.append(Skipped(os.path.join(folder, name), "symlink to the data root: every class's images "
                                   "would be labelled as this folder's class"))
        else:
            skipped.append(Skipped(os.path.join(folder, name), f"symlink into another class's folder ({real}): "
                                   "its images would be labelled as this folder's class"))
    return kept


def _owner(real: str, owners: dict[str, int], root_real: str) -> int | None:
    """The label of the class folder that holds `real`; -1 for the root itself; None for a folder of no class."""
    if real == root_real:
        return -1
    path = real
    while path != root_real and _inside(path, root_real):
        if path in owners:
            return owners[path]
        path = os.path.dirname(path)
    return None


def _sort_entries(entries: list[os.DirEntry], folder_real: str, root_real: str,
                  skipped: list[Skipped]) -> tuple[list[str], list[tuple[str, str]]]:
    """(image names, (folder name, real path)) of one listing; refused entries go to `skipped`."""
    images, subfolders = [], []
    for entry in entries:  # the hot loop of a million-file scan: plain files cost a string test, nothing more
        name = entry.name
        if entry.is_symlink():
            kind, real = _classify_link(entry, root_real)
        elif _is_plain_dir(entry):
            subfolders.append((name, os.path.join(folder_real, name)))
            continue
        else:
            if _is_image(name):
                images.append(name)
            continue
        if kind == "dir":
            subfolders.append((name, real))
        elif kind == "image":
            images.append(name)
        elif kind:
            skipped.append(Skipped(entry.path, kind))
    return images, subfolders


def _is_plain_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:  # the entry vanished between the listing and the question
        return False


def _classify(entry: os.DirEntry, folder_real: str, root_real: str) -> tuple[str, str]:
    """('dir', its real path), ('image', ''), ('', '') for an entry to ignore, or (why it is refused, '')."""
    if entry.is_symlink():
        return _classify_link(entry, root_real)
    if _is_plain_dir(entry):
        return "dir", os.path.join(folder_real, entry.name)
    return ("image" if _is_image(entry.name) else ""), ""


def _classify_link(entry: os.DirEntry, root_real: str) -> tuple[str, str]:
    real = os.path.realpath(entry.path)
    if not _inside(real, root_real):
        return "symlink leaves the data root", ""
    try:
        is_dir = stat.S_ISDIR(os.stat(entry.path).st_mode)
    except OSError as error:
        return ("symlink loop" if error.errno == errno.ELOOP else "broken symlink"), ""
    if is_dir:
        return "dir", real
    return ("image" if _is_image(entry.name) else ""), ""


def _is_image(name: str) -> bool:
    dot = name.rfind(".")  # os.path.splitext's rule (leading dots start no extension), without its cost
    if dot <= 0 or name[dot:].lower() not in IMAGE_EXTENSIONS:
        return False
    return name[0] != "." or dot >= len(name) - len(name.lstrip("."))


def split_validation(index: ImageIndex, fraction: float, seed: int) -> tuple[ImageIndex, ImageIndex | None]:
    """Hold out `fraction` of every class (at least one file) for validation, the same for a given seed."""
    if fraction == 0:
        return index, None
    kept, held = validation_ids(index.labels, len(index.classes), fraction, seed)
    return index.subset(kept), (index.subset(held) if len(held) else None)


def validation_ids(labels: np.ndarray, num_classes: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) sample ids, both sorted: `fraction` of every class with two or more samples."""
    rng = np.random.default_rng([seed, 0x5EED])
    order = np.argsort(labels, kind="stable")  # each class's members in ascending order, one pass for all classes
    bounds = np.searchsorted(labels[order], np.arange(num_classes + 1))
    val_ids = []
    for label in range(num_classes):
        members = order[bounds[label]:bounds[label + 1]]
        if len(members) < 2:
            continue
        count = max(1, int(round(len(members) * fraction)))
        val_ids.append(rng.permutation(members)[:count])
    held = np.sort(np.concatenate(val_ids)) if val_ids else np.zeros(0, dtype=np.int64)
    kept = np.ones(len(labels), dtype=bool)
    kept[held] = False  # not np.setdiff1d: its hashing took 3 s for ImageNet's 1.28M ids
    return np.flatnonzero(kept), held

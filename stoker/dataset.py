"""Dataset index: an ImageFolder scan (one sub-folder per class) that always ends and never leaves its root."""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm"})


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
    """What one walk of an ImageFolder found; `folders` are the real directories read, for the index cache."""

    classes: tuple[str, ...]
    paths: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    folders: list[str] = field(default_factory=list)


def list_image_folder(root: Path, classes: tuple[str, ...] | None = None) -> Listing:
    """One `os.scandir` per directory; `realpath` and `stat` only for entries that are symlinks (a plain tree
    cannot loop or leave its root, and the directory entry already says file or folder)."""
    root_real = os.path.realpath(root)
    listing = Listing(())
    try:
        top = sorted(os.scandir(root_real), key=lambda e: e.name)
    except OSError as error:
        raise ValueError(f"data={str(root)!r}: cannot list the folder ({error.strerror})") from None
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
    listing.classes = class_names
    visited: set[str] = set()
    for label, name in enumerate(class_names):
        if name in found:
            _walk_files(os.path.join(root_real, name), found[name], label, listing, visited, root_real)
    if not listing.paths:
        raise ValueError(f"data={str(root)!r}: no image files with extensions {sorted(IMAGE_EXTENSIONS)}")
    return listing


def _inside(path_real: str, root_real: str) -> bool:
    return path_real == root_real or path_real.startswith(root_real + os.sep)


def _walk_files(top: str, top_real: str, label: int, listing: Listing, visited: set[str], root_real: str) -> None:
    """Depth-first, sorted, each real directory read once: the scan ends whatever the links. A folder's files
    come before its sub-folders'."""
    pending = [(top, top_real)]
    while pending:
        folder, real = pending.pop()
        if real in visited:
            listing.skipped.append(Skipped(folder, "symlink loop: folder already visited"))
            continue
        visited.add(real)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name, reverse=True)
        except OSError as error:
            listing.skipped.append(Skipped(folder, f"unreadable folder: {error.strerror}"))
            continue
        listing.folders.append(real)
        files = []
        for entry in entries:
            kind, entry_real = _classify(entry, real, root_real)
            if kind == "dir":
                pending.append((entry.path, entry_real))
            elif kind == "image":
                files.append(entry.path)
            elif kind:
                listing.skipped.append(Skipped(entry.path, kind))
        files.reverse()
        listing.paths.extend(files)
        listing.labels.extend([label] * len(files))


def _classify(entry: os.DirEntry, folder_real: str, root_real: str) -> tuple[str, str]:
    """('dir', its real path), ('image', ''), ('', '') for an entry to ignore, or (why it is refused, '')."""
    if entry.is_symlink():
        return _classify_link(entry, root_real)
    try:
        if entry.is_dir(follow_symlinks=False):
            return "dir", os.path.join(folder_real, entry.name)
    except OSError:  # the entry vanished between the listing and the question
        return "", ""
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
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


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
    kept = np.setdiff1d(np.arange(len(labels)), held)
    return kept, held

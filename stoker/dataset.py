"""Dataset index: an ImageFolder scan (one sub-folder per class) that always ends and never leaves its root."""

from __future__ import annotations

import os
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
    """Index `root/<class>/**/<image>`; symlinks leaving the root and symlink loops are skipped and listed."""
    root_real = os.path.realpath(root)
    class_names = classes or tuple(sorted(e.name for e in os.scandir(root_real) if _is_dir_inside(e, root_real)))
    if not class_names:
        raise ValueError(f"data={str(root)!r}: no class sub-folders (expected ImageFolder layout root/<class>/<image>)")
    paths: list[str] = []
    labels: list[int] = []
    skipped: list[Skipped] = []
    for label, name in enumerate(class_names):
        class_dir = os.path.join(root_real, name)
        if not os.path.isdir(class_dir):
            continue
        for path in _walk_files(class_dir, root_real, skipped):
            paths.append(path)
            labels.append(label)
    if not paths:
        raise ValueError(f"data={str(root)!r}: no image files with extensions {sorted(IMAGE_EXTENSIONS)}")
    return ImageIndex(tuple(paths), np.asarray(labels, dtype=np.int64), class_names, tuple(skipped))


def _is_dir_inside(entry: os.DirEntry, root_real: str) -> bool:
    return entry.is_dir() and _inside(os.path.realpath(entry.path), root_real)


def _inside(path_real: str, root_real: str) -> bool:
    return path_real == root_real or path_real.startswith(root_real + os.sep)


def _walk_files(top: str, root_real: str, skipped: list[Skipped]) -> list[str]:
    """Depth-first, sorted, each real directory visited once: the scan ends whatever the links."""
    found: list[str] = []
    visited: set[tuple[int, int]] = set()
    pending = [top]
    while pending:
        folder = pending.pop()
        try:
            stat = os.stat(folder)
            entries = sorted(os.scandir(folder), key=lambda e: e.name, reverse=True)
        except OSError as error:
            skipped.append(Skipped(folder, f"unreadable folder: {error.strerror}"))
            continue
        if (stat.st_dev, stat.st_ino) in visited:
            skipped.append(Skipped(folder, "symlink loop: folder already visited"))
            continue
        visited.add((stat.st_dev, stat.st_ino))
        files = []
        for entry in entries:
            kind = _classify(entry, root_real)
            if kind == "dir":
                pending.append(entry.path)
            elif kind == "image":
                files.append(entry.path)
            elif kind:
                skipped.append(Skipped(entry.path, kind))
        found.extend(reversed(files))
    return found


def _classify(entry: os.DirEntry, root_real: str) -> str:
    """'dir', 'image', '' for a file to ignore, or why the entry is refused."""
    if not _inside(os.path.realpath(entry.path), root_real):
        return "symlink leaves the data root"
    try:
        if entry.is_dir():
            return "dir"
        is_image = os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS
        if is_image and not os.path.exists(entry.path):
            return "broken symlink"
    except OSError:
        return "symlink loop"
    return "image" if is_image else ""


def split_validation(index: ImageIndex, fraction: float, seed: int) -> tuple[ImageIndex, ImageIndex | None]:
    """Hold out `fraction` of every class (at least one file) for validation, the same for a given seed."""
    if fraction == 0:
        return index, None
    rng = np.random.default_rng([seed, 0x5EED])
    val_ids = []
    for label in range(len(index.classes)):
        members = np.flatnonzero(index.labels == label)
        if len(members) < 2:
            continue
        count = max(1, int(round(len(members) * fraction)))
        val_ids.append(rng.permutation(members)[:count])
    held = np.sort(np.concatenate(val_ids)) if val_ids else np.zeros(0, dtype=np.int64)
    kept = np.setdiff1d(np.arange(len(index)), held)
    return index.subset(kept), (index.subset(held) if len(held) else None)

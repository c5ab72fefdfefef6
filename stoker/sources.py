"""What `--data` / `--val` name (an ImageFolder or tar shards) and their packed index, from the cache when the data
has not changed; the validation split; the refused entries, logged once."""

from __future__ import annotations

import logging
from pathlib import Path

from stoker.dataset import Skipped, validation_ids
from stoker.index import PackedIndex, load_image_folder
from stoker.shards import load_shards, shard_paths

log = logging.getLogger(__name__)


def load_source(spec: Path, classes: tuple[str, ...] | None = None, cache: Path | None = None) -> PackedIndex:
    shards = shard_paths(spec)
    if shards is not None:
        return load_shards(shards, classes, cache)
    return load_image_folder(spec, classes, cache)


def split_source(index: PackedIndex, fraction: float, seed: int) -> tuple[PackedIndex, PackedIndex | None]:
    """Hold out `fraction` of every class for validation (see `dataset.validation_ids`)."""
    if fraction == 0:
        return index, None
    kept, held = validation_ids(index.labels, len(index.classes), fraction, seed)
    name = f"split-{fraction!r}-{seed}"
    return index.subset(f"{name}-train", kept), (index.subset(f"{name}-val", held) if len(held) else None)


def log_refused(refused: tuple[Skipped, ...]) -> None:
    for item in refused:
        log.warning("refused %s: %s", item.path, item.reason)

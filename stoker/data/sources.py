"""What `--data` / `--val` name (an ImageFolder, tar shards, Parquet files) and their packed index, from the cache
when the data has not changed; the validation split; the refused entries, logged once."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stoker.common.waiting import waiting
from stoker.data.formats.builtin_data import builtin_dataset
from stoker.data.formats.folders import Skipped, validation_ids
from stoker.data.formats.parquet import DEFAULT_COLUMNS, Columns, load_parquet, parquet_files
from stoker.data.formats.shards import load_shards, shard_paths
from stoker.data.index import PackedIndex, load_image_folder
from stoker.data.transports.object_store import LocalCopies, held_by_copies

if TYPE_CHECKING:  # `stoker pack` reads sources and needs no config (pydantic)
    from stoker.common.config import TrainConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Data:
    train: PackedIndex
    val: PackedIndex | None
    refused: tuple[Skipped, ...] = ()  # entries the scan or the shard index could not use


def load_data(config: TrainConfig) -> Data:
    """The run's training and validation samples (the built-in dataset without `--data`)."""
    train_root, val_root = (config.data, config.val) if config.data is not None else builtin_dataset()
    copies = local_copies(config.cache_dir, config.cache_bytes)
    columns = Columns(config.image_column, config.label_column)
    train = _load(train_root, copies=copies, columns=columns)
    val: PackedIndex | None
    if val_root is not None:
        val = _load(val_root, classes=train.classes, copies=copies, columns=columns)
        refused = train.skipped + val.skipped
    else:
        refused = train.skipped
        train, val = split_source(train, config.val_fraction, config.seed)
    log_refused(refused)
    return Data(train, val, refused)


def _load(root: Path | str, classes: tuple[str, ...] | None = None, copies: LocalCopies | None = None,
          columns: Columns = DEFAULT_COLUMNS) -> PackedIndex:
    with waiting(f"indexing {root}", unit="files") as progress:
        index = load_source(root, classes=classes, copies=copies, columns=columns)
        progress.update(len(index))
    return index


def load_source(spec: Path | str, classes: tuple[str, ...] | None = None, cache: Path | None = None,
                copies: LocalCopies | None = None, columns: Columns = DEFAULT_COLUMNS) -> PackedIndex:
    """The index of what `spec` names: Parquet files or shards (local or remote), or an ImageFolder. Parquet is
    asked first: a folder holding .parquet files is no ImageFolder."""
    files = parquet_files(spec)
    if files is not None:
        return load_parquet(files, classes, cache, columns)
    shards = shard_paths(spec)
    if shards is not None:
        return load_shards(shards, classes, cache, copies)
    return load_image_folder(Path(spec), classes, cache)


def local_copies(cache_dir: Path | None, cache_bytes: int | None) -> LocalCopies | None:
    """The `--cache-dir` of remote shards, bounded by `--cache-size` in bytes (default: half of what the disk has
    free now, the copies it holds counted as free: another run's copies are not evicted for want of room they
    take)."""
    if cache_dir is None:
        return None
    if cache_bytes is not None:
        return LocalCopies(cache_dir, cache_bytes)
    cache_dir.mkdir(parents=True, exist_ok=True)
    held = held_by_copies(cache_dir)  # stoker's copies count as free, the user's files there do not
    return LocalCopies(cache_dir, (shutil.disk_usage(cache_dir).free + held) // 2)


def split_source(index: PackedIndex, fraction: float, seed: int) -> tuple[PackedIndex, PackedIndex | None]:
    """Hold out `fraction` of every class for validation (see `dataset.validation_ids`)."""
    if fraction == 0:
        return index, None
    kept, held = validation_ids(index.labels, len(index.classes), fraction, seed)
    name = f"split-{fraction!r}-{seed}"
    return index.subset(f"{name}-train", kept), (index.subset(f"{name}-val", held) if len(held) else None)


SHOWN_PER_REASON = 3


def log_refused(refused: tuple[Skipped, ...]) -> None:
    """Each refused entry, but at most SHOWN_PER_REASON for one reason (a misspelt class folder's every file
    has the same), then how many more; summary.json lists them all."""
    by_reason: dict[str, list[str]] = {}
    for item in refused:
        by_reason.setdefault(item.reason, []).append(item.path)
    for reason, paths in by_reason.items():
        for path in paths[:SHOWN_PER_REASON]:
            log.warning("refused %s: %s", path, reason)
        if len(paths) > SHOWN_PER_REASON:
            log.warning("refused %d more files: %s (all in summary.json's skipped_files)",
                        len(paths) - SHOWN_PER_REASON, reason)

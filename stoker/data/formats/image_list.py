"""Every image under a folder, recursively, as one unlabelled split: what `stoker predict` reads.

The walk is the ImageFolder scan's own (`dataset._walk_files`): symlinks that leave the folder and symlink loops are
refused and listed, and the walk always ends. The listing is cached like an ImageFolder's index, while no
directory it read has changed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from stoker.data.formats.folders import IMAGE_EXTENSIONS, Listing, _walk_files
from stoker.data.index import Packed, PackedIndex, cache_key, index_cache_dir, input_stamps, load_cached, write_entry

HERE = "."  # the walk's top folder, relative to the root: names come out as "./sub/x.jpg"
UNLABELLED = ("",)  # the one class of a folder of images without labels


def list_images(root: Path, cache: Path | None = None) -> PackedIndex:
    """Every image file in `root` or below (label 0 each); a ValueError naming `root` when there is none."""
    root_real = os.path.realpath(root)
    if not os.path.isdir(root_real):
        raise ValueError(f"{root}: not a folder (expected a folder of images, searched recursively)")
    cache = cache or index_cache_dir()
    key = cache_key("images", root_real)
    cached = load_cached(cache, key)
    if cached is None:
        started = time.time_ns()
        listing = Listing(root_real + os.sep)
        _walk_files(HERE, root_real, 0, listing, set(), root_real)
        names = [name[len(HERE + os.sep):] for name in listing.names]
        packed = Packed(listing.base, names, [0] * len(names), UNLABELLED, listing.skipped)
        cached = write_entry(cache, key, packed, input_stamps(listing.folders, started))
    if not len(cached):
        raise ValueError(f"{root}: no image files in it or below (extensions "
                         f"{', '.join(sorted(IMAGE_EXTENSIONS))})")
    return cached


"""Awkward data trees for the scan tests."""

from __future__ import annotations

import os


def make_unreadable_folder(parent) -> str:
    """A folder whose path is longer than the system allows: listing it fails (ENAMETOOLONG) for every user,
    root included, where a chmod 000 would not stop root."""
    fd = os.open(parent, os.O_RDONLY)
    name, depth = "d" * 250, 0
    try:
        while depth * 251 < os.pathconf(parent, "PC_PATH_MAX") + 500:
            os.mkdir(name, dir_fd=fd)
            inner = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd, depth = inner, depth + 1
    finally:
        os.close(fd)
    return os.path.join(str(parent), *[name] * depth)

"""The one check of a file torch.save wrote, before torch.load reads it (`--init`, model files).

torch.save writes a zip archive; torch.load falls back to its legacy reader for anything else, and on a text
file that reader ends in KeyError or IndexError, not in a message. torch.load does not check the CRC-32 the
archive keeps for each record either, so changed tensor bytes (or class names) would load without a word;
zipfile checks them.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

ZIP_HEADER = b"PK\x03\x04"


class ArchiveError(ValueError):
    """Not the archive torch.save writes, or a damaged one; the caller puts the file's name (or setting) first."""


def check_torch_archive(path: Path, what: str) -> None:
    """`path` is a whole zip archive as torch.save writes it, or an ArchiveError saying what it is instead;
    `what` names what the file should be ("a model file")."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(len(ZIP_HEADER))
    except OSError as error:
        raise ArchiveError(f"cannot read it ({error.strerror})") from None
    if head != ZIP_HEADER:
        raise ArchiveError(f"not {what} (not the zip archive torch.save writes; it starts with {head!r})")
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as error:
        raise ArchiveError(f"a damaged archive ({error})") from None
    if damaged is not None:
        raise ArchiveError(f"tampered or damaged: the checksum of its record {damaged!r} does not match")

"""What a remote data location may look like, checked where settings are (no client is imported here: the CLI
starts without one)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

SCHEMES = ("http", "https", "s3", "gs")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_remote(spec: object) -> bool:
    return isinstance(spec, str) and _URL.match(spec) is not None


def check_url(name: str, url: str) -> None:
    """A URL stoker can read, and nothing in it that must not be written to config.json or a log."""
    scheme = _URL.match(url).group(1).lower()  # type: ignore[union-attr]
    if scheme not in SCHEMES:
        raise ValueError(f"{name}={url!r}: the scheme {scheme!r} is not read (expected one of "
                         f"{', '.join(s + '://' for s in SCHEMES)})")
    parts = urlsplit(url)
    if parts.username or parts.password:
        raise ValueError(f"{name}: a URL with credentials in it would be written to config.json and the logs; "
                         f"give them in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE)")
    if parts.query or parts.fragment:
        shown = url.split("?", 1)[0].split("#", 1)[0]  # a presigned query holds a signature: not for a log
        raise ValueError(f"{name}={shown!r}...: a URL with a query or fragment is not read (name the objects, e.g. "
                         f"s3://bucket/train-{{0000..0127}}.tar)")
    if not parts.netloc:
        raise ValueError(f"{name}={url!r}: no host or bucket")


def data_location(value: Any) -> Any:
    """A URL stays the text it is (a Path would fold its '//'); other text is a local path."""
    if isinstance(value, str):
        return value if is_remote(value) else Path(value)
    return value

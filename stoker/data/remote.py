"""Objects where they live: shards over HTTP(S) and in S3 (or GCS), read with obstore.

obstore (Rust's object_store) was measured here beside fsspec's HTTP filesystem on 100 KB ranged reads from nginx
on loopback: 0.34 against 0.56 ms a read, 4,359 against 2,529 reads/s from 16 threads; at 25 ms of added round
trip both are bound by the round trip. It retries with back-off, speaks If-Match, reads the AWS_* environment
variables S3 users already set, and needs nothing else installed.

A sample is one ranged GET of its member, asked with If-Match on the ETag the index was made from: an object
replaced during the run is named, never read at the old offsets. Requests that keep failing (after `RETRIES`
tries with back-off, each bounded by `REQUEST_TIMEOUT`) make the sample unreadable, as a local read error does:
listed, and tried again in a later epoch. Each process makes its own clients (a fork must not share a runtime).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import obstore
from obstore.exceptions import (
    BaseError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)

from stoker.common import faults

if TYPE_CHECKING:
    from obstore import GetOptions
from stoker.data.imaging import UNREADABLE, UnusableImage

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = timedelta(seconds=60)
CONNECT_TIMEOUT = timedelta(seconds=10)
RETRIES = 4  # then the sample is unreadable this epoch (UNREADABLE: tried again in the next)
RETRY_CONFIG: dict[str, Any] = {"max_retries": RETRIES, "retry_timeout": timedelta(seconds=120),
                                "backoff": {"init_backoff": timedelta(milliseconds=200),
                                            "max_backoff": timedelta(seconds=5), "base": 2}}
STAT_THREADS = 32  # HEADs at start go out together: 128 shards 100 ms away take 0.4 s, not 13
NO_SUCH_OBJECT = "no such object"


@dataclass(frozen=True)
class Version:
    """What identifies an object's bytes: its size and its ETag (or, where a server gives none, its date)."""

    size: int
    etag: str


_stores: dict[tuple[int, str], Any] = {}
_stores_lock = threading.Lock()


def _split(url: str) -> tuple[str, str]:
    """(root the client is made for, path of the object under it)."""
    parts = urlsplit(url)
    return f"{parts.scheme.lower()}://{parts.netloc}", parts.path.lstrip("/")


def _store(root: str) -> Any:
    key = (os.getpid(), root)  # a client's runtime does not survive a fork: each process makes its own
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = _make_store(root)
    return store


def _make_store(root: str) -> Any:
    options = {"timeout": REQUEST_TIMEOUT, "connect_timeout": CONNECT_TIMEOUT,
               "allow_http": root.startswith("http://") or os.environ.get("AWS_ALLOW_HTTP", "") == "true"}
    kwargs: dict[str, Any] = {"client_options": options, "retry_config": RETRY_CONFIG}
    if root.startswith("s3://"):
        provider = _aws_profile_provider()
        if provider is not None:
            kwargs["credential_provider"] = provider
    return obstore.store.from_url(root, **kwargs)


def _aws_profile_provider() -> Any:
    """Credentials from ~/.aws (profiles, SSO, roles) through boto3 when the environment holds no keys and boto3
    is installed; else obstore's own chain (environment, container and instance credentials)."""
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return None
    try:
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return None
    try:
        return Boto3CredentialProvider()
    except Exception:  # noqa: BLE001 (no profile, no credentials: obstore's chain is asked instead)
        return None


def describe(error: BaseException) -> str:
    """The first line of a client error: obstore appends a debug dump after it."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


_versions: dict[str, Version] = {}  # this process's answers, asked once per start (`forget_versions` asks again)


def forget_versions() -> None:
    _versions.clear()


def stat(url: str) -> Version:
    """The object's size and ETag (asked once per process); a missing, forbidden or unreachable object is a
    ValueError naming it."""
    known = _versions.get(url)
    if known is None:
        known = _versions[url] = _ask_version(url)
    return known


def _ask_version(url: str) -> Version:
    root, path = _split(url)
    try:
        meta = obstore.head(_store(root), path)
    except (BaseError, OSError) as error:
        raise ValueError(f"{url}: {_refusal(error)}") from None
    etag = meta.get("e_tag") or meta.get("version") or str(meta.get("last_modified") or "")
    return Version(int(meta["size"]), etag)


def _refusal(error: BaseException) -> str:
    """Why an object cannot be read, in words; HTTP servers' answers reach obstore as generic errors."""
    text = str(error)
    if isinstance(error, NotFoundError) or "404 Not Found" in text:
        return NO_SUCH_OBJECT
    if isinstance(error, (PermissionDeniedError, UnauthenticatedError)) or "403 Forbidden" in text or \
            "401 Unauthorized" in text:
        return (f"access refused ({describe(error)}); credentials are read from AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws")
    return f"cannot be read ({describe(error)})"


def stat_all(urls: list[str]) -> list[Version]:
    """Every object's version, asked concurrently; the first problem (in order) is raised."""
    if len(urls) <= 1 or all(url in _versions for url in urls):
        return [stat(url) for url in urls]
    with ThreadPoolExecutor(min(STAT_THREADS, len(urls))) as pool:
        return list(pool.map(stat, urls))


def fetch(url: str, limit: int) -> bytes | None:
    """A small object whole (a list of classes, an index), None when it does not exist; one over `limit` bytes
    is a ValueError before it is read."""
    try:
        version = stat(url)
    except ValueError as error:
        if str(error).endswith(NO_SUCH_OBJECT):
            return None
        raise
    if version.size > limit:
        raise ValueError(f"{url}: {version.size} bytes, more than the {limit} such a file may hold")
    root, path = _split(url)
    return bytes(obstore.get(_store(root), path).bytes())


def list_tars(prefix: str) -> list[str]:
    """The .tar objects directly under an S3 or GCS prefix (HTTP has no listing), sorted."""
    root, path = _split(prefix)
    if root.startswith("http"):
        raise ValueError(f"data={prefix!r}: HTTP has no listing; name the shards, e.g. "
                         f"{prefix.rstrip('/')}/train-{{0000..0127}}.tar")
    try:
        listing = obstore.list_with_delimiter(_store(root), path.rstrip("/") + "/" if path else None)
    except BaseError as error:
        raise ValueError(f"data={prefix!r}: cannot be listed ({describe(error)})") from None
    return sorted(f"{root}/{item['path']}" for item in listing["objects"] if item["path"].lower().endswith(".tar"))


def read_range(url: str, version: str, start: int, size: int, copies: LocalCopies | None = None) -> bytes:
    """`size` bytes at `start` of the object as it was indexed (If-Match its ETag), from its local copy once one
    is complete."""
    faults.simulated_delay(faults.READ_LATENCY_ENV)
    local = _local_copy(copies, url, version) if copies is not None else None
    if local is not None:
        return local.read(start, size)
    root, path = _split(url)
    options: GetOptions = {"range": (start, start + size)}
    if version.startswith('"') or version.startswith('W/'):  # an ETag: dates are no If-Match validators
        options["if_match"] = version
    try:
        data = obstore.get(_store(root), path, options=options).bytes()
    except PreconditionError:
        raise UnusableImage(f"{url} changed during the run (its ETag is no longer {version}): the index no longer "
                            f"describes it; start again to index it anew") from None
    except NotFoundError:
        raise UnusableImage(f"{UNREADABLE} {url} no longer exists") from None
    except (BaseError, OSError) as error:
        raise UnusableImage(f"{UNREADABLE} {url}: {describe(error)} (after {RETRIES} retries)") from None
    if len(data) != size:
        raise UnusableImage(f"{url} is shorter than its index (changed during the run?)")
    return bytes(data)


READ_AHEAD_THREADS = 32  # requests in flight per producer: a part's samples wait one round trip, not one each
_read_pool: tuple[int, ThreadPoolExecutor] | None = None


def read_ahead(read: Callable[[int], bytes], samples: Sequence[int]) -> dict[int, Future[bytes]]:
    """`read(sample)` of each sample started now in this process's pool of request threads."""
    global _read_pool
    if _read_pool is None or _read_pool[0] != os.getpid():  # a pool's threads do not survive a fork
        _read_pool = (os.getpid(), ThreadPoolExecutor(READ_AHEAD_THREADS, thread_name_prefix="stoker-read"))
    pool = _read_pool[1]
    return {sample: pool.submit(read, sample) for sample in samples}


def download(url: str, version: str, target: Path, keep_going: Callable[[], bool] = lambda: True) -> bool:
    """The whole object into `target` (written beside it, then renamed: a reader sees all of it or nothing);
    False when `keep_going` said stop first."""
    root, path = _split(url)
    options: GetOptions = {"if_match": version} if version.startswith(('"', "W/")) else {}
    partial = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.part")
    try:
        result = obstore.get(_store(root), path, options=options)
        with open(partial, "wb") as out:
            for chunk in result:
                if not keep_going():
                    return False
                out.write(chunk)
        os.replace(partial, target)
        return True
    finally:
        partial.unlink(missing_ok=True)


# ---- the local copies (--cache-dir, --cache-size) -----------------------------------------------------------------

@dataclass(frozen=True)
class LocalCopies:
    """Whole copies of remote shards in `folder`, at most `limit` bytes of them. A copy is named by the object and
    its ETag (a replaced object is never read from an old copy), written beside its name and renamed (a reader sees
    all of it or none), and the folder's size is kept under a lock, so two runs on one machine share it. A copy
    another run still reads may be removed to make room: its open descriptors keep reading it."""

    folder: Path
    limit: int

    def path(self, url: str, version: str) -> Path:
        digest = hashlib.sha256(f"{url}\n{version}".encode()).hexdigest()[:32]
        return self.folder / f"{digest}.{os.path.basename(urlsplit(url).path)[-60:]}"

    def make_room(self, size: int, keep: set[Path]) -> bool:
        """Whether `size` more bytes fit, after removing the least recently written copies not in `keep`."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            copies = sorted((p.stat().st_mtime, p.stat().st_size, p) for p in self.folder.iterdir()
                            if not p.name.startswith(".") and p.is_file())
            used = sum(entry[1] for entry in copies)
            for _, held, path in copies:
                if used + size <= self.limit:
                    break
                if path not in keep:
                    path.unlink(missing_ok=True)
                    used -= held
            return used + size <= self.limit

    def fill(self, shards: list[tuple[str, str, int]], keep_going: Callable[[], bool]) -> None:
        """Copy each (url, version, size) in turn while it fits and `keep_going()`; the first that does not fit
        ends the filling (later epochs then read the rest remotely)."""
        wanted = {self.path(url, version) for url, version, _ in shards}
        for url, version, size in shards:
            target = self.path(url, version)
            if target.exists():
                continue
            if not keep_going() or not self.make_room(size, wanted):
                return
            try:
                download(url, version, target, keep_going)
            except (BaseError, OSError) as error:
                log.warning("could not copy %s into %s (%s): it is read remotely", url, self.folder, describe(error))


class CopyFiller:
    """Copies a run's remote shards into the local cache in a thread of the driving process, so later epochs read
    them from disk; `close()` (idempotent) stops it between two chunks."""

    def __init__(self, copies: LocalCopies, shards: list[tuple[str, str, int]]) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=copies.fill, args=(shards, lambda: not self._stop.is_set()),
                                        name="stoker-cache-fill", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class _Copy:
    def __init__(self, path: Path) -> None:
        self.path, self.fd = path, os.open(path, os.O_RDONLY)

    def read(self, start: int, size: int) -> bytes:
        data = os.pread(self.fd, size, start)
        if len(data) != size:
            raise UnusableImage(f"the local copy {self.path} is shorter than its index")
        return data


_copies: dict[Path, _Copy] = {}
MAX_OPEN_COPIES = 128


def _local_copy(copies: LocalCopies, url: str, version: str) -> _Copy | None:
    """The whole local copy of the object, once one is complete in the cache folder; None until then."""
    path = copies.path(url, version)
    copy = _copies.get(path)
    if copy is None:
        try:
            copy = _Copy(path)
        except OSError:
            return None
        if len(_copies) >= MAX_OPEN_COPIES:
            for old in _copies.values():
                os.close(old.fd)
            _copies.clear()
        _copies[path] = copy
    return copy

"""Objects where they live: shards over HTTP(S) and in S3 (or GCS), read with obstore.

obstore (Rust's object_store) was measured here beside fsspec's HTTP filesystem on 100 KB ranged reads from nginx
on loopback: 0.34 against 0.56 ms a read, 4,359 against 2,529 reads/s from 16 threads; at 25 ms of added round
trip both are bound by the round trip. It retries with back-off, speaks If-Match, reads the AWS_* environment
variables S3 users already set, and needs nothing else installed.

A sample is one ranged GET of its member, asked with If-Match on the (strong) ETag the index was made from: an
object replaced during the run is named, never read at the old offsets. Those requests go through libcurl
(`ranges.py`: a third of obstore's CPU a request), at URLs the store signs for S3 and GCS; a store that does not
sign is read through obstore. A read that keeps failing (retried with back-off, settled within 14 s of being
asked, inside the default producer timeout) makes the sample unreadable, as a local read error does: listed, and
tried again in a later epoch. Whole objects (a shard indexed or copied) have no deadline but one on silence.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import obstore
from obstore.exceptions import (
    BaseError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)

from stoker.common import faults
from stoker.data.transports import ranges

if TYPE_CHECKING:
    from obstore import GetOptions
from stoker.data.pixels.imaging import UNREADABLE, UnusableImage

log = logging.getLogger(__name__)

# A sample's read, retries included, must end inside the producer timeout (20 s by default): past that the producer
# is taken for hung and the file for the cause. Then the sample is unreadable this epoch (tried again in the next).
# libcurl's requests (ranges.py) settle each read within ranges.READ_DEADLINE_S; obstore's, for stores that cannot
# sign, take the same bounds a request, and start no retry after 8 s: the last may take its 4 s and a back-off of
# at most 2 s before it, 14 s at worst.
REQUEST_TIMEOUT = timedelta(seconds=ranges.REQUEST_TIMEOUT_S)
CONNECT_TIMEOUT = timedelta(seconds=ranges.CONNECT_TIMEOUT_S)
RETRIES = ranges.RETRIES
RETRY_CONFIG: dict[str, Any] = {"max_retries": RETRIES, "retry_timeout": timedelta(seconds=8),
                                "backoff": {"init_backoff": timedelta(seconds=ranges.FIRST_BACKOFF_S),
                                            "max_backoff": timedelta(seconds=ranges.LAST_BACKOFF_S), "base": 2}}
# A whole object (a shard indexed or copied) may take minutes: no deadline on the transfer, only on silence.
WHOLE_CONFIG: dict[str, Any] = {"max_retries": RETRIES, "retry_timeout": timedelta(minutes=5),
                                "backoff": {"init_backoff": timedelta(milliseconds=500),
                                            "max_backoff": timedelta(seconds=10), "base": 2}}
STALLED_TIMEOUT = timedelta(seconds=60)
STAT_THREADS = 32  # HEADs at start go out together: 128 shards 100 ms away take 0.4 s, not 13
NO_SUCH_OBJECT = "no such object"
ACCESS_REFUSED = "access refused"


@dataclass(frozen=True)
class Version:
    """What identifies an object's bytes: its size and its ETag (or, where a server gives none, its date)."""

    size: int
    etag: str


# obstore's runtime is the process's: a process forked after its parent used it hangs on a new client. Producers
# are forked from the zygote, which never reads data, or spawned: they start clean. The pid in the key keeps a
# child from reusing its parent's client objects all the same.
_stores: dict[tuple[int, str, bool], Any] = {}
_stores_lock = threading.Lock()


@functools.lru_cache(maxsize=4096)  # every sample's read asks: urlsplit costs more than the lookup
def _split(url: str) -> tuple[str, str]:
    """(root the client is made for, path of the object under it)."""
    parts = urlsplit(url)
    return f"{parts.scheme.lower()}://{parts.netloc}", parts.path.lstrip("/")


def _store(root: str, whole: bool = False) -> Any:
    """This process's client for `root`: for ranged reads, or (`whole`) for whole objects."""
    key = (os.getpid(), root, whole)
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = _make_store(root, whole)
    return store


def _make_store(root: str, whole: bool) -> Any:
    options: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT, "allow_http": _allows_http(root)}
    options.update({"read_timeout": STALLED_TIMEOUT} if whole else {"timeout": REQUEST_TIMEOUT})
    kwargs: dict[str, Any] = {"client_options": options, "retry_config": WHOLE_CONFIG if whole else RETRY_CONFIG}
    if root.startswith("s3://"):
        provider = _aws_profile_provider()
        if provider is not None:
            kwargs["credential_provider"] = provider
    return obstore.store.from_url(root, **kwargs)


# Where an S3-compatible store is (MinIO, moto, a cloud's S3 API), in the order boto3 and obstore read them.
ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")


def s3_endpoint() -> str | None:
    """The endpoint the environment names for S3, if any (else AWS's own); one that is no http(s) URL is a
    ValueError naming its variable (obstore would panic on it)."""
    for name in ENDPOINT_ENV:
        endpoint = os.environ.get(name)
        if endpoint:
            if not endpoint.lower().startswith(("http://", "https://")):
                raise ValueError(f"{name}={endpoint!r}: expected the store's URL, e.g. http://127.0.0.1:9000 or "
                                 f"https://s3.example.com")
            return endpoint
    return None


def _allows_http(root: str) -> bool:
    """Plain HTTP where the user asked for it: an http:// URL, or an S3 endpoint at http:// (as boto3 follows the
    endpoint's scheme: without it obstore refuses with "builder error"), or AWS_ALLOW_HTTP=true."""
    if root.startswith("http://") or os.environ.get("AWS_ALLOW_HTTP", "").lower() == "true":
        return True
    endpoint = s3_endpoint() if root.startswith("s3://") else None
    return endpoint is not None and endpoint.lower().startswith("http://")


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
    """The first line of a library's error, bounded: obstore appends a debug dump after it, pyarrow a trace."""
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


_versions: dict[str, Version | str] = {}  # this process's answers (a refusal as its text), once per load of them


def forget_versions(urls: list[str]) -> None:
    """The next `stat` of these asks the server again: a second Loader in one process must see objects replaced
    since (and the others' answers stay those their index was made from)."""
    for url in urls:
        _versions.pop(url, None)


def stat(url: str) -> Version:
    """The object's size and ETag (asked once per process); a missing, forbidden or unreachable object is a
    ValueError naming it."""
    known = _versions.get(url)
    if known is None:
        try:
            known = _versions[url] = _ask_version(url)
        except ValueError as error:
            if NO_SUCH_OBJECT not in str(error) and ACCESS_REFUSED not in str(error):
                raise  # a passing failure: asked again next time
            known = _versions[url] = str(error)  # absent: not asked again until forgotten
    if isinstance(known, str):
        raise ValueError(known)
    return known


def _ask_version(url: str) -> Version:
    root, path = _split(url)
    try:
        meta = obstore.head(_store(root), path)
    except (BaseError, OSError) as error:
        raise ValueError(f"{url}: {_refusal(error)}") from None
    size = int(meta["size"])
    # Without an ETag the version is the size and date: a copy or cached index of another size is never taken.
    etag = meta.get("e_tag") or meta.get("version") or f"{size}@{meta.get('last_modified') or ''}"
    return Version(size, etag)


def _refusal(error: BaseException) -> str:
    """Why an object cannot be read, in words; HTTP servers' answers reach obstore as generic errors."""
    text = str(error)
    if isinstance(error, NotFoundError) or "404 Not Found" in text:
        return NO_SUCH_OBJECT
    if isinstance(error, (PermissionDeniedError, UnauthenticatedError)) or "403 Forbidden" in text or \
            "401 Unauthorized" in text:
        hint = ("; S3 credentials are read from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws"
                if "s3://" in text or isinstance(error, UnauthenticatedError) else "")
        return f"{ACCESS_REFUSED} ({describe(error)}){hint}"
    return f"cannot be read ({describe(error)}){_what_to_change(text)}"


def _what_to_change(text: str) -> str:
    """What a user changes when the store cannot be reached at all (obstore's words say only what failed)."""
    if "builder error" in text:
        return "; plain http:// is refused: set AWS_ALLOW_HTTP=true, or give the endpoint as http://..."
    if "error sending request" not in text and "Connection refused" not in text:
        return ""
    endpoint = next((f"{name}={os.environ[name]}" for name in ENDPOINT_ENV if os.environ.get(name)), None)
    if "S3 error" in text:  # obstore's words for an S3 store
        return (f"; no answer from {endpoint}: is that the store's address, and is it up?" if endpoint else
                "; no answer from AWS: for an S3-compatible store set AWS_ENDPOINT_URL to its address")
    return "; no answer: check the URL's host and port, and that the server is up"


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
        if ACCESS_REFUSED in str(error):  # S3 answers a missing key with 403 to those who may not list the bucket
            log.warning("%s: taken as absent", error)
            return None
        raise
    if version.size > limit:
        raise ValueError(f"{url}: {version.size} bytes, more than the {limit} such a file may hold")
    root, path = _split(url)
    options: GetOptions = {"range": (0, version.size), **_precondition(version.etag)}  # never past what HEAD said
    try:
        return bytes(obstore.get(_store(root, whole=True), path, options=options).bytes()) if version.size else b""
    except (BaseError, OSError) as error:
        raise ValueError(f"{url}: {_refusal(error)}") from None


def list_tars(prefix: str) -> list[str]:
    """The .tar objects directly under an S3 or GCS prefix (HTTP has no listing), sorted."""
    root, path = _split(prefix)
    if root.startswith("http"):
        raise ValueError(f"data={prefix!r}: HTTP has no listing; name the shards, e.g. "
                         f"{prefix.rstrip('/')}/train-{{0000..0127}}.tar")
    try:
        listing = obstore.list_with_delimiter(_store(root), path.rstrip("/") + "/" if path else None)
    except BaseError as error:
        raise ValueError(f"data={prefix!r}: {_unlisted(error)}") from None
    return sorted(f"{root}/{item['path']}" for item in listing["objects"] if item["path"].lower().endswith(".tar"))


def _unlisted(error: BaseException) -> str:
    return f"cannot be listed ({describe(error)}){_what_to_change(str(error))}"


def objects_under(prefix: str) -> list[str]:
    """Every object's URL under an S3 or GCS prefix (all levels)."""
    root, path = _split(prefix)
    try:
        found = [item["path"] for batch in obstore.list(_store(root), path.rstrip("/") + "/" if path else None)
                 for item in batch]
    except BaseError as error:
        raise ValueError(f"{prefix}: {_unlisted(error)}") from None
    return [f"{root}/{key}" for key in found]


def upload(file: Path, url: str) -> None:
    """`file` written to `url` (in parts where it is large): the object appears whole or not at all."""
    root, path = _split(url)
    try:
        obstore.put(_store(root, whole=True), path, file)
    except BaseError as error:
        raise ValueError(f"{url}: cannot be written ({_refusal(error)})") from None


def delete(url: str) -> None:
    root, path = _split(url)
    try:
        obstore.delete(_store(root, whole=True), path)
    except BaseError as error:
        raise ValueError(f"{url}: cannot be removed ({_refusal(error)})") from None


def read_range(url: str, version: str, start: int, size: int, copies: LocalCopies | None = None) -> bytes:
    """`size` bytes at `start` of the object as it was indexed (If-Match its ETag), from its local copy once one
    is complete; an UnusableImage when they cannot be had."""
    return read_later(url, version, start, size, copies).result()


def read_later(url: str, version: str, start: int, size: int, copies: LocalCopies | None = None) -> Future[bytes]:
    """`read_range`'s bytes as a future, the request sent now."""
    return read_all_later([(url, version, start, size)], copies)[0]


def read_all_later(members: list[tuple[str, str, int, int]], copies: LocalCopies | None = None) -> list[Future[bytes]]:
    """Each (url, version, start, size) member's bytes as a future, the requests sent together: a producer starts a
    part's reads at once, and its samples then wait about one round trip, not one each. A local copy is read at
    once (it has no round trip)."""
    futures: dict[int, Future[bytes]] = {}
    curl: list[tuple[int, tuple[str, str, str, int, int, ranges.SignAgain | None]]] = []
    for i, (url, version, start, size) in enumerate(members):
        local = _local_copy(copies, url, version) if copies is not None and size else None
        if size == 0:
            futures[i] = ranges.settled(b"")  # an empty range is no request a server takes
        elif local is not None:
            try:
                futures[i] = ranges.settled(local.read(start, size))
            except UnusableImage as error:
                futures[i] = ranges.settled(error)
        elif (target := _request_url(url)) is None:
            futures[i] = _store_reads().submit(_read_through_store, url, version, start, size)
        else:
            signed = not url.startswith(("http://", "https://"))
            curl.append((i, (url, target, version, start, size, _sign if signed else None)))
    if curl:
        for (i, _), future in zip(curl, ranges.client().submit_all([read for _, read in curl]), strict=True):
            futures[i] = future
    return [futures[i] for i in range(len(members))]


def stop_reading() -> None:
    """Stop this process's requests, failing those not answered (a producer that stops waits for none of them)."""
    global _store_pool
    ranges.stop()
    if _store_pool is not None and _store_pool[0] == os.getpid():
        _store_pool[1].shutdown(wait=False, cancel_futures=True)
    _store_pool = None


SIGNED_FOR = timedelta(hours=1)
# Temporary credentials are renewed by obstore when 5 minutes or less are left: a URL signed with them is used for
# at most 2 minutes, well inside what they have left (and one refused with 400 or 403 is signed again at once).
SIGN_AGAIN_S = 120.0
_signed: dict[str, tuple[float, str]] = {}  # url -> (when to sign it again, the signed URL)
_unsigned_roots: dict[str, float] = {}  # stores that could not sign -> when to try again (read through obstore)
# Stores set to skip signing, or whose requests carry headers a signed URL does not (requester pays, a customer's
# encryption key): read through obstore, which sends them. Never asked to sign: asking may go to the metadata service.
THROUGH_STORE_ENV = {"s3://": ("AWS_SKIP_SIGNATURE", "AWS_REQUEST_PAYER", "AWS_SSE_CUSTOMER_KEY_BASE64"),
                     "gs://": ("GOOGLE_SKIP_SIGNATURE",)}
HTTP_PATH_SAFE = "/%:@!$&'()*+,;=~"  # kept as written: a path's delimiters and its escapes
HTTP_QUERY_SAFE = HTTP_PATH_SAFE + "?"


def _request_url(url: str) -> str | None:
    """Where a ranged GET of the object goes: an HTTP(S) URL itself (spaces and other characters of its path and
    query escaped), an S3 or GCS object's URL as its store signs it; None for a store read through obstore."""
    if url.startswith(("http://", "https://")):
        return _escaped(url)
    known = _signed.get(url)
    if known is not None and time.monotonic() < known[0]:
        return known[1]
    return _sign(url)


@functools.lru_cache(maxsize=4096)
def _escaped(url: str) -> str:
    parts = urlsplit(url)  # the host as written: libcurl takes international names itself
    return parts._replace(path=quote(parts.path, safe=HTTP_PATH_SAFE),
                          query=quote(parts.query, safe=HTTP_QUERY_SAFE)).geturl()


def _sign(url: str) -> str | None:
    """The object's URL signed now (and kept for SIGN_AGAIN_S), or None for a store read through obstore. Called
    by producers and, for a URL refused with 400 or 403, by the ranged reads' client in a thread of its own."""
    root, path = _split(url)
    settings = next((names for scheme, names in THROUGH_STORE_ENV.items() if root.startswith(scheme)), ())
    if any(os.environ.get(name, "").lower() not in ("", "false", "0") for name in settings):
        return None
    now = time.monotonic()
    if now < _unsigned_roots.get(root, 0.0):
        return None
    try:
        signed = obstore.sign(_store(root), "GET", path, SIGNED_FOR)
    except Exception as error:  # noqa: BLE001 (any reason not to sign: read through obstore, which says why)
        if root not in _unsigned_roots:
            log.warning("%s: read through obstore for now, URLs of this store cannot be signed (%s)", root,
                        describe(error))
        _unsigned_roots[root] = now + SIGN_AGAIN_S  # a passing failure (a credentials service) is asked again
        return None
    _signed[url] = (now + SIGN_AGAIN_S, signed)
    return signed


_store_pool: tuple[int, ThreadPoolExecutor] | None = None
_store_pool_lock = threading.Lock()


def _store_reads() -> ThreadPoolExecutor:
    """This process's request threads for objects read through obstore (a pool's threads do not survive a fork)."""
    global _store_pool
    with _store_pool_lock:
        if _store_pool is None or _store_pool[0] != os.getpid():
            _store_pool = (os.getpid(), ThreadPoolExecutor(ranges.IN_FLIGHT, thread_name_prefix="stoker-read"))
        return _store_pool[1]


def _read_through_store(url: str, version: str, start: int, size: int) -> bytes:
    faults.simulated_delay(faults.READ_LATENCY_ENV)
    root, path = _split(url)
    options: GetOptions = {"range": (start, start + size), **_precondition(version)}
    try:
        data = obstore.get(_store(root), path, options=options).bytes()
    except PreconditionError:
        raise UnusableImage(ranges.changed(url, version)) from None
    except (NotFoundError, FileNotFoundError):  # obstore raises the builtin one for a 404 of a GET
        raise UnusableImage(ranges.gone(url)) from None
    except (BaseError, OSError) as error:
        raise UnusableImage(f"{UNREADABLE} {url}: {describe(error)}") from None
    if len(data) != size:
        raise UnusableImage(ranges.shorter(url))
    return bytes(data)


def _precondition(version: str) -> GetOptions:
    """If-Match on a strong ETag: a weak one never matches (RFC 9110 compares strongly), a size and date is none."""
    return {"if_match": version} if version.startswith('"') else {}


def download(url: str, version: Version, target: Path, keep_going: Callable[[], bool] = lambda: True) -> bool:
    """The whole object into `target` (written beside it, synced, checked whole and renamed: a reader sees all of
    it or nothing); False when `keep_going` said stop first. A failure is a ValueError naming the object."""
    root, path = _split(url)
    partial = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.part")
    try:
        result = obstore.get(_store(root, whole=True), path, options=_precondition(version.etag))
        with open(partial, "wb") as out:
            written = 0
            for chunk in result:
                if not keep_going():
                    return False
                written += len(chunk)
                if written > version.size:  # never past what HEAD said: an endless body would fill the disk
                    raise ValueError(f"{url}: the server sends more than the {version.size} bytes it announced "
                                     f"(stopped at {written}): is the object being replaced?")
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if written != version.size:
            raise ValueError(f"{url}: {written} bytes arrived, {version.size} expected")
        os.replace(partial, target)
        return True
    except PreconditionError:
        raise ValueError(f"{url} changed while it was read (its ETag is no longer {version.etag})") from None
    except BaseError as error:
        raise ValueError(f"{url}: {_refusal(error)}") from None
    except OSError as error:  # the local side (a full or read-only disk), or obstore's FileNotFoundError for a 404
        if isinstance(error, FileNotFoundError) and error.filename is None:
            raise ValueError(f"{url}: {NO_SUCH_OBJECT}") from None
        raise ValueError(f"{target.parent}: cannot hold a copy of {url} ({error.strerror or error})") from None
    finally:
        partial.unlink(missing_ok=True)


# ---- the local copies (--cache-dir, --cache-size) -----------------------------------------------------------------

DEAD_PART_S = 3600  # a partial copy this old belongs to a run that died


@functools.lru_cache(maxsize=4096)  # every sample read asks: sha256 and urlsplit cost more than the lookup
def _copy_name(url: str, version: str) -> str:
    digest = hashlib.sha256(f"{url}\n{version}".encode()).hexdigest()[:32]
    return f"{digest}.{os.path.basename(urlsplit(url).path)[-60:]}"


# The names of the copies stoker wrote in a --cache-dir, kept under its lock: nothing else there is counted against
# --cache-size or ever removed (a folder the user points at may hold their own files).
LEDGER = ".stoker-copies.json"
_PART = re.compile(r"^\.(?P<copy>[0-9a-f]{32}\..*)\.\d+\.\d+\.(?:part|reserve)$", re.DOTALL)


def _owner_of(name: str) -> str | None:
    """The copy a partial or reserved file (`.COPY.PID.THREAD.part`) is for; None for any other name."""
    found = _PART.match(name)
    return found["copy"] if found else None


def _read_ledger(folder: Path) -> set[str]:
    try:
        names = json.loads((folder / LEDGER).read_text())
    except FileNotFoundError:
        return set()
    except (OSError, ValueError) as error:  # a damaged ledger: nothing is taken for ours, so nothing is removed
        log.warning("%s cannot be read (%s): the copies it named are no longer counted or removed", folder / LEDGER,
                    error)
        return set()
    return {name for name in names if isinstance(name, str) and "/" not in name} if isinstance(names, list) else set()


def _write_ledger(folder: Path, names: set[str]) -> None:
    fresh = folder / f"{LEDGER}.{os.getpid()}.new"
    fresh.write_text(json.dumps(sorted(names)))
    os.replace(fresh, folder / LEDGER)


def _owned_files(folder: Path, owned: set[str]) -> tuple[list[tuple[float, int, Path]], int, set[str]]:
    """The ledger's whole copies as (written, size, path), the bytes its copies and partial copies take, and the
    names still present; a killed run's partial copy is removed."""
    copies, used, present = [], 0, set()
    for entry in folder.iterdir():
        name = _owner_of(entry.name) or entry.name
        if name not in owned:  # the user's, or another program's: never counted, never removed
            continue
        try:
            status = entry.stat()
        except FileNotFoundError:  # another run's copy, evicted meanwhile
            continue
        present.add(name)
        if name == entry.name:
            copies.append((status.st_mtime, status.st_size, entry))
            used += status.st_size
        elif status.st_mtime < time.time() - DEAD_PART_S:
            entry.unlink(missing_ok=True)  # a killed run's
        else:
            used += status.st_size  # copies being written take room too
    return copies, used, present


def held_by_copies(folder: Path) -> int:
    """The bytes stoker's copies take in `folder` (the user's files there are not counted)."""
    return sum(held for _, held, _ in _owned_files(folder, _read_ledger(folder))[0]) if folder.is_dir() else 0


@dataclass(frozen=True)
class LocalCopies:
    """Whole copies of remote shards in `folder`, at most `limit` bytes of them. A copy is named by the object and
    its ETag (a replaced object is never read from an old copy), written beside its name and renamed (a reader sees
    all of it or none), and the folder's size is kept under a lock, so two runs on one machine share it. A copy
    another run still reads may be removed to make room: its open descriptors keep reading it."""

    folder: Path
    limit: int

    def path(self, url: str, version: str) -> Path:
        return self.folder / _copy_name(url, version)

    def make_room(self, size: int, keep: set[Path], reserve: Path | None = None) -> bool:
        """Whether `size` more bytes fit, after removing the least recently written copies not in `keep`; when they
        do, `reserve` is made a file of that size under the same lock, so that two runs filling the folder at once
        count each other's copies in full before they are written (and meanwhile twice: on the safe side). Only
        what the ledger names is counted or removed: the folder may hold the user's own files."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            owned = _read_ledger(self.folder)
            copies, used, present = _owned_files(self.folder, owned)
            copies.sort()
            for _, held, path in copies:
                if used + size <= self.limit:
                    break
                if path not in keep:
                    path.unlink(missing_ok=True)
                    present.discard(path.name)
                    used -= held
            fits = used + size <= self.limit
            if fits and reserve is not None:
                present.add(_owner_of(reserve.name) or reserve.name)  # the copy about to be written is ours
                with open(reserve, "wb") as held_room:
                    held_room.truncate(size)  # sparse: it takes no disk, only its place in the count
            if present != owned:
                _write_ledger(self.folder, present)
            return fits

    def fill(self, shards: list[tuple[str, str, int]], keep_going: Callable[[], bool]) -> None:
        """Copy each (url, version, size) in turn while it fits and `keep_going()`; the first that does not fit
        ends the filling (later epochs then read the rest remotely)."""
        wanted = {self.path(url, version) for url, version, _ in shards}
        for url, version, size in shards:
            target = self.path(url, version)
            if target.exists():
                continue
            reserve = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.reserve")
            if not keep_going() or not self.make_room(size, wanted, reserve):
                return
            try:
                download(url, Version(size, version), target, keep_going)
            except ValueError as error:
                log.warning("could not copy %s into %s (%s): it is read remotely", url, self.folder, error)
            finally:
                reserve.unlink(missing_ok=True)


CLOSE_WAIT_S = 5.0


class CopyFiller:
    """Copies a run's remote shards into the local cache in a thread of the driving process, so later epochs read
    them from disk; `close()` (idempotent) stops it between two chunks."""

    def __init__(self, copies: LocalCopies, shards: list[tuple[str, str, int]]) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=copies.fill, args=(shards, lambda: not self._stop.is_set()),
                                        name="stoker-cache-fill", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop between two chunks; a chunk that hangs is left to the daemon thread (its client times it out)."""
        self._stop.set()
        self._thread.join(timeout=CLOSE_WAIT_S)


class _Copy:
    def __init__(self, path: Path) -> None:
        self.path, self.fd = path, os.open(path, os.O_RDONLY)

    def read(self, start: int, size: int) -> bytes:
        try:
            data = os.pread(self.fd, size, start)
        except OSError as error:
            raise UnusableImage(f"{UNREADABLE} the local copy {self.path}: {error.strerror or error}") from None
        if len(data) != size:
            raise UnusableImage(f"the local copy {self.path} is shorter than its index")
        return data

    def __del__(self) -> None:  # the last reader's reference closes it: never under a read in another thread
        if hasattr(self, "fd"):
            os.close(self.fd)


_copies: dict[Path, _Copy] = {}
_copies_lock = threading.Lock()  # the read-ahead threads look copies up together
MAX_OPEN_COPIES = 128


def _local_copy(copies: LocalCopies, url: str, version: str) -> _Copy | None:
    """The whole local copy of the object, once one is complete in the cache folder; None until then."""
    path = copies.path(url, version)
    with _copies_lock:
        copy = _copies.get(path)
        if copy is None:
            try:
                copy = _Copy(path)
            except OSError:
                return None
            if len(_copies) >= MAX_OPEN_COPIES:
                _copies.clear()  # each closes once no thread holds it
            _copies[path] = copy
    return copy

"""A process's ranged reads of samples: libcurl's multi interface, driven by one thread.

A sample in a remote shard is one ranged GET of a few KB, and a producer keeps dozens of them in flight to hide
the round trip. What each one costs in CPU is taken from the cores that decode images. Measured here on 3,000
reads of 2.5 KB from nginx on loopback, 32 in flight: obstore's `get` from 32 threads 107-123 us of CPU a read,
libcurl's easy handles from 32 threads 123 us, obstore's `get_async` under asyncio 190-213 us, and libcurl's multi
interface from one thread 20-23 us. The threads' hand-offs cost more than the requests.

S3 and GCS objects are read through URLs their store signs (obstore's `sign`, an hour at a time, signed again ten
minutes before that ends); the signature sits in the query string, so a range and an If-Match header can be added.
A store that cannot sign (no credentials to sign with, or a kind obstore does not sign for) is read through obstore
as before (`remote.read_range`). Errors name the object as the user gave it, never a signed URL.

Every request asks If-Match on the ETag the index was made from; 412 means the object changed. A request that
fails (no answer within REQUEST_TIMEOUT_S, a dropped connection, 5xx, 408, 429) is tried again after a back-off, at
most RETRIES times and none starting after RETRY_WINDOW_S: at worst 14 s, inside the default producer timeout.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import os
import select
import ssl
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import pycurl

from stoker.common import faults
from stoker.data.imaging import UNREADABLE, UnusableImage

IN_FLIGHT = 64  # requests at once per process: a part's samples wait one round trip, not one each
REQUEST_TIMEOUT_S = 4.0
CONNECT_TIMEOUT_S = 3.0
RETRIES = 3
RETRY_WINDOW_S = 8.0  # no retry starts later: the last may take its 4 s and a back-off of 2 s before it, 14 s at worst
FIRST_BACKOFF_S, LAST_BACKOFF_S = 0.2, 2.0
ACTIVE_POLL_S = 0.05  # the longest wait while requests are out (libcurl's sockets past 1024 are not waited on)
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


@dataclass
class Read:
    """One member's bytes: `size` at `start` of `name` (the object as the user named it), asked at `url` (the same,
    or a signed URL of it) with If-Match `etag` where that is a strong ETag."""

    name: str
    url: str
    etag: str
    start: int
    size: int
    future: Future[bytes] = field(default_factory=Future)
    tries: int = 0
    first_sent: float = 0.0
    body: bytearray = field(default_factory=bytearray)


class RangeClient:
    """Sends each `submit`ted read when it is due and settles its future with the bytes or an UnusableImage.

    One thread owns the libcurl handles: it waits on their sockets and on a pipe that `submit` writes to, so a
    read submitted while others are out goes at once, and an idle client takes no CPU. `close()` (idempotent)
    stops the thread and fails what was not settled."""

    def __init__(self) -> None:
        self._multi = pycurl.CurlMulti()
        self._multi.setopt(pycurl.M_MAXCONNECTS, IN_FLIGHT)
        self._free = [_new_handle() for _ in range(IN_FLIGHT)]
        self._active: dict[pycurl.Curl, Read] = {}
        self._submitted: deque[tuple[float, Read]] = deque()  # appended by any thread, taken by the client's
        self._due: list[tuple[float, int, Read]] = []  # (when, tiebreak, read): the wait a retry or latency adds
        self._order = itertools.count()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self.failure: BaseException | None = None  # what stopped the thread, when something did
        self._thread = threading.Thread(target=self._run, name="stoker-ranges", daemon=True)
        self._thread.start()

    def submit(self, name: str, url: str, etag: str, start: int, size: int) -> Future[bytes]:
        return self.submit_all([(name, url, etag, start, size)])[0]

    def submit_all(self, wanted: list[tuple[str, str, str, int, int]]) -> list[Future[bytes]]:
        """Futures of each (name, url, etag, start, size), sent together: one wake-up of the client's thread."""
        reads = [Read(*each) for each in wanted]
        # A stand-in for a network's round trip (STOKER_READ_LATENCY_MS): the request waits before it goes out.
        due = time.monotonic() + faults.delay_s(faults.READ_LATENCY_ENV)
        with self._lock:  # never added after the thread's last look: that read would wait for ever
            if self._closed.is_set():
                for read in reads:
                    read.future.set_exception(UnusableImage(f"{UNREADABLE} {read.name}: the reads of this process "
                                                            f"stopped"))
                return [read.future for read in reads]
            self._submitted.extend((due, read) for read in reads)
        self._wake()
        return [read.future for read in reads]

    def close(self) -> None:
        if self._closed.is_set():
            return
        with self._lock:
            self._closed.set()
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=REQUEST_TIMEOUT_S)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"\0")
        except BlockingIOError:  # the pipe is full of wake-ups already
            pass

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                self._take_submitted()
                self._send_due()
                self._drive()
                self._wait()
        except BaseException as error:  # noqa: BLE001 (carried to every read still waiting, never lost)
            self.failure = error
        finally:
            with self._lock:
                self._closed.set()
            self._fail_unsettled()
            for handle in self._active:
                self._multi.remove_handle(handle)
            for handle in [*self._active, *self._free]:
                handle.close()
            self._multi.close()

    def __del__(self) -> None:  # not at the thread's end: a `submit` may still be waking it
        for fd in (getattr(self, "_wake_read", None), getattr(self, "_wake_write", None)):
            if fd is not None:
                os.close(fd)

    def _take_submitted(self) -> None:
        while self._submitted:
            when, read = self._submitted.popleft()
            heapq.heappush(self._due, (when, next(self._order), read))

    def _send_due(self) -> None:
        now = time.monotonic()
        while self._free and self._due and self._due[0][0] <= now:
            read = heapq.heappop(self._due)[2]
            if read.future.cancelled():
                continue
            if read.tries == 0:
                read.first_sent = now
            read.tries += 1
            read.body = bytearray()
            handle = self._free.pop()
            handle.setopt(pycurl.URL, read.url)
            handle.setopt(pycurl.RANGE, f"{read.start}-{read.start + read.size - 1}")
            handle.setopt(pycurl.HTTPHEADER, [f"If-Match: {read.etag}"] if read.etag.startswith('"') else [])
            handle.setopt(pycurl.WRITEFUNCTION, read.body.extend)
            self._active[handle] = read
            self._multi.add_handle(handle)

    def _drive(self) -> None:
        while self._multi.perform()[0] == pycurl.E_CALL_MULTI_PERFORM:
            pass
        while True:
            queued, done, failed = self._multi.info_read()
            for handle in done:
                self._finish(handle, None)
            for handle, _code, message in failed:
                self._finish(handle, message)
            if not queued:
                return

    def _finish(self, handle: pycurl.Curl, transport_error: str | None) -> None:
        self._multi.remove_handle(handle)
        read = self._active.pop(handle)
        status = handle.getinfo(pycurl.RESPONSE_CODE) if transport_error is None else 0
        self._free.append(handle)
        if read.future.cancelled():
            return
        if status in (200, 206):
            data = bytes(read.body if status == 206 else read.body[read.start:read.start + read.size])
            if len(data) == read.size:
                read.future.set_result(data)
            else:
                read.future.set_exception(UnusableImage(f"{read.name} is shorter than its index (changed during the "
                                                        f"run?)"))
            return
        retry_at = time.monotonic() + min(LAST_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (read.tries - 1))
        retryable = transport_error is not None or status in RETRYABLE_STATUS
        if retryable and read.tries <= RETRIES and retry_at - read.first_sent <= RETRY_WINDOW_S:
            heapq.heappush(self._due, (retry_at, next(self._order), read))
            return
        read.future.set_exception(UnusableImage(_refusal(read, status, transport_error)))

    def _wait(self) -> None:
        """Until a socket of a request is ready, libcurl's own deadline, the next read's due time (when a handle is
        free to send it) or a wake-up."""
        if self._submitted:
            return
        timeout = self._due[0][0] - time.monotonic() if self._due and self._free else None
        if self._active:
            libcurl_s = self._multi.timeout() / 1000
            libcurl_s = ACTIVE_POLL_S if libcurl_s < 0 else min(libcurl_s, ACTIVE_POLL_S)
            timeout = libcurl_s if timeout is None else min(timeout, libcurl_s)
        wanted = {self._wake_read: select.POLLIN}
        reading, writing, errors = self._multi.fdset()
        for events, fds in ((select.POLLIN, reading), (select.POLLOUT, writing), (select.POLLPRI, errors)):
            for fd in fds:
                wanted[fd] = wanted.get(fd, 0) | events
        # poll, not select: a wake pipe past descriptor 1024 (a process holding many files) is no error. libcurl's
        # fdset leaves its sockets past 1024 out; those are driven by its deadline (at most ACTIVE_POLL_S apart).
        sockets = select.poll()
        for fd, events in wanted.items():
            sockets.register(fd, events)
        sockets.poll(None if timeout is None else max(0, math.ceil(timeout * 1000)))
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass

    def _fail_unsettled(self) -> None:
        self._take_submitted()
        reason = f"the reads of this process stopped ({self.failure!r})" if self.failure else \
            "the reads of this process stopped"
        for read in [*self._active.values(), *(entry[2] for entry in self._due)]:
            if not read.future.done():
                read.future.set_exception(UnusableImage(f"{UNREADABLE} {read.name}: {reason}"))
        self._due.clear()


def _refusal(read: Read, status: int, transport_error: str | None) -> str:
    if status == 412:
        return (f"{read.name} changed during the run (its ETag is no longer {read.etag}): the index no longer "
                f"describes it; start again to index it anew")
    if status in (404, 410):
        return f"{UNREADABLE} {read.name} no longer exists"
    if status == 416:
        return f"{read.name} is shorter than its index (changed during the run?)"
    reason = transport_error or f"HTTP status {status}"
    retries = f" (after {read.tries - 1} retries)" if read.tries > 1 else ""
    return f"{UNREADABLE} {read.name}: {reason}{retries}"


def _new_handle() -> pycurl.Curl:
    handle = pycurl.Curl()
    handle.setopt(pycurl.NOSIGNAL, 1)  # threads: no SIGALRM for timeouts
    handle.setopt(pycurl.TIMEOUT_MS, int(REQUEST_TIMEOUT_S * 1000))
    handle.setopt(pycurl.CONNECTTIMEOUT_MS, int(CONNECT_TIMEOUT_S * 1000))
    handle.setopt(pycurl.FOLLOWLOCATION, 1)
    handle.setopt(pycurl.MAXREDIRS, 5)
    ca_file, ca_folder = _trusted_roots()
    if ca_file:
        handle.setopt(pycurl.CAINFO, ca_file)
    if ca_folder:
        handle.setopt(pycurl.CAPATH, ca_folder)
    return handle


@functools.cache
def _trusted_roots() -> tuple[str | None, str | None]:
    """The certificates this system trusts: libcurl's wheel carries its own default path, which another
    distribution may not have (CURL_CA_BUNDLE and SSL_CERT_FILE, where set, say where they are)."""
    paths = ssl.get_default_verify_paths()
    files = [os.environ.get("CURL_CA_BUNDLE"), os.environ.get("SSL_CERT_FILE"), paths.cafile, paths.openssl_cafile]
    folders = [os.environ.get("SSL_CERT_DIR"), paths.capath, paths.openssl_capath]
    return (next((f for f in files if f and os.path.isfile(f)), None),
            next((d for d in folders if d and os.path.isdir(d)), None))


_client: tuple[int, RangeClient] | None = None
_client_lock = threading.Lock()


def client() -> RangeClient:
    """This process's client (a fork's child makes its own: the parent's thread does not survive the fork)."""
    global _client
    with _client_lock:
        if _client is None or _client[0] != os.getpid() or _client[1].closed:
            _client = (os.getpid(), RangeClient())
        return _client[1]


def stop() -> None:
    """Stop this process's client, failing the reads not settled (a producer that stops waits for none of them)."""
    global _client
    with _client_lock:
        held, _client = _client, None
    if held is not None and held[0] == os.getpid():
        held[1].close()


def settled(data: bytes | BaseException) -> Future[bytes]:
    """A future already holding `data` (or raising it)."""
    future: Future[bytes] = Future()
    if isinstance(data, BaseException):
        future.set_exception(data)
    else:
        future.set_result(data)
    return future


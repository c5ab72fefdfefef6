"""A process's ranged reads of samples: libcurl's multi interface, driven by one thread.

A sample in a remote shard is one ranged GET of a few KB, dozens in flight per producer, and each read's CPU comes
from the cores that decode images: one thread driving every request, with no hand-off per request, costs a third of
obstore's threads (docs/benchmarks.md, remote shards). Every read asks If-Match on the ETag the index was made from,
is retried with back-off and is settled within READ_DEADLINE_S of its submission, inside the default producer
timeout; signed URLs come from `object_store.py`. Details: docs/data.md, "Remote shards"."""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import math
import os
import select
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stoker.common import faults
from stoker.common.lazy import LazyModule
from stoker.data.pixels.imaging import UNREADABLE, UnusableImage

if TYPE_CHECKING:
    import pycurl
else:  # imported at the first remote read: a run on local files needs no pycurl
    pycurl = LazyModule("pycurl", "reading samples from a remote source")

log = logging.getLogger(__name__)

IN_FLIGHT = 64  # requests at once per process: a part's samples wait one round trip, not one each
REQUEST_TIMEOUT_S = 4.0
CONNECT_TIMEOUT_S = 3.0
RETRIES = 3
FIRST_BACKOFF_S, LAST_BACKOFF_S = 0.2, 2.0
READ_DEADLINE_S = 14.0  # from submission to an answer or a refusal, queueing and retries included
SWEEP_S = 0.5  # how often reads still queued are checked against their deadline
DEADLINE_MARGIN_S = 0.05  # a request that fails this close to its read's deadline ran out of it
ACTIVE_POLL_S = 0.05  # the longest wait while requests are out (libcurl's sockets past 1024 are not waited on)
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
RESIGN_STATUS = frozenset({400, 403})  # a signed URL whose credentials ended (S3 answers 400 or 403)
TOO_LARGE = 63  # CURLE_FILESIZE_EXCEEDED (pycurl.E_FILESIZE_EXCEEDED), a constant of libcurl's ABI
SignAgain = Callable[[str], "str | None"]  # an object's name -> a freshly signed URL of it (None: cannot)


@dataclass(eq=False)  # each read is itself: kept in a set while its URL is signed again
class Read:
    """One member's bytes: `size` at `start` of `name` (the object as the user named it), asked at `url` (the same,
    or a signed URL of it, which `sign_again` renews) with If-Match `etag` where that is a strong ETag."""

    name: str
    url: str
    etag: str
    start: int
    size: int
    deadline: float
    sign_again: SignAgain | None = None
    future: Future[bytes] = field(default_factory=Future)
    tries: int = 0
    signed_again: bool = False
    body: bytearray = field(default_factory=bytearray)

    def fail(self, message: str) -> None:
        if not self.future.done():
            self.future.set_exception(UnusableImage(message))


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
        self._next_sweep = 0.0
        self._signing: set[Read] = set()  # reads whose URL is being signed again (in threads of their own)
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self.failure: BaseException | None = None  # what stopped the thread, when something did
        self._thread = threading.Thread(target=self._run, name="stoker-ranges", daemon=True)
        self._thread.start()

    def submit(self, name: str, url: str, etag: str, start: int, size: int,
               sign_again: SignAgain | None = None) -> Future[bytes]:
        return self.submit_all([(name, url, etag, start, size, sign_again)])[0]

    def submit_all(self, wanted: list[tuple[str, str, str, int, int, SignAgain | None]]) -> list[Future[bytes]]:
        """Futures of each (name, url, etag, start, size, sign_again), sent together: one wake-up of the client's
        thread."""
        now = time.monotonic()
        reads = [Read(*each[:5], deadline=now + READ_DEADLINE_S, sign_again=each[5]) for each in wanted]
        # A stand-in for a network's round trip (STOKER_READ_LATENCY_MS): the request waits before it goes out.
        due = now + faults.delay_s(faults.READ_LATENCY_ENV)
        with self._lock:  # never added after the thread's last look: that read would wait for ever
            if self._closed.is_set():
                for read in reads:
                    read.fail(f"{UNREADABLE} {read.name}: the reads of this process stopped")
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
                self._expire_queued()
                self._send_due()
                self._drive()
                self._wait()
        except BaseException as error:  # noqa: BLE001 (carried to every read still waiting, never lost)
            self.failure = error
            log.exception("the ranged reads' thread stopped: the reads it held fail, a new client takes the next")
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

    def _expire_queued(self) -> None:
        """Fail the queued reads past their deadline (every SWEEP_S: those waiting for a free handle too)."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_S
        with self._lock:
            for read in [read for read in self._signing if read.deadline <= now]:
                read.fail(_late(read))
                self._signing.discard(read)
        expired = [entry for entry in self._due if entry[2].deadline <= now]
        if expired:
            for _, _, read in expired:
                read.fail(_late(read))
            self._due = [entry for entry in self._due if entry[2].deadline > now]
            heapq.heapify(self._due)

    def _send_due(self) -> None:
        now = time.monotonic()
        while self._free and self._due and self._due[0][0] <= now:
            read = heapq.heappop(self._due)[2]
            if read.future.done():  # cancelled
                continue
            if read.deadline <= now:
                read.fail(_late(read))
                continue
            handle = self._free.pop()
            try:
                _prepare(handle, read, read.deadline - now)
            except Exception as error:  # noqa: BLE001 (libcurl refused this read's options: this read alone fails)
                self._free.append(handle)
                read.fail(f"{UNREADABLE} {read.name}: cannot be requested ({type(error).__name__})")
                continue
            self._active[handle] = read
            self._multi.add_handle(handle)

    def _drive(self) -> None:
        while self._multi.perform()[0] == pycurl.E_CALL_MULTI_PERFORM:
            pass
        while True:
            queued, done, failed = self._multi.info_read()
            for handle in done:
                self._finish(handle, None)
            for handle, code, message in failed:
                self._finish(handle, (code, message))
            if not queued:
                return

    def _finish(self, handle: pycurl.Curl, transport_error: tuple[int, str] | None) -> None:
        self._multi.remove_handle(handle)
        read = self._active.pop(handle)
        status = handle.getinfo(pycurl.RESPONSE_CODE)  # 0 when no answer came
        self._free.append(handle)
        if read.future.done():
            return
        if transport_error is not None and transport_error[0] == TOO_LARGE and status not in (200, 206):
            transport_error = None  # an error's body longer than the range: the status says what happened
        elif transport_error is not None:
            status = 0
        if status in (200, 206):
            if len(read.body) == read.size:
                read.future.set_result(bytes(read.body))
            else:
                read.fail(shorter(read.name))
            return
        now = time.monotonic()
        if status in RESIGN_STATUS and read.sign_again is not None and not read.signed_again:
            read.signed_again = True
            with self._lock:
                self._signing.add(read)  # the sweep fails it at its deadline, should signing take longer
            threading.Thread(target=self._sign_again, args=(read, status), name="stoker-sign", daemon=True).start()
            return
        if transport_error is not None and now >= read.deadline - DEADLINE_MARGIN_S:
            read.fail(_late(read))  # its timeout was what was left of the deadline
            return
        retry_at = now + min(LAST_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (read.tries - 1))
        retryable = status in RETRYABLE_STATUS or (transport_error is not None and transport_error[0] != TOO_LARGE)
        if retryable and read.tries <= RETRIES and retry_at < read.deadline:
            heapq.heappush(self._due, (retry_at, next(self._order), read))
            return
        read.fail(_refusal(read, status, transport_error))

    def _sign_again(self, read: Read, status: int) -> None:
        """In a thread of its own: signing may wait on a credentials service, and the client's thread serves every
        other read meanwhile."""
        assert read.sign_again is not None
        try:
            signed = read.sign_again(read.name)
        except Exception:  # noqa: BLE001 (the read fails with the refusal it had)
            signed = None
        with self._lock:
            self._signing.discard(read)
            if signed is None or self._closed.is_set():
                read.fail(f"{UNREADABLE} {read.name}: HTTP status {status}, and its URL could not be signed again")
                return
            read.url = signed
            self._submitted.append((time.monotonic(), read))
        self._wake()

    def _wait(self) -> None:
        """Until a socket of a request is ready, libcurl's own deadline, the next read's due time (when a handle is
        free to send it) or a wake-up."""
        if self._submitted:
            return
        timeout = self._due[0][0] - time.monotonic() if self._due and self._free else None
        if self._due:  # reads queued: their deadline is checked every SWEEP_S
            timeout = SWEEP_S if timeout is None else min(timeout, SWEEP_S)
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
        reason = "the reads of this process stopped"
        if self.failure is not None:
            reason += f" ({type(self.failure).__name__})"  # not its text: it may hold a signed URL
        with self._lock:
            signing, self._signing = list(self._signing), set()
        for read in [*self._active.values(), *(entry[2] for entry in self._due), *signing]:
            read.fail(f"{UNREADABLE} {read.name}: {reason}")
        self._due.clear()


def _prepare(handle: pycurl.Curl, read: Read, time_left: float) -> None:
    read.tries += 1
    read.body = bytearray()
    handle.setopt(pycurl.URL, read.url)
    handle.setopt(pycurl.RANGE, f"{read.start}-{read.start + read.size - 1}")
    if read.etag.startswith('"'):
        handle.setopt(pycurl.HTTPHEADER, [f"If-Match: {read.etag}"])
    else:
        handle.unsetopt(pycurl.HTTPHEADER)  # setopt with [] keeps a reused handle's last headers
    handle.setopt(pycurl.WRITEFUNCTION, read.body.extend)
    # A server that ignores Range answers with the whole object: refused before its body comes, not buffered.
    handle.setopt(pycurl.MAXFILESIZE_LARGE, read.size)
    handle.setopt(pycurl.TIMEOUT_MS, max(1, int(1000 * min(REQUEST_TIMEOUT_S, time_left))))


def _late(read: Read) -> str:
    tried = f" (tried {read.tries} times)" if read.tries else " (still queued behind other reads)"
    return f"{UNREADABLE} {read.name}: no answer within {READ_DEADLINE_S:g} s{tried}"


def changed(name: str, etag: str) -> str:
    """Why a member of an object replaced since it was indexed is not read (obstore's reads say it too)."""
    return f"{name} changed during the run (its ETag is no longer {etag}): the index no longer describes it; start " \
           "again to index it anew"


def gone(name: str) -> str:
    return f"{UNREADABLE} {name} no longer exists"


def shorter(name: str) -> str:
    return f"{name} is shorter than its index (changed during the run?)"


def _refusal(read: Read, status: int, transport_error: tuple[int, str] | None) -> str:
    if status == 412:
        return changed(read.name, read.etag)
    if status in (404, 410):
        return gone(read.name)
    if status == 416:
        return shorter(read.name)
    if transport_error is not None and transport_error[0] == TOO_LARGE:
        return f"{UNREADABLE} {read.name}: the server answered a range with more bytes (does it ignore Range?)"
    if transport_error is not None:
        reason = transport_error[1].replace(read.url, read.name).split("?X-")[0]  # never a signature
    else:
        reason = f"HTTP status {status}" + (" (signed again, still refused)" if read.signed_again else "")
    retries = f" (after {read.tries - 1} retries)" if read.tries > 1 else ""
    return f"{UNREADABLE} {read.name}: {reason}{retries}"


def _new_handle() -> pycurl.Curl:
    handle = pycurl.Curl()
    handle.setopt(pycurl.NOSIGNAL, 1)  # threads: no SIGALRM for timeouts
    handle.setopt(pycurl.CONNECTTIMEOUT_MS, int(CONNECT_TIMEOUT_S * 1000))
    handle.setopt(pycurl.FOLLOWLOCATION, 1)
    handle.setopt(pycurl.MAXREDIRS, 5)
    handle.setopt(pycurl.PROTOCOLS, pycurl.PROTO_HTTP | pycurl.PROTO_HTTPS)  # a redirect never leaves HTTP(S)
    handle.setopt(pycurl.REDIR_PROTOCOLS, pycurl.PROTO_HTTP | pycurl.PROTO_HTTPS)
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


_client: RangeClient | None = None  # this process's (a forked child starts with none: see below)
_client_lock = threading.Lock()
_inherited: list[RangeClient] = []  # a parent's clients in a forked child: never freed there (see below)


def _after_fork_in_child() -> None:
    """A forked child keeps its parent's client object, never freeing it: freeing its handles would close
    connections it shares with the parent (a TLS close written into the parent's stream). Its lock is new: the
    parent may have held it as it forked."""
    global _client, _client_lock
    if _client is not None:
        _inherited.append(_client)
    _client, _client_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def client() -> RangeClient:
    """This process's client (a fork's child makes its own: the parent's thread does not survive the fork)."""
    global _client
    with _client_lock:
        if _client is None or _client.closed:
            _client = RangeClient()
        return _client


def stop() -> None:
    """Stop this process's client, failing the reads not settled (a producer that stops waits for none of them)."""
    global _client
    with _client_lock:
        held, _client = _client, None
    if held is not None:
        held.close()


def settled(data: bytes | BaseException) -> Future[bytes]:
    """A future already holding `data` (or raising it)."""
    future: Future[bytes] = Future()
    if isinstance(data, BaseException):
        future.set_exception(data)
    else:
        future.set_result(data)
    return future


"""The ranged reads' client (stoker/data/transports/ranges.py) against a real HTTP server on loopback: Python's
own, made to answer as a flaky or changed object would. Bytes, retries and refusals are checked against what the
server saw."""

from __future__ import annotations

import http.server
import os
from collections.abc import Iterator

import pytest

from stoker.data.pixels.imaging import UNREADABLE, UnusableImage
from stoker.data.transports import ranges
from tests.conftest import serving, silent_server

OBJECT = os.urandom(64 << 10)
ETAG = '"v1"'


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # kept-alive connections, as nginx and S3 give
    failures_left: dict[str, int] = {}
    seen: list[tuple[str, str | None, str | None]] = []

    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        self.seen.append((self.path, self.headers.get("Range"), self.headers.get("If-Match")))
        if self.failures_left.get(self.path, 0) > 0:
            self.failures_left[self.path] -= 1
            return self._answer(503, b"busy")
        if self.path == "/gone":  # errors come with bodies longer than the ranges asked, as S3's do
            return self._answer(404, b"<Error><Code>NoSuchKey</Code>" + b" " * 300 + b"</Error>")
        if self.path == "/expired":  # a signed URL whose credentials ended
            return self._answer(403, b"<Error><Code>ExpiredToken</Code></Error>")
        if self.path == "/whole":  # a server that ignores Range
            return self._answer(200, OBJECT)
        if self.headers.get("If-Match") not in (None, ETAG):
            return self._answer(412, b"<Error><Code>PreconditionFailed</Code>" + b" " * 300 + b"</Error>")
        first, last = (int(v) for v in self.headers["Range"].removeprefix("bytes=").split("-"))
        self._answer(206, OBJECT[first:last + 1])

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Handler.failures_left, _Handler.seen = {}, []
    try:
        with serving(_Handler) as url:
            yield url
    finally:
        ranges.stop()


def test_more_reads_than_requests_in_flight_all_get_their_bytes(server):
    """Three times as many reads as the client sends at once, each its own range, If-Match the ETag."""
    client = ranges.client()
    wanted = [(start, 1 + start % 700) for start in range(0, 3 * ranges.IN_FLIGHT * 97, 97)]
    futures = [client.submit(f"{server}/object", f"{server}/object", ETAG, start, size) for start, size in wanted]
    assert [future.result(timeout=60) for future in futures] == [OBJECT[s:s + n] for s, n in wanted]
    assert {(r, m) for _, r, m in _Handler.seen} == {(f"bytes={s}-{s + n - 1}", ETAG) for s, n in wanted}


def test_a_busy_server_is_asked_again_and_a_refusal_is_not(server):
    """503 twice, then the bytes; a 404 is final at once and a 412 names the change; the name given is the one
    errors use."""
    _Handler.failures_left["/object"] = 2
    client = ranges.client()
    assert client.submit("s3://bucket/object", f"{server}/object", ETAG, 10, 20).result(timeout=60) == OBJECT[10:30]
    assert [path for path, _, _ in _Handler.seen] == ["/object"] * 3
    with pytest.raises(UnusableImage, match=f"{UNREADABLE} s3://bucket/gone no longer exists"):
        client.submit("s3://bucket/gone", f"{server}/gone", ETAG, 0, 10).result(timeout=60)
    assert [path for path, _, _ in _Handler.seen].count("/gone") == 1
    with pytest.raises(UnusableImage, match=r"s3://bucket/object changed during the run"):
        client.submit("s3://bucket/object", f"{server}/object", '"v0"', 0, 10).result(timeout=60)


def test_a_server_busy_for_ever_makes_the_read_unreadable_after_the_retries(server):
    _Handler.failures_left["/object"] = 100
    with pytest.raises(UnusableImage, match=rf"{UNREADABLE} .*HTTP status 503 \(after {ranges.RETRIES} retries\)"):
        ranges.client().submit(f"{server}/object", f"{server}/object", ETAG, 0, 10).result(timeout=60)
    assert len(_Handler.seen) == ranges.RETRIES + 1


def test_reads_still_out_when_the_client_stops_fail_instead_of_waiting(server):
    """A producer that stops waits for none of its reads: those not answered fail, and a read submitted after the
    stop fails at once."""
    os.environ["STOKER_READ_LATENCY_MS"] = "60000"  # each request waits a minute before it goes out
    try:
        client = ranges.client()
        pending = client.submit(f"{server}/object", f"{server}/object", ETAG, 0, 10)
    finally:
        del os.environ["STOKER_READ_LATENCY_MS"]
    ranges.stop()
    with pytest.raises(UnusableImage, match="stopped"):
        pending.result(timeout=30)
    with pytest.raises(UnusableImage, match="stopped"):
        client.submit(f"{server}/object", f"{server}/object", ETAG, 0, 10).result(timeout=30)
    assert _Handler.seen == []


def test_a_handle_used_again_sends_no_stale_if_match(server):
    """A read of an object without a strong ETag (a weak one, or size and date) after one with: no If-Match."""
    client = ranges.client()
    assert client.submit("a", f"{server}/object", ETAG, 0, 10).result(timeout=60) == OBJECT[:10]
    assert client.submit("b", f"{server}/object", 'W/"v9"', 5, 10).result(timeout=60) == OBJECT[5:15]
    assert client.submit("c", f"{server}/object", "65536@2026", 7, 10).result(timeout=60) == OBJECT[7:17]
    assert [match for _, _, match in _Handler.seen] == [ETAG, None, None]


def test_a_server_that_ignores_range_is_refused_not_buffered(server):
    with pytest.raises(UnusableImage, match="ignore Range"):
        ranges.client().submit("whole", f"{server}/whole", ETAG, 0, 10).result(timeout=60)
    assert len(_Handler.seen) == 1


def test_a_refused_signed_url_is_signed_again_once(server):
    """403 from a signed URL: signed again and asked once more; refused again, it is not signed a third time."""
    signed: list[str] = []

    def sign_again(name: str) -> str:
        signed.append(name)
        return f"{server}/object?signature=new"

    data = ranges.client().submit("s3://b/object", f"{server}/expired", ETAG, 3, 9, sign_again).result(timeout=60)
    assert data == OBJECT[3:12] and signed == ["s3://b/object"]
    with pytest.raises(UnusableImage, match=r"s3://b/object: HTTP status 403 \(signed again, still refused\)"):
        ranges.client().submit("s3://b/object", f"{server}/expired", ETAG, 3, 9,
                               lambda name: f"{server}/expired").result(timeout=60)


def test_a_url_with_spaces_and_accents_is_escaped_once(server):
    from stoker.data.transports import object_store

    assert object_store.read_range(f"{server}/a folder/données%2B.tar", ETAG, 4, 6) == OBJECT[4:10]
    assert _Handler.seen[0][0] == "/a%20folder/donn%C3%A9es%2B.tar"


def test_reads_queued_behind_a_server_that_never_answers_fail_at_their_deadline(monkeypatch):
    """Three times the requests a client sends at once, to a server that takes connections and never answers: every
    read fails by its deadline (shortened here to 1.5 s, each request's own timeout lengthened to 10 minutes), those
    still queued too, instead of waiting for a request's timeout or rounds of them."""
    monkeypatch.setattr(ranges, "READ_DEADLINE_S", 1.5)
    monkeypatch.setattr(ranges, "REQUEST_TIMEOUT_S", 600.0)
    with silent_server() as port:
        url = f"http://127.0.0.1:{port}/object"
        try:
            futures = [ranges.client().submit(url, url, ETAG, i, 10) for i in range(3 * ranges.IN_FLIGHT)]
            messages, ended = [], f"{UNREADABLE} .*(no answer within 1.5 s|timed out|timeout)"
            for future in futures:
                with pytest.raises(UnusableImage, match=ended) as error:
                    future.result(timeout=120)  # a fifth of the request's timeout: only the deadline ends it sooner
                messages.append(str(error.value))
            assert any("still queued" in message for message in messages)
        finally:
            ranges.stop()

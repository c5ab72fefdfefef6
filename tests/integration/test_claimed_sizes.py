"""Sizes a server or a file claims, against a real HTTP server on loopback (Python's own) that lies: a shard whose
body never ends, a pack index that claims a member of a gigabyte. What stoker reads or writes is bounded by what it
checked, not by what it is sent."""

from __future__ import annotations

import http.server
import io
import json
import tarfile
from collections.abc import Iterator

import pytest

from stoker.data.transports import object_store
from tests.conftest import serving

CLAIMED = 160 << 10  # what HEAD says the shard holds
ENDLESS_CAP = 256 << 20  # the server gives up after this much (an old client took all of it)
HUGE = 1 << 30


def _tar(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


class _Liar(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    files: dict[str, bytes] = {}
    sizes: dict[str, int] = {}  # what HEAD claims, where it is not the file's size
    sent = 0  # bytes of the endless body written before the client hung up

    def do_HEAD(self) -> None:  # noqa: N802 (the standard library's name)
        size = self.sizes.get(self.path, len(self.files.get(self.path, b"")))
        if self.path not in self.files and self.path not in self.sizes:
            return self._head(404, 0)
        self._head(200, size)

    def _head(self, status: int, size: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(size))
        self.send_header("ETag", '"v1"')
        self.send_header("Last-Modified", "Sun, 06 Dec 2026 00:00:00 GMT")
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/endless.tar":  # a terabyte, it says: the body goes on until the client hangs up
            self.send_response(200)
            self.send_header("ETag", '"v1"')
            self.send_header("Content-Length", str(1 << 40))
            self.send_header("Connection", "close")
            self.end_headers()
            block = b"\0" * (64 << 10)
            try:
                while _Liar.sent < ENDLESS_CAP:
                    self.wfile.write(block)
                    _Liar.sent += len(block)
            except OSError:  # the client hung up
                pass
            self.close_connection = True
            return
        data = self.files.get(self.path)
        if data is None:
            return self._answer(404, b"not here")
        wanted = self.headers.get("Range")
        if wanted:
            first, last = (int(v) for v in wanted.removeprefix("bytes=").split("-"))
            return self._answer(206, data[first:last + 1], f"bytes {first}-{last}/{len(data)}")
        self._answer(200, data)

    def _answer(self, status: int, body: bytes, content_range: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", '"v1"')
        if content_range:
            self.send_header("Content-Range", content_range)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def liar() -> Iterator[str]:
    _Liar.files, _Liar.sizes, _Liar.sent = {}, {}, 0
    try:
        with serving(_Liar) as url:
            yield url
    finally:
        object_store.stop_reading()


def test_a_shard_body_longer_than_its_head_is_cut_off_at_the_announced_size(liar, tmp_path):
    """HEAD says 160 KiB, the body never ends: the download stops once it passes 160 KiB (the server got to send
    what the sockets buffer, not its 256 MiB), names the object and what it announced, and leaves no file."""
    _Liar.sizes["/endless.tar"] = CLAIMED
    url = f"{liar}/endless.tar"
    version = object_store.stat(url)
    assert version.size == CLAIMED
    with pytest.raises(ValueError) as error:
        object_store.download(url, version, tmp_path / "copy.tar")
    assert f"{url}: the server sends more than the {CLAIMED} bytes it announced" in str(error.value)
    assert list(tmp_path.iterdir()) == []
    assert _Liar.sent < 64 << 20, _Liar.sent  # bounded by the sockets' buffers, far below what the server offered


def test_a_cache_folder_of_700kb_never_holds_more_than_its_size_from_an_endless_body(liar, tmp_path):
    """A --cache-dir copy of the same shard: the folder stays within --cache-size while the body goes on."""
    _Liar.sizes["/endless.tar"] = CLAIMED
    url = f"{liar}/endless.tar"
    version = object_store.stat(url)
    copies = object_store.LocalCopies(tmp_path / "copies", 700 << 10)
    copies.fill([(url, version.etag, version.size)], lambda: True)
    held = sum(p.stat().st_size for p in (tmp_path / "copies").iterdir())
    assert held <= 700 << 10 and not list((tmp_path / "copies").glob("*.tar"))
    assert _Liar.sent < 64 << 20, _Liar.sent


def test_a_pack_index_member_of_a_gigabyte_is_refused_by_name_and_the_others_kept(liar, tmp_path, monkeypatch):
    """The server claims a 2 GiB shard and its index.json a 1 GiB member: that member is listed as refused, naming
    it and the limit, and is never read; the shard's other samples are read as usual."""
    from stoker.data.formats.shards import PACK_INDEX_FILE, PACK_INDEX_FORMAT, index_one_shard
    from stoker.data.pixels.imaging import MAX_SAMPLE_BYTES

    monkeypatch.setenv("STOKER_CACHE", str(tmp_path / "cache"))
    shard = _tar({"a.jpg": b"\xff\xd8small", "a.cls": b"0", "b.jpg": b"\xff\xd8other", "b.cls": b"1"})
    _Liar.files["/set/shard-0.tar"] = shard
    _Liar.sizes["/set/shard-0.tar"] = 2 * HUGE
    entry = {"size": 2 * HUGE, "md5": "", "keys": ["a", "b"], "labels": [0, 1], "starts": [512, HUGE],
             "sizes": [7, HUGE], "skipped": []}
    _Liar.files[f"/set/{PACK_INDEX_FILE}"] = json.dumps({"format": PACK_INDEX_FORMAT,
                                                         "shards": {"shard-0.tar": entry}}).encode()
    url = f"{liar}/set/shard-0.tar"
    members = index_one_shard(url)
    assert members.keys == ["a"] and members.sizes == [7]
    refused = {item.path: item.reason for item in members.skipped}
    assert refused == {f"{url}:b": f"{HUGE} bytes, more than the {MAX_SAMPLE_BYTES} one image may hold"}


def test_a_tar_member_over_the_sample_limit_is_refused_by_name(tmp_path, monkeypatch):
    """The same limit on a shard indexed from its own headers (local, or fetched whole)."""
    from stoker.data.formats import shards
    from stoker.data.pixels import imaging

    monkeypatch.setattr(shards, "MAX_SAMPLE_BYTES", 100)  # a member of 101 bytes stands for one of a gigabyte
    monkeypatch.setattr(imaging, "MAX_SAMPLE_BYTES", 100)
    path = tmp_path / "shard.tar"
    path.write_bytes(_tar({"a.jpg": b"\xff\xd8" + b"x" * 99, "a.cls": b"0", "b.jpg": b"\xff\xd8", "b.cls": b"1"}))
    members = shards.index_one_shard(str(path))
    assert members.keys == ["b"]
    assert [(item.path, item.reason) for item in members.skipped] == [
        (f"{path}:a", "a.jpg: 101 bytes, more than the 100 one image may hold")]

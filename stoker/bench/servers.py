"""Real servers on loopback for remote data: nginx serving a folder over HTTP (with Range), moto's standalone S3
server, and a proxy that adds round-trip latency in front of either. The tests and `stoker bench remote` start
them the same way; each is a child process stopped by `close()` (idempotent) or at the end of a `with`.

netem would add latency in the kernel, but this machine's kernel has no sch_netem: the proxy holds every chunk a
client sends for the round trip and passes the answers straight back, so a request and its answer together wait
one round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 60.0  # a loaded 2-core machine starts moto (Flask, boto) in seconds; this is a hang, not a race
S3_TEST_KEY = "stoker-test"  # moto accepts any credentials; these reach it the way a user's would
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """A child process serving on 127.0.0.1:`port`; `url` is its root."""

    def __init__(self, command: list[str], port: int, name: str, scratch: Path | None = None) -> None:
        self.port, self.name, self._scratch = port, name, scratch
        self.url = f"http://127.0.0.1:{port}"
        log = open(os.devnull, "wb")  # noqa: SIM115 (handed to the child)
        # At the lowest priority: a server and the network stand in for other machines; on the 2 cores they share
        # with training they must take what it leaves, not slow it down (they then answer later, never sooner).
        self._process: subprocess.Popen | None = subprocess.Popen(
            ["nice", "-n", "19", *command], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self._wait_until_up()

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                self.close()
                raise RuntimeError(f"{self.name} exited at start (code {self._process.returncode})")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError(f"{self.name} did not listen on port {self.port} within {START_TIMEOUT_S:.0f} s")

    def close(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def nginx(root: Path) -> Server:
    """nginx serving `root` (static files: Range, ETag and Last-Modified as nginx gives them)."""
    if not os.path.exists(NGINX):
        raise FileNotFoundError("nginx is not installed (Debian: apt-get install nginx-light; `make test` does)")
    scratch = Path(tempfile.mkdtemp(prefix="stoker-nginx-"))
    port = free_port()
    temp = {name: scratch / name for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi")}
    user = "user root;" if os.geteuid() == 0 else ""  # workers as root read a test's private tmp folder
    (scratch / "nginx.conf").write_text(f"""
{user}
daemon off;
worker_processes 2;
pid {scratch}/nginx.pid;
error_log {scratch}/error.log;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {temp['body']}; proxy_temp_path {temp['proxy']}; fastcgi_temp_path {temp['fastcgi']};
    uwsgi_temp_path {temp['uwsgi']}; scgi_temp_path {temp['scgi']};
    keepalive_requests 100000;
    server {{ listen 127.0.0.1:{port}; root {root.resolve()}; location / {{ }} }}
}}
""")
    return Server([NGINX, "-p", str(scratch), "-c", str(scratch / "nginx.conf")], port, "nginx", scratch)


def s3_server() -> Server:
    """moto's standalone S3 server (in memory; one bucket per test is made by the caller)."""
    port = free_port()
    return Server([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port, "moto_server")


def s3_environment(endpoint: str) -> dict[str, str]:
    """What a user of an S3-compatible store sets: keys, a region and the endpoint."""
    return {"AWS_ACCESS_KEY_ID": S3_TEST_KEY, "AWS_SECRET_ACCESS_KEY": S3_TEST_KEY, "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"}


def upload_folder(endpoint: str, bucket: str, folder: Path, prefix: str = "", public: bool = False) -> None:
    """Every file under `folder` into `bucket` (made here unless it exists), with boto3 as any other tool would
    write it; `public`: readable without credentials (ACL public-read)."""
    client = _s3_client(endpoint)
    if bucket not in {entry["Name"] for entry in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket=bucket)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, prefix + path.relative_to(folder).as_posix(),
                               ExtraArgs={"ACL": "public-read"} if public else None)


def delete_prefix(endpoint: str, bucket: str, prefix: str) -> None:
    """Every object of `bucket` under `prefix` removed."""
    client = _s3_client(endpoint)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for entry in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=entry["Key"])


def _s3_client(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name=s3_environment(endpoint)["AWS_REGION"],
                        aws_access_key_id=S3_TEST_KEY, aws_secret_access_key=S3_TEST_KEY)


def latency_proxy(target_port: int, round_trip_ms: float) -> Server:
    """A TCP proxy to 127.0.0.1:`target_port` adding `round_trip_ms` to every round trip."""
    port = free_port()
    return Server([sys.executable, "-m", "stoker.bench.servers", str(port), str(target_port), str(round_trip_ms)],
                  port, f"latency proxy ({round_trip_ms:g} ms)")


# ---- the proxy (run as `python -m stoker.bench.servers LISTEN_PORT TARGET_PORT ROUND_TRIP_MS`) ----------------

# The proxy's CPU is the stand-in network's, taken from the cores training runs on (a real network's wait costs
# none): requests are held for the whole round trip and answers pass straight through, in protocol callbacks rather
# than stream tasks. A client waits one round trip for each answer as with half of it each way (what the server
# starts on its own, a close, reaches the client at once). Over 4 runs of `stoker bench remote` at 25 ms (2 epochs)
# this proxy's first version (9b894d5, which wrote answers without queueing them) used 0.44 s of CPU a run, the one
# delaying both ways in stream tasks 0.76 s; this one was not measured again.
HIGH_WATER = 1 << 20  # bytes a connection may have waiting to be sent before its peer stops being read


class _Side(asyncio.Protocol):
    """One connection of a proxied pair. What it receives is written to its peer's connection `delay_s` later, in
    arrival order; its end (EOF, or a close) follows its data; a reset resets the peer and drops what was held."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.peer = self  # set by `_pair`
        self.transport: asyncio.Transport | None = None  # None until connected
        self.held: deque[tuple[float, bytes]] = deque()  # (due, data) not yet written to the peer
        self.timer: asyncio.TimerHandle | None = None
        self.ended = False  # no more data comes from this side: the peer is told once what it sent is written
        self.gone = False  # this side's connection is closed, or (the upstream side) could not be made

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(HIGH_WATER)
        if self.peer.gone and not self.peer.held:  # the other side left (or failed) while this one connected
            _reset(transport)
        elif self.peer.held or self.peer.ended:
            self.peer._forward()  # what arrived while this side was connecting

    def data_received(self, data: bytes) -> None:
        self.held.append((asyncio.get_running_loop().time() + self.delay_s, data))
        if self.timer is None:
            self._forward()

    def eof_received(self) -> bool:
        self.ended = True
        if self.timer is None:
            self._forward()
        return True  # half-closed: the answer may still be written to this side

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        if exc is not None:  # a reset: the peer is reset too
            self._reset_both()
            return
        self.ended = True
        if self.timer is None:
            self._forward()

    def _forward(self) -> None:
        """Write what is due to the peer, then wait for the next due; pass the end on once all of it is written."""
        self.timer = None
        out = self.peer.transport
        if out is None:
            return  # the peer is connecting: its `connection_made` calls again
        if out.is_closing():
            self._drop()
            return
        now = asyncio.get_running_loop().time()
        while self.held and self.held[0][0] <= now:
            out.write(self.held.popleft()[1])
        if self.held:
            self.timer = asyncio.get_running_loop().call_at(self.held[0][0], self._forward)
        elif self.ended:
            self._pass_end(out)

    def _pass_end(self, out: asyncio.Transport) -> None:
        if self.peer.ended and not self.peer.held:  # both ways done
            out.close()
            if self.transport is not None:
                self.transport.close()
        elif out.can_write_eof():
            try:
                out.write_eof()
            except OSError:  # the peer was reset and the proxy has not read it yet
                self._reset_both()
        else:
            out.close()

    def _reset_both(self) -> None:
        """Drop what either side held and reset both connections (RST, not a close: a client must not take a cut
        answer for a whole one)."""
        for side in (self, self.peer):
            side._drop()
            if side.transport is not None and not side.gone:
                _reset(side.transport)

    def _drop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.held.clear()

    # Flow control: while this side's connection cannot take more, the peer (whose data it sends) is not read.
    def pause_writing(self) -> None:
        if self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer.transport is not None:
            self.peer.transport.resume_reading()


def _reset(transport: asyncio.Transport) -> None:
    """Close with a TCP reset: no lingering, what was not sent is dropped."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _pair(round_trip_s: float) -> tuple[_Side, _Side]:
    """(client's side, server's side): requests wait the round trip, answers pass at once."""
    client, server = _Side(round_trip_s), _Side(0.0)
    client.peer, server.peer = server, client
    return client, server


async def _serve(listen: int, target: int, round_trip_ms: float) -> None:
    loop = asyncio.get_running_loop()
    connecting: set[asyncio.Task] = set()  # held: the loop keeps only weak references to its tasks

    async def connect(client: _Side, server: _Side) -> None:
        try:
            await loop.create_connection(lambda: server, "127.0.0.1", target)
        except Exception:  # noqa: BLE001 (refused, unreachable: the client is reset, now or once it is connected)
            server.gone = True
            client._drop()
            if client.transport is not None:
                _reset(client.transport)

    def accepted() -> _Side:
        client, server = _pair(round_trip_ms / 1000)
        task = loop.create_task(connect(client, server))
        connecting.add(task)
        task.add_done_callback(connecting.discard)
        return client

    listener = await loop.create_server(accepted, "127.0.0.1", listen)
    async with listener:
        await listener.serve_forever()


if __name__ == "__main__":
    asyncio.run(_serve(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))

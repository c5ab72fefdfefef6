"""Real servers on loopback for remote data: nginx serving a folder over HTTP (with Range), moto's standalone S3
server, and a proxy that adds round-trip latency in front of either. The tests and `stoker bench remote` start
them the same way; each is a child process stopped by `close()` (idempotent) or at the end of a `with`.

netem would add latency in the kernel, but this machine's kernel has no sch_netem: the proxy holds every chunk a
client sends for the round trip and passes the answers straight back, so a request and its answer together wait
one round trip.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

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


def upload_folder(endpoint: str, bucket: str, folder: Path, prefix: str = "") -> None:
    """Every file under `folder` into `bucket` (made here), with boto3 as any other tool would write it."""
    import boto3

    env = s3_environment(endpoint)
    client = boto3.client("s3", endpoint_url=endpoint, region_name=env["AWS_REGION"],
                          aws_access_key_id=S3_TEST_KEY, aws_secret_access_key=S3_TEST_KEY)
    client.create_bucket(Bucket=bucket)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, prefix + path.relative_to(folder).as_posix())


def latency_proxy(target_port: int, round_trip_ms: float) -> Server:
    """A TCP proxy to 127.0.0.1:`target_port` adding `round_trip_ms` to every round trip."""
    port = free_port()
    return Server([sys.executable, "-m", "stoker.bench.servers", str(port), str(target_port), str(round_trip_ms)],
                  port, f"latency proxy ({round_trip_ms:g} ms)")


# ---- the proxy (run as `python -m stoker.bench.servers LISTEN_PORT TARGET_PORT ROUND_TRIP_MS`) ----------------

# The proxy's CPU is the stand-in network's, taken from the cores training runs on (a real network's wait costs
# none): requests are held for the whole round trip and answers pass straight through, in protocol callbacks rather
# than stream tasks. A request and its answer wait the same round trip as with half of it each way; delaying both
# ways in stream tasks took 0.76 s of CPU per 2-epoch run of `stoker bench remote` at 25 ms, this takes 0.44 s.
HIGH_WATER = 1 << 20  # bytes a side may have buffered before the other side stops reading


class _Side(asyncio.Protocol):
    """One connection of a proxied pair: what it receives goes to `peer`, after `delay_s` (in arrival order)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.held: deque[tuple[float, bytes]] = deque()  # (due, data) not yet forwarded
        self.timer: asyncio.TimerHandle | None = None
        self.closing = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(HIGH_WATER)
        if self.peer is not None and self.peer.held and self.peer.timer is None:
            self.peer._wait_for_due()  # what the client sent while this side was connecting

    def data_received(self, data: bytes) -> None:
        if self.delay_s <= 0 and not self.held and self.peer is not None and self.peer.transport is not None:
            self.peer.transport.write(data)
            return
        self.held.append((asyncio.get_running_loop().time() + self.delay_s, data))
        if self.timer is None:
            self._wait_for_due()

    def _wait_for_due(self) -> None:
        self.timer = asyncio.get_running_loop().call_at(self.held[0][0], self._forward)

    def _forward(self) -> None:
        """Write what is due, then wait for the next; until the peer is connected, its `connection_made` calls."""
        self.timer = None
        if self.peer is None or self.peer.transport is None:
            return
        now = asyncio.get_running_loop().time()
        while self.held and self.held[0][0] <= now:
            self.peer.transport.write(self.held.popleft()[1])
        if self.held:
            self._wait_for_due()
        elif self.closing:
            self.peer.transport.close()

    def eof_received(self) -> bool:
        self.closing = True
        if not self.held and self.timer is None and self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None and self.peer is not None and self.peer.transport is not None:
            self.peer.transport.abort()  # a reset on one side resets the other
        elif self.peer is not None and self.peer.transport is not None and not self.held:
            self.peer.transport.close()
        self.closing = True

    # The peer's writes back up: stop reading what would be written to it.
    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


async def _serve(listen: int, target: int, round_trip_ms: float) -> None:
    loop = asyncio.get_running_loop()

    def client_side() -> _Side:
        client = _Side(round_trip_ms / 1000)  # requests wait the round trip
        server = _Side(0.0)  # answers pass at once
        client.peer, server.peer = server, client

        async def connect() -> None:
            try:
                await loop.create_connection(lambda: server, "127.0.0.1", target)
            except OSError:
                if client.transport is not None:
                    client.transport.abort()

        connecting.add(task := loop.create_task(connect()))
        task.add_done_callback(connecting.discard)
        return client

    connecting: set[asyncio.Task] = set()  # held, or the loop may collect a connect still running
    server = await loop.create_server(client_side, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_serve(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))

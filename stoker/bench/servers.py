"""Real servers on loopback for remote data: nginx serving a folder over HTTP (with Range), moto's standalone S3
server, and a proxy that adds round-trip latency in front of either. The tests and `stoker bench remote` start
them the same way; each is a child process stopped by `close()` (idempotent) or at the end of a `with`.

netem would add latency in the kernel, but this machine's kernel has no sch_netem: the proxy delays every chunk
by half the round trip in each direction, so a request and its answer together wait one round trip.
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

async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Forward chunks in order, each no earlier than `delay_s` after it arrived."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, chunk = await queue.get()
            if not chunk:
                break
            await asyncio.sleep(max(0.0, due - loop.time()))
            writer.write(chunk)
            await writer.drain()
        writer.close()

    sender = asyncio.ensure_future(send())
    try:
        while chunk := await reader.read(1 << 16):
            queue.put_nowait((loop.time() + delay_s, chunk))
    except ConnectionError:
        pass
    queue.put_nowait((0.0, b""))
    try:
        await sender
    except ConnectionError:
        pass


async def _serve(listen: int, target: int, round_trip_ms: float) -> None:
    half = round_trip_ms / 2000

    async def connection(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(_pump(client_reader, server_writer, half), _pump(server_reader, client_writer, half))

    server = await asyncio.start_server(connection, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_serve(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))

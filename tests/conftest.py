"""Shared fixtures: real image folders made on the fly, and the leave-no-trace check every test gets."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from stoker.common import procs
from stoker.data.formats import builtin_data
from stoker.pipeline import ring

ROOT = Path(__file__).resolve().parent.parent
HELPERS = Path(__file__).resolve().parent / "helpers"
# Hidden for the whole session, from before any fixture runs (module- and session-scoped ones start runs too); a
# `gpu` test gets the devices back (`pinned_to_cpu`), and the probe asks with them visible.
VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# torch's OpenMP threads spin after each parallel region, for GOMP's default 300,000 spins. A test's run puts a
# 2-thread CPU consumer, its producers, the controller and pytest on 2 cores: the spinning threads burn the cores
# the others wait for (a 1-epoch run on cpu:1: 20 s of CPU against 9.5 s passive). The wait policy decides only how
# an idle thread waits, never what is computed: results stay bitwise the same. Set before torch is imported here,
# inherited by every process a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# A background job of a non-interactive shell (`make test &`, `nohup make test &`, a CI script's job) starts with
# SIGINT ignored, and an ignored disposition survives exec: every process a test starts would ignore the Ctrl-C the
# test sends it, and the run, the pack or the user's loop would go on (and be left behind). The suite tests what a
# user at a terminal gets: here, in pytest and in each xdist worker, SIGINT gets Python's handler back, which exec
# resets to the default in every child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# `make test` runs most tests in 3 pytest-xdist workers at once: the leave-no-trace checks look only at what this
# worker's tests started. Every process a test starts inherits this mark, orphaned or not; a segment's name holds
# its creator's pid. Tests whose checks read the whole machine (`serial`) run alone, after the others.
SESSION_MARK = f"STOKER_TEST_SESSION={os.getpid()}"
os.environ["STOKER_TEST_SESSION"] = str(os.getpid())
# setproctitle writes a stoker process's title over its environment block unless told not to: the mark would be
# gone from /proc/PID/environ, and no process would count as this session's.
os.environ["SPT_NOENV"] = "1"


def _ours(pid: int) -> bool:
    """Started by this session (this process, or a descendant that inherited the mark)."""
    if pid == os.getpid():
        return True
    try:
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return SESSION_MARK.encode() in environment


def stoker_processes() -> list[tuple[int, str]]:
    """The live stoker processes this session started."""
    return [(pid, title) for pid, title in procs.stoker_processes() if _ours(pid)]


def live_segments() -> list[str]:
    """Stoker segments in /dev/shm made by this session, or by a process that is gone (nobody will remove them
    but the next start's sweep: a leak, whoever made it)."""
    return [name for name in ring.live_segments() if _ours(pid := ring.segment_creator(name)) or not _alive(pid)]


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


@contextlib.contextmanager
def serving(handler: type) -> Iterator[str]:
    """The URL of Python's own HTTP server on loopback, answering with `handler` (a BaseHTTPRequestHandler made to
    answer as a test needs), one thread a request; shut down and closed on exit."""
    import http.server

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """The port of a server on loopback that takes every connection and never answers: a hung server."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=256)
    listener.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def take_and_hold() -> None:
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    taker = threading.Thread(target=take_and_hold, daemon=True)
    taker.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        taker.join()
        for connection in held:
            connection.close()
        listener.close()


def free_port() -> int:
    """A free TCP port below the ephemeral range, so no socket another worker's processes open in the meantime
    (gloo, stores: ephemeral ports) can take it before the test's processes bind it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    generator = random.Random()
    for _ in range(100):
        port = generator.randrange(10000, max(10001, low))
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found below the ephemeral range")


def wait_for_no_trace(timeout_s: float = 15.0) -> tuple[list, list]:
    deadline = time.monotonic() + timeout_s
    while True:
        processes, segments = stoker_processes(), live_segments()
        if (not processes and not segments) or time.monotonic() > deadline:
            return processes, segments
        time.sleep(0.1)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; runs wherever one is visible, skipped elsewhere")
    config.addinivalue_line("markers", "two_gpus: needs two CUDA devices (tools/gpu-check.sh runs these last)")
    config.addinivalue_line("markers", "serial: reads the whole machine (/dev/shm, /tmp); `make test` runs it alone")


def pytest_collection_modifyitems(config, items) -> None:
    needing_cuda = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not needing_cuda or cuda_visible():
        return
    broken = torch_cannot_see_the_gpus()
    if broken:  # skipping would pass a suite that never ran its GPU tests on a GPU machine
        raise pytest.UsageError(f"the GPU tests cannot run: {broken}")
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in needing_cuda:
        item.add_marker(skip)


def torch_cannot_see_the_gpus() -> str | None:
    """The message of `check_torch_sees_the_gpus`, asked in a child process with the session's devices visible
    (None: nvidia-smi lists no GPU, or torch sees them, or CUDA_VISIBLE_DEVICES hid them before the session)."""
    probe = ("from stoker.common.devices import check_torch_sees_the_gpus as check\n"
             "try:\n    check()\nexcept ValueError as error:\n    print(error)")
    answer = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                            env=_with_visible_devices(os.environ)).stdout.strip()
    return answer or None


def cuda_visible() -> bool:
    return cuda_device_count() > 0


@functools.cache
def cuda_device_count() -> int:
    """Asked in a child process: querying CUDA here would initialise the driver in the test process before a CPU
    test can hide the GPUs from it."""
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    answer = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env=_with_visible_devices(os.environ)).stdout.strip()
    return int(answer) if answer.isdigit() else 0


@pytest.fixture(autouse=True)
def pinned_to_cpu(request, monkeypatch):
    """A test without the `gpu` marker runs on the CPU even on a GPU machine: everything it starts (the CLI,
    `stoker.train`'s processes) sees no CUDA device, so `--devices auto` means CPU consumers and gloo there too."""
    if request.node.get_closest_marker("gpu") is not None:
        if VISIBLE_DEVICES is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", VISIBLE_DEVICES)
    yield


def _with_visible_devices(environment) -> dict:
    environment = {k: v for k, v in environment.items() if k != "CUDA_VISIBLE_DEVICES"}
    return environment if VISIBLE_DEVICES is None else {**environment, "CUDA_VISIBLE_DEVICES": VISIBLE_DEVICES}


@pytest.fixture(autouse=True)
def leaves_no_trace():
    """Every test ends with no stoker process alive and no stoker segment in /dev/shm. One that fails so is
    failed, and what it left is removed first, so that the next test (and the shell after `make test`) starts
    clean."""
    yield
    processes, segments = wait_for_no_trace()
    if processes or segments:
        clear_traces([pid for pid, _ in processes], segments)
    assert not processes, f"stoker processes left behind: {processes}"
    assert not segments, f"shared-memory segments left behind: {segments}"


def clear_traces(pids: list[int], segments: list[str]) -> None:
    """Kill the stoker processes `pids` and the processes of this session above them up to this one (a helper
    script that started a Loader, a CLI the test could not stop), then remove those of `segments` and the
    semaphores that no live process holds any more."""
    from stoker.pipeline import semaphores

    doomed: set[int] = set()
    for pid in pids:
        while pid not in doomed and pid > 1 and pid != os.getpid() and _ours(pid):
            doomed.add(pid)
            fields = procs.stat_fields(pid)
            pid = int(fields[1]) if fields else 0
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(_alive(pid) and (procs.stat_fields(pid) or ["Z"])[0] != "Z" for pid in doomed):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for name in segments:
        ring.remove_if_unheld(os.path.join(ring.SHM_DIR, name))
    semaphores.sweep_dead_semaphores()


@pytest.fixture(scope="session")
def textures(tmp_path_factory) -> tuple[Path, Path]:
    """A small copy of the built-in texture dataset: 10 classes, 12 train and 4 val JPEGs each, 64x64."""
    folder = tmp_path_factory.mktemp("textures") / "data"
    builtin_data.generate(folder, train_per_class=12, val_per_class=4)
    return folder / "train", folder / "val"


@pytest.fixture(scope="session")
def digits(tmp_path_factory) -> tuple[Path, Path]:
    """scikit-learn's handwritten digits written out as PNG files in ImageFolder layout (train and val)."""
    from stoker.bench.sync_train import write_digits

    return write_digits(tmp_path_factory.mktemp("digits"))


def photograph_jpeg(index: int, progressive: bool) -> bytes:
    """One of scikit-learn's two sample photographs (china, flower; 427x640) saved as a baseline or progressive JPEG."""
    from sklearn.datasets import load_sample_images

    buffer = io.BytesIO()
    Image.fromarray(load_sample_images().images[index]).save(buffer, "JPEG", quality=90, progressive=progressive)
    return buffer.getvalue()


def scan_data_start(data: bytes) -> int:
    """Where the entropy-coded data of the first scan begins: after the SOS marker's segment."""
    sos = data.index(b"\xff\xda")
    return sos + 2 + int.from_bytes(data[sos + 2:sos + 4], "big")


def forged_png_header(width: int, height: int, bit_depth: int, colour_type: int) -> bytes:
    """A PNG whose IHDR (with a valid checksum) claims this size and mode, and whose pixel data is tiny."""
    buffer = io.BytesIO()
    Image.new("L", (10, 10)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    data[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    data[24:26] = bytes([bit_depth, colour_type])
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")
    return bytes(data)


def run_cli(*args: str, env: dict | None = None, timeout: float = 240, check: bool = True,
            new_session: bool = False) -> subprocess.CompletedProcess:
    """`new_session`: the CLI leads its own process group, which a fault may then signal as a whole."""
    environment = {**os.environ, "PYTHONPATH": f"{HELPERS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   **(env or {})}
    if args[:1] == ("train",) and "--report" not in args:
        args = (*args, "--report", "false")  # drawing takes 2 s a run; tests/integration/test_report.py draws
    result = subprocess.run([sys.executable, "-m", "stoker", *args], capture_output=True, text=True,
                            timeout=timeout, env=environment, start_new_session=new_session)
    if check and result.returncode != 0:
        raise AssertionError(f"stoker {' '.join(args)} exited {result.returncode}:\n{result.stderr[-4000:]}")
    return result


def assert_same_weights(run_a: Path, run_b: Path, file: str = "model.pt") -> None:
    """The two runs' model files (`file`: model.pt, model_ema.pt, ...) hold bitwise the same tensors."""
    import torch  # here: a test that needs no torch does not pay for its import

    a, b = (torch.load(run / file, weights_only=True)["state_dict"] for run in (run_a, run_b))
    assert a.keys() == b.keys(), file
    for name in a:
        assert torch.equal(a[name], b[name]), (file, name)


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def shard_members(shard_folder: Path) -> dict[str, bytes]:
    """Every member of the tar shards in `shard_folder`, by name."""
    found = {}
    for shard in sorted(shard_folder.glob("*.tar")):
        with tarfile.open(shard) as archive:
            for member in archive.getmembers():
                found[member.name] = archive.extractfile(member).read()  # type: ignore[union-attr]
    return found

"""What a run opens to the network: on one machine, nothing but loopback."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stoker.common.procs import descendants
from tests.conftest import HELPERS

pytestmark = pytest.mark.timeout(120)

LISTEN = "0A"  # TCP state in /proc/net/tcp*


def _socket_inodes(pids: set[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return inodes


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp* writes addresses as the bytes of 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listening(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket the processes hold."""
    inodes = _socket_inodes(pids)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                host, port = fields[1].split(":")
                found.append((str(_address(host)), int(port, 16)))
    return found


def test_proc_net_addresses_are_decoded():
    assert str(_address("0100007F")) == "127.0.0.1"
    assert str(_address("00000000")) == "0.0.0.0"
    assert str(_address("00000000000000000000000001000000")) == "::1"


@pytest.fixture
def network_interface():
    """A non-loopback interface with an address, as a real machine has. In a private network namespace (under
    `isolated`, where only `lo` exists) the test adds a veth pair for the run, when it may (root)."""
    listed = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    names = [line.split()[1] for line in listed.splitlines() if line.split()[1] != "lo"]
    if names:
        yield names[0]
        return
    added = subprocess.run(["ip", "link", "add", "stk0", "type", "veth", "peer", "name", "stk1"],
                           capture_output=True).returncode == 0
    if not added:
        yield None
        return
    for command in (["ip", "addr", "add", "10.213.0.1/24", "dev", "stk0"], ["ip", "link", "set", "stk0", "up"],
                    ["ip", "link", "set", "stk1", "up"]):
        subprocess.run(command, check=True)
    yield "stk0"
    subprocess.run(["ip", "link", "del", "stk0"], check=False)


def test_a_run_on_one_machine_listens_on_loopback_only(textures, tmp_path, network_interface):
    """Sampled while the consumers train (slowed down, so that several samples fall inside the run). The run's
    environment asks gloo for the machine's network interface, as one set up for several machines would."""
    train, val = textures
    environment = {**os.environ, "PYTHONPATH": str(HELPERS), "STOKER_STEP_TIME_MS": "150"}
    if network_interface is not None:
        environment["GLOO_SOCKET_IFNAME"] = network_interface
    run = subprocess.Popen(
        [sys.executable, "-m", "stoker", "train", "--data", str(train), "--val", str(val), "--devices", "cpu:2",
         "--batch-size", "8", "--image-size", "32", "--epochs", "1", "--out", str(tmp_path), "--quiet",
         "--report", "false"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=environment)
    seen: set[tuple[str, int]] = set()
    samples_with_consumers = 0
    while run.poll() is None:
        pids = {run.pid, *descendants(run.pid)}
        titles = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in pids if os.path.exists(f"/proc/{pid}")]
        if sum(title.startswith(b"stoker consumer") for title in titles) == 2:
            samples_with_consumers += 1
            seen.update(listening(pids))
        time.sleep(0.2)
    assert run.returncode == 0, run.stderr.read()[-3000:]
    assert samples_with_consumers >= 3  # looked while both consumers were up
    exposed = sorted((host, port) for host, port in seen if not ipaddress.ip_address(host).is_loopback)
    assert exposed == []

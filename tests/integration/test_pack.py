"""`stoker pack` through the real CLI, killed and interrupted: a pack is written whole or not at all, into an empty
folder unless told, and its workers never outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stoker.data.formats.shards import load_shards
from tests.conftest import HELPERS, run_cli

SLOW_READS = {"STOKER_READ_LATENCY_MS": "40"}  # 120 files, 2 workers: a pack of about 2.5 s


def start_pack(source: Path, out: Path, ignoring_ctrl_c: bool = False) -> subprocess.Popen:
    """`ignoring_ctrl_c`: started as a script's background job is, with SIGINT ignored."""
    environment = {**os.environ, **SLOW_READS,
                   "PYTHONPATH": f"{HELPERS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-m", "stoker", "pack", str(source), str(out), "--shard-size", "8KB",
                             "--workers", "2"], env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignoring_ctrl_c
                            else None)


def wait_for_a_shard(out: Path, timeout_s: float = 60) -> None:
    """Until the pack has written some shards, in its hidden folder beside `out`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(list(out.parent.glob(f".{out.name}.partial-*/shard-*.tar"))) >= 2:
            return
        time.sleep(0.05)
    raise AssertionError("the pack wrote no shard")


def group_members(group: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            found.append(int(entry))
    return found


def wait_until_gone(group: int, timeout_s: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := group_members(group)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_a_pack_killed_midway_leaves_no_set_and_no_worker(textures, tmp_path):
    train, _ = textures
    out = tmp_path / "shards"
    pack = start_pack(train, out)
    wait_for_a_shard(out)
    pack.kill()  # the parent alone, as the OOM killer would
    pack.communicate(timeout=30)
    assert wait_until_gone(pack.pid) == []  # its workers died with it
    assert not out.exists()  # nothing that trains as if complete
    run_cli("pack", str(train), str(out), "--shard-size", "8KB", "--workers", "2")
    assert list(tmp_path.glob(".shards.partial-*")) == []  # the killed pack's hidden folder is gone
    assert len(load_shards(sorted(str(p) for p in out.glob("*.tar")), cache=tmp_path / "cache")) == 120


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm-to-the-job", "sigterm-to-pack"])
def test_ctrl_c_or_sigterm_during_a_pack_says_interrupted_and_writes_nothing(textures, tmp_path, stop):
    """Ctrl-C reaches the terminal's whole foreground group; a scheduler's SIGTERM every process of the job (Slurm),
    or `kill` the command alone. Before, SIGTERM killed pack at once and left its hidden folder."""
    train, _ = textures
    out = tmp_path / "shards"
    pack = start_pack(train, out)
    wait_for_a_shard(out)
    if stop == "sigterm-to-pack":
        os.kill(pack.pid, signal.SIGTERM)
    else:
        os.killpg(pack.pid, signal.SIGINT if stop == "ctrl-c" else signal.SIGTERM)
    _, stderr = pack.communicate(timeout=30)
    assert pack.returncode == 130, stderr
    assert "pack interrupted" in stderr and "Traceback" not in stderr, stderr
    assert wait_until_gone(pack.pid) == []
    assert not out.exists() and list(tmp_path.glob(".shards.partial-*")) == []


def test_a_pack_started_ignoring_ctrl_c_keeps_ignoring_it_and_stops_on_sigterm(textures, tmp_path):
    """A script's background job (`stoker pack ... &`) starts with SIGINT ignored, and the pack kept ignoring the
    Ctrl-C meant for the script's foreground before SIGTERM was handled: it still does."""
    train, _ = textures
    out = tmp_path / "shards"
    pack = start_pack(train, out, ignoring_ctrl_c=True)
    wait_for_a_shard(out)
    os.killpg(pack.pid, signal.SIGINT)
    time.sleep(0.5)  # Ctrl-C would have stopped it by now (the pack takes about 2.5 s)
    assert pack.poll() is None, pack.communicate()[1]
    os.killpg(pack.pid, signal.SIGTERM)
    _, stderr = pack.communicate(timeout=30)
    assert pack.returncode == 130 and "pack interrupted" in stderr and "Traceback" not in stderr, stderr
    assert wait_until_gone(pack.pid) == []


def test_a_used_folder_is_refused_unless_overwrite_and_then_holds_only_the_new_pack(textures, tmp_path):
    train, _ = textures
    out = tmp_path / "shards"
    out.mkdir()
    (out / "shard-000099.tar").write_bytes(b"an old shard")
    refused = run_cli("pack", str(train), str(out), check=False)
    assert refused.returncode == 2 and "--overwrite" in refused.stderr and "Traceback" not in refused.stderr
    run_cli("pack", str(train), str(out), "--shard-size", "40KB", "--workers", "1", "--overwrite")
    assert not (out / "shard-000099.tar").exists()
    assert len(load_shards(sorted(str(p) for p in out.glob("*.tar")), cache=tmp_path / "cache")) == 120

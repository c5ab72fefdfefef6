"""Producers and CPU consumers are forked from zygotes (multiprocessing's forkserver with their modules
preloaded), and every guarantee spawn gave them holds: SIGINT and SIGTERM blocked from birth, no torch in the
producers' zygote, a zygote gone when the last user closes and when its controller is SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import stoker
from stoker.common import zygote
from stoker.common.procs import descendants, start, stoker_processes

# In a fresh interpreter: each forked child writes its blocked-signal mask (SigBlk, hex) as its target begins.
PROBE = """
from stoker.common.procs import start
from stoker.common import zygote

def report(writer):
    writer.send(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("SigBlk")))

if __name__ == "__main__":  # `report` is this script's: the zygote that imports the main script forks them
    lease = zygote.DATASET_PRODUCERS.acquire()
    pipes = [zygote.DATASET_PRODUCERS.context.Pipe(duplex=False) for _ in range(2)]
    children = [start(report, (writer,), f"stoker producer {n}", zygote.DATASET_PRODUCERS.context)
                for n, (_, writer) in enumerate(pipes)]
    print(*(reader.recv() for reader, _ in pipes))
    for child in children:
        child.join(30)
    lease.release()
"""

# A Loader's user whose process is SIGKILLed while its producers work: prints its pid and the zygote's, then waits.
HOLDER = """
import sys, time
import stoker
from stoker.common import zygote

if __name__ == "__main__":
    loader = stoker.Loader(sys.argv[1], batch_size=8, image_size=32, producers=2, device="cpu")
    next(iter(loader))
    print(zygote.PRODUCERS.pid(), flush=True)
    time.sleep(600)
"""


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except OSError:  # gone meanwhile
        return -1


def _gone(pids: set[int], deadline_s: float) -> bool:
    """Whether none of `pids` is a live stoker process by the deadline (a generous one: it bounds a failure only)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if not pids & {pid for pid, _ in stoker_processes()}:
            return True
        time.sleep(0.1)
    return False


def test_forked_producers_are_born_with_sigint_and_sigterm_blocked(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    masks = result.stdout.split()
    assert len(masks) == 2, result.stdout
    for mask in masks:
        for signal_number in (signal.SIGINT, signal.SIGTERM):
            assert int(mask, 16) & (1 << (signal_number - 1)), (mask, signal_number)


def test_a_loaders_producers_are_the_zygotes_children_and_it_goes_with_the_last_close(textures):
    train, _ = textures
    with stoker.Loader(train, batch_size=8, image_size=32, producers=2, device="cpu") as first, \
            stoker.Loader(train, batch_size=8, image_size=32, producers=1, device="cpu") as second:
        next(iter(first))
        next(iter(second))
        pid = zygote.PRODUCERS.pid()
        assert pid is not None and _parent(pid) == os.getpid()
        producers = [h.process.pid for loader in (first, second) for h in loader.driver.engine.pool.active]
        assert len(producers) == 3 and all(_parent(p) == pid for p in producers)
        with open(f"/proc/{pid}/maps") as maps:
            assert "libtorch" not in maps.read()  # nothing of torch, so nothing of CUDA, is in what producers copy
        first.close()
        assert zygote.PRODUCERS.pid() == pid  # the second loader's producers still need it
    assert zygote.PRODUCERS.pid() is None and _gone({pid}, 30)


def test_a_killed_loader_process_takes_its_zygote_and_producers_with_it(textures, tmp_path):
    train, _ = textures
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    holder = subprocess.Popen([sys.executable, str(script), str(train)], stdout=subprocess.PIPE, text=True)
    try:
        zygote_pid = int(holder.stdout.readline())
        family = {pid for pid, _ in stoker_processes() if pid == zygote_pid or _parent(pid) == zygote_pid}
        assert len(family) == 3, stoker_processes()
        holder.kill()
        holder.wait(30)
        assert _gone(family, 60), stoker_processes()
    finally:
        holder.kill()


REFUSES_IMPORT = """
import sys
import numpy as np
import stoker
if __name__ != "__main__":
    raise RuntimeError("this script refuses to be imported")
if __name__ == "__main__":
    squares = [(np.zeros((8, 8, 3), np.uint8), 0)] * 16  # a user's dataset: its zygote imports the script
    with stoker.Loader(squares, batch_size=8, producers=2, device="cpu") as loader:
        next(iter(loader))
"""


def test_a_main_script_that_fails_as_the_zygote_imports_it_is_one_error_naming_it(tmp_path):
    """Spawned producers each failed on it, and the feed gave up after nine losses; the zygote fails once."""
    script = tmp_path / "refuses.py"
    script.write_text(REFUSES_IMPORT)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("stoker.common.procs.StokerRunError: the zygote") and str(script) in last, result.stderr
    assert "this script refuses to be imported" in result.stderr  # the zygote's own traceback says why


SIBLING = """
import os, sys
with open(sys.argv[2], "a") as marker:
    marker.write(f"{os.getpid()}\\n")
"""

MAIN_WITH_SIBLING = """
import sys
import numpy as np
import sibling  # beside this script: found through the script's own folder on sys.path
import stoker

DATA = sys.argv[1]  # the command line, read at import time


class Squares:  # a user's dataset, a class of the main script: its producers need the script imported
    def __len__(self):
        return 24

    def __getitem__(self, index):
        return np.full((32, 32, 3), index, np.uint8), index % 2


if __name__ == "__main__":
    data = Squares() if sys.argv[3] == "dataset" else DATA
    with stoker.Loader(data, batch_size=8, image_size=32, producers=3, device="cpu") as loader:
        for _ in loader:
            pass
"""


@pytest.mark.parametrize("source,importers", [("dataset", 2), ("files", 1)])
def test_the_main_script_is_imported_once_in_a_dataset_s_zygote_with_its_path_and_command_line(
        textures, tmp_path, source, importers):
    """As a spawned child would import it: from another folder, `import sibling` needs the script's folder on
    sys.path and `sys.argv[1]` the command line; the producers forked after find it imported. Producers of files
    never meet the script's objects: neither their zygote nor they import it (nor the torch a script imports)."""
    train, _ = textures
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "sibling.py").write_text(SIBLING)
    (folder / "main.py").write_text(MAIN_WITH_SIBLING)
    marker = tmp_path / "imports"
    result = subprocess.run([sys.executable, str(folder / "main.py"), str(train), str(marker), source],
                            cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    pids = marker.read_text().split()
    assert len(pids) == importers, pids  # the user's process (and a dataset's zygote), none of the producers


def test_a_users_own_forkserver_is_left_alone(textures):
    """stoker's zygote is a server of its own: a user's forkserver (a DataLoader's) keeps running, its children
    are not the zygote's, and closing the Loader does not kill it."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    users = context.Process(target=time.sleep, args=(0,))
    users.start()
    users.join(60)
    from multiprocessing import forkserver

    theirs = forkserver._forkserver._forkserver_pid
    train, _ = textures
    with stoker.Loader(train, batch_size=8, image_size=32, producers=1, device="cpu") as loader:
        next(iter(loader))
        assert zygote.PRODUCERS.pid() not in (None, theirs)
    assert forkserver._forkserver._forkserver_pid == theirs and os.path.exists(f"/proc/{theirs}")
    again = context.Process(target=time.sleep, args=(0,))
    again.start()
    again.join(60)
    assert again.exitcode == 0


def test_a_loader_started_in_a_thread_that_ends_keeps_its_zygote_and_producers(textures):
    """The kernel's parent-death signal follows the thread that forked: the zygote is forked by a thread that
    lives as long as the process, not by the user's thread that first iterated."""
    import threading

    train, _ = textures
    with stoker.Loader(train, batch_size=8, image_size=32, producers=2, device="cpu") as loader:
        batches = iter(loader)
        first = threading.Thread(target=lambda: next(batches))
        first.start()
        first.join(120)
        pid = zygote.PRODUCERS.pid()
        time.sleep(1.0)  # a killed zygote's producers would be gone by now
        seen = [i for _ in batches for i in loader.batch_ids.tolist()]
        assert zygote.PRODUCERS.pid() == pid and os.path.exists(f"/proc/{pid}")
        summary = loader.summary()
        lost = [event for event in loader.events.recent if event["event"] == "producer_lost"]
    assert summary["duplicate_samples"] == 0 and len(seen) == 120 - 8
    assert not lost, lost


def _report_pid(writer):
    writer.send(os.getpid())


def test_a_zygote_killed_between_forks_is_started_again_as_a_zygote():
    """The next fork's own connection starts it again, through the keeper thread: titled, tied to this process's
    death, not a plain forkserver started from the caller's thread."""
    with zygote.PRODUCERS.acquire():
        first = zygote.PRODUCERS.pid()
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 60  # bounds a failure only
        while zygote.PRODUCERS.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        reader, writer = zygote.PRODUCERS.context.Pipe(duplex=False)
        child = start(_report_pid, (writer,), "stoker producer 0", zygote.PRODUCERS.context)
        child_pid = reader.recv()
        child.join(60)
        again = zygote.PRODUCERS.pid()
        assert again not in (None, first) and _parent(child_pid) in (again, -1)
        assert dict(stoker_processes()).get(again) == "stoker zygote"  # what `_become_zygote` does first
        assert _parent(again) == os.getpid()
    assert _gone({again}, 30)


def _blocked_signals(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line.split()[1] for line in status if line.startswith("SigBlk")), 16)


def _train_slowly(textures, run_dir, through: str = "cli", tmp_path=None, extra: tuple = ()) -> subprocess.Popen:
    """A `cpu:2` run of 4 epochs whose steps are held 300 ms each (the consumers live for 60 of them while a test
    looks at them), started by stoker's command line or by a user's script calling `stoker.train`."""
    train, val = textures
    settings = dict(data=str(train), val=str(val), devices="cpu:2", batch_size=8, image_size=32, epochs=4,
                    report=False, quiet=True, out=str(run_dir))
    environment = {**os.environ, "STOKER_STEP_TIME_MS": "300"}
    if through == "cli":
        command = [sys.executable, "-m", "stoker", "train", "--data", str(train), "--val", str(val), "--devices",
                   "cpu:2", "--batch-size", "8", "--image-size", "32", "--epochs", "4", "--report", "false",
                   "--quiet", "--out", str(run_dir), *extra]
    else:
        script = tmp_path / "users_script.py"
        script.write_text(f"import stoker\nif __name__ == '__main__':\n    stoker.train(**{settings!r})\n")
        command = [sys.executable, str(script)]
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=environment)


def _consumers_of(run: subprocess.Popen, count: int = 2) -> list[int]:
    """The pids of the run's consumers once `count` of them are up (its own: not another test's run)."""
    deadline = time.monotonic() + 180  # bounds a failure only: the consumers live for 60 steps of 300 ms
    while time.monotonic() < deadline and run.poll() is None:
        ours = set(descendants(run.pid))
        consumers = [pid for pid, title in stoker_processes() if pid in ours
                     and title.startswith("stoker consumer ") and title[len("stoker consumer "):].isdigit()]
        if len(consumers) == count:
            return consumers
        time.sleep(0.05)
    raise AssertionError((stoker_processes(), run.poll()))


def test_a_cpu_runs_consumers_are_forked_from_the_consumers_zygote_with_signals_blocked(textures, tmp_path):
    """One torch import a run, not one a consumer: both consumers are the children of the consumers' zygote (itself
    the controller's child, with torch in its mappings), born with SIGINT and SIGTERM blocked; Ctrl-C still ends
    the run interrupted."""
    run_dir = tmp_path / "run"
    controller = _train_slowly(textures, run_dir)
    try:
        consumers = _consumers_of(controller)
        zygotes = {_parent(pid) for pid in consumers}
        assert len(zygotes) == 1
        (zygote_pid,) = zygotes
        assert dict(stoker_processes()).get(zygote_pid) == "stoker zygote (consumers)"
        assert _parent(zygote_pid) == controller.pid
        with open(f"/proc/{zygote_pid}/maps") as maps:
            assert "libtorch" in maps.read()  # what each consumer copies instead of importing
        for pid in consumers:
            for signal_number in (signal.SIGINT, signal.SIGTERM):
                assert _blocked_signals(pid) & (1 << (signal_number - 1)), (pid, signal_number)
        controller.send_signal(signal.SIGINT)
        _, stderr = controller.communicate(timeout=180)
    finally:
        controller.kill()
    assert controller.returncode == 130, stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert _gone({zygote_pid}, 30)


def test_under_a_users_script_consumers_are_spawned(textures, tmp_path):
    """The script's top-level code would run in the zygote, and CUDA or torch's OpenMP threads started there would
    be unusable in every fork: under a user's script the consumers are the controller's own children."""
    run = _train_slowly(textures, tmp_path / "run", through="script", tmp_path=tmp_path)
    try:
        consumers = _consumers_of(run)
        assert {_parent(pid) for pid in consumers} == {run.pid}
        assert not [title for _, title in stoker_processes() if title == "stoker zygote (consumers)"
                    and _parent(_) == run.pid]
    finally:
        run.kill()
        run.communicate(timeout=60)


def test_a_killed_consumers_zygote_fails_the_run_naming_it(textures, tmp_path):
    """Every consumer asks for SIGKILL at its parent's death, and its parent is the zygote: the run cannot go on
    without them, and says why instead of 'exited with code 255' twice."""
    run_dir = tmp_path / "run"
    controller = _train_slowly(textures, run_dir)
    try:
        (zygote_pid,) = {_parent(pid) for pid in _consumers_of(controller)}
        os.kill(zygote_pid, signal.SIGKILL)
        _, stderr = controller.communicate(timeout=180)
    finally:
        controller.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert controller.returncode == 1 and summary["status"] == "failed", stderr[-3000:]
    assert "the zygote consumers are forked from died, and every consumer with it" in summary["error"]


def _producers_zygote_stopped_and_a_producer_killed(controller: subprocess.Popen) -> int:
    """Once the run trains: its producers' zygote stopped (SIGSTOP) and one of its producers killed; the zygote's
    pid. The zygote reaps nothing while stopped, so multiprocessing never hears of the death from it."""
    _consumers_of(controller)
    ours = set(descendants(controller.pid))
    (zygote_pid,) = [pid for pid, title in stoker_processes() if pid in ours and title == "stoker zygote"]
    producer = next(pid for pid, title in stoker_processes() if title.startswith("stoker producer")
                    and _parent(pid) == zygote_pid)
    os.kill(zygote_pid, signal.SIGSTOP)
    os.kill(producer, signal.SIGKILL)
    return zygote_pid


@pytest.mark.timeout(240)
def test_a_stopped_producers_zygote_is_replaced_and_its_dead_producer_noticed(textures, tmp_path):
    """Issue 53 (3): a killed producer of a stopped zygote was never noticed (its part never built again: training
    stalled, then the consumers were killed as stuck), and the controller blocked forever forking its
    replacement. Now the death is read from the producer's own /proc entry, and the zygote, stopped past
    STOPPED_S, is replaced: the run completes with every sample once."""
    run_dir = tmp_path / "run"
    controller = _train_slowly(textures, run_dir, extra=("--producers", "2"))
    try:
        zygote_pid = _producers_zygote_stopped_and_a_producer_killed(controller)
        _, stderr = controller.communicate(timeout=180)
    finally:
        controller.kill()
        controller.communicate()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert controller.returncode == 0 and summary["status"] == "completed", stderr[-3000:]
    assert summary["duplicate_samples"] == summary["missing_samples"] == 0 and summary["skipped_files"] == []
    assert f"stoker zygote (pid {zygote_pid}) did not answer a fork (stopped?): replacing it" in stderr
    assert _gone({zygote_pid}, 30)


@pytest.mark.timeout(240)
def test_sigterm_while_the_producers_zygote_is_stopped_ends_the_run(textures, tmp_path):
    """Before, the controller sat in the read of the stopped zygote's answer and a first SIGTERM did nothing."""
    run_dir = tmp_path / "run"
    controller = _train_slowly(textures, run_dir, extra=("--producers", "2"))
    try:
        zygote_pid = _producers_zygote_stopped_and_a_producer_killed(controller)
        time.sleep(0.5)  # the replacement's fork is under way
        controller.send_signal(signal.SIGTERM)
        _, stderr = controller.communicate(timeout=120)
    finally:
        controller.kill()
        controller.communicate()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert controller.returncode == 130 and summary["status"] == "interrupted", stderr[-3000:]
    assert _gone({zygote_pid}, 30)

"""Every way a run stops is clean: a reused run folder, a resume with nothing to resume from, signals at every
moment (start-up, training, shutdown, the report) and from every sender (the controller alone or the whole
process group). Each ends with the status it names, a summary.json, and no process or segment left (the autouse
fixture checks the last two after every test)."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import read_summary, run_cli
from tests.faults.test_faults import events, fault, train_args

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def finished_run(textures, tmp_path_factory):
    """One completed 1-epoch run with a checkpoint at the end of its epoch."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    run_cli(*train_args(textures, run_dir, "--epochs", "1"))
    return run_dir


def test_a_new_run_refuses_a_folder_that_holds_a_run(textures, finished_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    result = run_cli(*train_args(textures, run_dir, "--epochs", "1"), check=False)
    assert result.returncode == 2
    assert "already holds a run" in result.stderr and f"--resume {run_dir}" in result.stderr
    assert "Traceback" not in result.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before  # untouched


@pytest.mark.parametrize("damage", ["truncated", "removed"])
def test_resume_with_no_valid_checkpoint_is_a_clear_error(finished_run, tmp_path, damage):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    for folder in (run_dir / "checkpoints").iterdir():
        if damage == "truncated":
            (folder / "rank_0.pt").write_bytes((folder / "rank_0.pt").read_bytes()[:100])
        else:
            shutil.rmtree(folder)
    result = run_cli("train", "--resume", str(run_dir), "--quiet", check=False)
    assert result.returncode == 2
    assert "no valid checkpoint" in result.stderr and "nothing to resume from" in result.stderr
    assert "Traceback" not in result.stderr


def test_growing_while_a_producer_retires_at_the_budget_waits_for_its_row(tmp_path):
    """At the budget, the autoscaler retires one producer (it counts only active ones) and then asks for one
    more: the retiring producer still holds its status row until it exits, so there is none free yet."""
    import numpy as np

    from stoker.pool import ProducerPool
    from stoker.procs import CONTEXT, Mailbox
    from stoker.producer import ProducerSetup, Source
    from stoker.ring import SlotRing

    ring = SlotRing.create(num_slots=2, batch_size=2, image_size=8, num_status=2)
    mailbox, stop = Mailbox(), CONTEXT.Event()
    setup = ProducerSetup(ring.spec, Source(("none.jpg",), np.zeros(1, np.int64)), None, "none", 0)
    pool = ProducerPool(setup, ring, mailbox, stop, capacity=2, hang_timeout_s=60)
    try:
        assert [pool.grow(), pool.grow()] == [0, 1]
        assert pool.shrink()
        retiring = next(h for h in pool.handles.values() if h.retiring)
        assert pool.grow() is None  # not a ValueError out of the controller
        assert len(pool.active) == 1
        retiring.process.join(timeout=30)
        assert pool.grow() == retiring.producer  # its row, once it has exited
        assert len(pool.active) == 2
    finally:
        stop.set()
        pool.close()
        mailbox.close()
        ring.close()

"""stoker.Loader under faults: a producer SIGKILLed mid-epoch, Ctrl-C in the user's loop, the user's process killed.
Every test ends with no stoker process and no segment left (conftest's leaves_no_trace)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stoker
from stoker.common.procs import StokerRunError
from stoker.pipeline import pool
from stoker.pipeline.ring import sweep_dead_segments

HELPERS = Path(__file__).resolve().parent.parent / "helpers"


@pytest.mark.timeout(120)
def test_producer_killed_mid_epoch_every_sample_still_once(textures):
    train, _ = textures
    seen = []
    with stoker.Loader(train, batch_size=8, image_size=32, producers=2, device="cpu") as loader:
        for step, _ in enumerate(loader):
            seen.extend(loader.batch_ids.tolist())
            if step == 3:
                victim = next(iter(loader.driver.engine.pool.handles.values())).process
                os.kill(victim.pid, signal.SIGKILL)
        summary = loader.summary()
    assert sorted(seen) == list(range(120))
    assert summary["duplicate_samples"] == summary["missing_samples"] == 0
    assert summary["epoch_accounting"][0]["consumed"] == 120


def _epoch_killing_the_fullest_producer(train: Path, kill_at: int | None) -> tuple[list[torch.Tensor], list[int],
                                                                                     dict, list[int], int]:
    images, seen, held, bound = [], [], [], 0
    with stoker.Loader(train, batch_size=8, image_size=32, producers=4, device="cpu", seed=5) as loader:
        for step, (batch, _) in enumerate(loader):
            images.append(batch.clone())
            seen.extend(loader.batch_ids.tolist())
            if step == kill_at:
                # Right after next() returned: the loop trains now, and nothing reads the producers' reports.
                pool = loader.driver.engine.pool
                victim = max(pool.active, key=lambda h: len(h.in_flight))
                held = [t.end - t.first for t in victim.in_flight.values()]
                bound = pool.max_in_flight * max(held)
                os.kill(victim.process.pid, signal.SIGKILL)
        summary = loader.summary()
    return images, seen, summary, held, bound


@pytest.mark.timeout(120)
def test_a_producer_killed_holding_parts_of_two_batches_has_all_of_them_rebuilt(textures, monkeypatch):
    """Between next() calls a producer may hold two whole batches (as DataLoader's workers keep prefetch_factor=2),
    not one, so it does not run dry while the loop trains; killed then, every part it held is built again: the
    epoch has the same bytes as an undisturbed loader's, every sample once. Reads are slowed so that the producers
    are the bottleneck by construction: the ring's slots are then parts in flight, not finished batches waiting, and
    the fullest of the 4 producers holds several of them (the ring's 6 slots of 2 parts, less the loop's, shared
    among them)."""
    monkeypatch.setenv("STOKER_READ_LATENCY_MS", "20")
    train, _ = textures
    undisturbed, _, _, _, _ = _epoch_killing_the_fullest_producer(train, None)
    images, seen, summary, held, bound = _epoch_killing_the_fullest_producer(train, 1)
    assert bound == 2 * 8  # what one producer may hold: two batches of 8
    assert len(held) >= 2 and sum(held) <= bound, held  # several parts, all of them re-issued below
    assert sorted(seen) == list(range(120))
    assert summary["duplicate_samples"] == summary["missing_samples"] == 0
    assert len(images) == len(undisturbed) and all(torch.equal(a, b) for a, b in zip(images, undisturbed))


def _start_user_loop(train: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, str(HELPERS / "loader_idle.py"), str(train)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "training", process.stderr.read()[-3000:]
    return process


@pytest.mark.timeout(120)
def test_ctrl_c_in_the_users_loop_leaves_nothing(textures):
    process = _start_user_loop(textures[0])
    process.send_signal(signal.SIGINT)
    _, errors = process.communicate(timeout=60)
    assert "KeyboardInterrupt" in errors  # the user's loop saw it; the producers and the ring went with the process


@pytest.mark.timeout(120)
def test_the_users_process_killed_leaves_no_orphan(textures):
    process = _start_user_loop(textures[0])
    process.kill()
    _, errors = process.communicate(timeout=60)  # also the resource tracker's stderr: it ends after cleaning up
    assert "resource_tracker" not in errors and "leaked" not in errors, errors  # its clean-up is no news
    sweep_dead_segments()  # what the next start does with a segment of a dead process (the ring's lock is gone)


@pytest.mark.timeout(120)
def test_a_dataset_slow_to_load_in_its_producer_is_not_taken_for_a_hang_on_its_first_item():
    """Loading took 3 s past a 1 s producer timeout: it was blamed on item 0, which was skipped, and another producer
    started (the 1- and 3-producer runs of a suite under load then differed). Loading is the producer's start-up."""
    from tests.helpers.slow_load import SlowToLoad

    with stoker.Loader(SlowToLoad(load_s=3.0), batch_size=4, image_size=16, producers=1, device="cpu",
                       producer_timeout_s=1.0) as loader:
        ids = [i for _ in loader for i in loader.batch_ids.tolist()]
        summary = loader.summary()
    assert sorted(ids) == list(range(16))
    assert summary["skipped_files"] == []


# Every producer of the test below is stuck for good: the limit is only how long the test waits for the pool to say so.
STARTUP_S = 15.0


@pytest.mark.timeout(120)
def test_a_producer_stuck_starting_is_replaced_while_another_works(monkeypatch, tmp_path):
    """Its dataset never finished unpickling: before, its parts waited in its queue for ever (no hang clock runs
    before a part begins) and the epoch never ended. The stuck one is the producer the dataset says it holds, whose
    start-up limit the test makes pass at once: a healthy producer that starts slowly on a loaded machine is
    never taken for it (a 15 s limit for all of them was a race with the machine)."""
    from tests.helpers.slow_load import FirstLoadNeverEnds

    claimed = tmp_path / "claimed"

    def past_its_limit(self, handle, now):  # the limit, injected: passed for the stuck producer alone
        return handle.ready_since is None and claimed.exists() and claimed.read_text() == str(handle.process.pid)

    monkeypatch.setattr(pool.ProducerPool, "_stuck_starting", past_its_limit)
    metrics = tmp_path / "metrics.jsonl"
    with stoker.Loader(FirstLoadNeverEnds(str(claimed)), batch_size=4, image_size=16, producers=2,
                       device="cpu", metrics_file=metrics) as loader:
        ids = [i for _ in loader for i in loader.batch_ids.tolist()]
        summary = loader.summary()
    assert sorted(ids) == list(range(16))
    assert summary["skipped_files"] == []
    lost = [e for e in map(json.loads, metrics.read_text().splitlines()) if e["event"] == "producer_lost"]
    assert len(lost) == 1 and "stuck starting for over" in lost[0]["message"], lost
    assert f"pid {claimed.read_text()})" in lost[0]["message"]  # the stuck one, not a slow healthy one


@pytest.mark.timeout(120)
def test_no_producer_ever_starting_ends_the_feed_with_the_reason(monkeypatch):
    from tests.helpers.slow_load import FirstLoadNeverEnds

    monkeypatch.setattr(pool, "STARTUP_TIMEOUT_S", STARTUP_S)
    with stoker.Loader(FirstLoadNeverEnds(None), batch_size=4, image_size=16, producers=2, device="cpu") as loader:
        with pytest.raises(StokerRunError, match=r"stuck starting for over \d+ s .* 2 producers stuck starting and "
                                                 "none started"):
            next(iter(loader))


def _break_whole_batches(train: Path, root: Path, steps: list[int], batch_size: int, world: int, seed: int
                         ) -> tuple[list[str], set[int]]:
    """A copy of `train` where every file of rank 0's batches `steps` of epoch 0 keeps its JPEG header and loses
    its image data: indexed, then unusable when decoded. Returns the copy's paths and the broken positions."""
    from stoker.data.sources import load_source
    from stoker.pipeline.plan import EpochPlan

    shutil.copytree(train, root)
    paths = list(load_source(root).paths)
    plan = EpochPlan(len(paths), 0, batch_size, world, seed)
    broken = {int(i) for step in steps for i in plan.train_work(0, step, 0).sample_ids}
    for i in broken:
        Path(paths[i]).write_bytes(Path(paths[i]).read_bytes()[:300])
    return paths, broken


@pytest.mark.timeout(180)
def test_a_batch_whose_every_file_is_unusable_is_never_handed_out_empty(textures, tmp_path, monkeypatch):
    """Steps 2 and 3 wholly unusable, and the last two steps too: the loop still gets len() batches, none empty,
    every usable sample once, and `batch_paths` names each batch's files. Only the last two steps, with no later
    batch to take a sample from, repeat one (counted), and the last batch is pulled from the ring once, not again
    for the last step. DataLoader never yields an empty batch: cross_entropy on one is NaN."""
    train, _ = textures
    steps = len(list(train.rglob("*.jpg"))) // 8
    paths, broken = _break_whole_batches(train, tmp_path / "train", [2, 3, steps - 2, steps - 1], 8, 1, 3)
    sizes, seen, named = [], [], []
    with stoker.Loader(tmp_path / "train", batch_size=8, image_size=32, seed=3, producers=2, device="cpu",
                       max_bad_fraction=0.5) as loader:
        assert len(loader) == steps
        for images, labels in loader:
            sizes.append(len(labels))
            assert images.shape[0] == len(labels) == len(loader.batch_ids)
            assert torch.isfinite(torch.nn.functional.cross_entropy(torch.zeros(len(labels), 10), labels))
            seen.extend(loader.batch_ids.tolist())
            named.extend(loader.batch_paths)
        summary = loader.summary()
    assert len(sizes) == steps and min(sizes) >= 1
    usable = set(range(len(paths))) - broken
    assert sorted(seen[:-2]) == sorted(usable) and seen[-2] == seen[-1] == seen[-3]  # one sample, thrice
    assert named == [paths[i] for i in seen]
    assert summary["repeated_samples"] == 2
    assert {item["path"] for item in summary["skipped_files"]} == {paths[i] for i in broken}


@pytest.mark.timeout(180)
def test_an_unusable_batch_on_one_rank_keeps_every_rank_at_len_batches(textures, tmp_path, monkeypatch):
    """Two ranks (RANK/WORLD_SIZE, one after the other): rank 0's step 1 wholly unusable. Both ranks hand out
    len() batches, none empty, and together every usable sample once; a state saved while rank 0 had lent a
    batch's first sample to the empty step resumes with the rest of that batch, not with it whole."""
    train, _ = textures
    paths, broken = _break_whole_batches(train, tmp_path / "train", [1], 8, 2, 4)
    monkeypatch.setenv("WORLD_SIZE", "2")
    seen: list[int] = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        with stoker.Loader(tmp_path / "train", batch_size=8, image_size=32, seed=4, producers=1, device=None,
                           max_bad_fraction=0.5) as loader:
            sizes = []
            for step, (_, labels) in enumerate(loader):
                sizes.append(len(labels))
                seen.extend(loader.batch_ids.tolist())
                if rank == 0 and step == 1:
                    state = loader.state_dict()
                    resumed_from = len(seen)
            assert len(sizes) == len(loader) and min(sizes) >= 1
        if rank == 0:
            rank0_end = len(seen)
    assert sorted(seen) == sorted(set(range(len(paths))) - broken)
    assert state["lent"] == [2, 1]
    monkeypatch.setenv("RANK", "0")
    with stoker.Loader(tmp_path / "train", batch_size=8, image_size=32, seed=4, producers=1, device=None,
                       max_bad_fraction=0.5) as loader:
        loader.load_state_dict(state)
        rest = [i for _ in loader for i in loader.batch_ids.tolist()]
    assert rest == seen[resumed_from:rank0_end]

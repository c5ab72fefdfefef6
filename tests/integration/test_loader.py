"""stoker.Loader in a real 2-rank DDP loop on gloo (tests/helpers/loader_ddp.py, started as torchrun would), on
real image files: the same batches whatever the producers, disjoint ranks, exact resume, bad files."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import stoker
from stoker.data.formats import builtin_data
from tests.conftest import free_port

HELPERS = Path(__file__).resolve().parent.parent / "helpers"
SCRIPT = HELPERS / "loader_ddp.py"


def launch(out: Path, *args: str, world: int = 2, timeout: float = 240) -> list[dict]:
    """`world` ranks of the helper script, as torchrun starts them; returns each rank's record."""
    port = free_port()
    ranks = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        ranks.append(subprocess.Popen([sys.executable, str(SCRIPT), "--out", str(out), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for process in ranks:
        try:
            logs.append(process.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for other in ranks:
                other.kill()
            raise
    for process, text in zip(ranks, logs):
        assert process.returncode == 0, text[-4000:]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """The built-in textures, 10 classes of 12 JPEGs: 120 files, 8 steps of 2 x 8 per epoch (the last short)."""
    folder = tmp_path_factory.mktemp("loader") / "data"
    builtin_data.generate(folder, train_per_class=12, val_per_class=1)
    return folder / "train"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Where the straight run writes its record and its checkpoints."""
    return tmp_path_factory.mktemp("straight")


@pytest.fixture(scope="module")
def straight(images, saved) -> list[dict]:
    """Two epochs, one producer per rank, uninterrupted: what every other run is compared with. It writes the
    checkpoints the resume tests start from as it trains on (after step 5, mid-epoch, and step 8, the end of epoch
    0), so that its own batches also show that taking a state_dict() changes nothing."""
    return launch(saved / "record", "--data", str(images), "--producers", "1", "--save-at", "5,8",
                  "--checkpoint", str(saved / "checkpoint"))


def test_same_batches_whatever_the_producers(images, straight, tmp_path):
    """3 producers against 1; `auto` (producers forked while the loop runs) is one of the resumes below."""
    other = launch(tmp_path / "record", "--data", str(images), "--producers", "3")
    for rank in range(2):
        assert other[rank]["hashes"] == straight[rank]["hashes"], f"rank {rank}: batches differ"
        assert other[rank]["weights"] == straight[rank]["weights"]


def test_ranks_disjoint_and_their_union_is_the_epoch(straight):
    for epoch in range(2):
        seen = [[i for e, ids in rank["ids"] if e == epoch for i in ids] for rank in straight]
        assert not set(seen[0]) & set(seen[1])
        assert sorted(seen[0] + seen[1]) == list(range(120))
        assert all(len(ids) == len(set(ids)) for ids in seen)
    assert straight[0]["len"] == straight[1]["len"] == [8, 8]  # ceil(120 / 16)
    assert straight[0]["summary"]["duplicate_samples"] == straight[0]["summary"]["missing_samples"] == 0


@pytest.mark.parametrize("saved_at,producers", [(5, "auto"), (8, "2")], ids=["mid-epoch", "epoch-boundary"])
def test_resume_from_state_dict_is_exact(images, straight, saved, tmp_path, saved_at, producers):
    """Resumed with other producers than the run that saved (1): with `auto` too, whose count changes as it runs."""
    resumed = launch(tmp_path / "resumed", "--data", str(images), "--producers", producers, "--resume",
                     str(saved / f"checkpoint-{saved_at}"))
    for rank in range(2):
        assert resumed[rank]["hashes"] == straight[rank]["hashes"][saved_at:], f"rank {rank}: batches differ"
        assert resumed[rank]["weights"] == straight[rank]["weights"], f"rank {rank}: weights differ"


def test_a_state_of_another_world_size_trains_the_rest_of_its_epoch_once(images, straight, saved, tmp_path):
    """Saved by 2 ranks after 5 steps of epoch 0 (80 samples); resumed by 3 ranks: the other 40 once, in 2 steps of
    24, then epoch 1 whole in 5; and from that job's state after 3 steps of epoch 1 (72 samples), 2 ranks train the
    other 48 once."""
    three = launch(tmp_path / "three", "--data", str(images), "--resume", str(saved / "checkpoint-5"), "--save-at",
                   "10", "--checkpoint", str(tmp_path / "checkpoint"), world=3)
    before = [i for rank in straight for _, ids in rank["ids"][:5] for i in ids]
    rest = [i for rank in three for epoch, ids in rank["ids"] if epoch == 0 for i in ids]
    assert sorted(before + rest) == list(range(120))
    assert [rank["len"] for rank in three] == [[5 + 2, 5]] * 3
    assert sorted(i for rank in three for epoch, ids in rank["ids"] if epoch == 1 for i in ids) == list(range(120))
    two = launch(tmp_path / "two", "--data", str(images), "--resume", str(tmp_path / "checkpoint-10"), world=2)
    done = [i for rank in three for epoch, ids in rank["ids"][:5] if epoch == 1 for i in ids]
    rest = [i for rank in two for epoch, ids in rank["ids"] if epoch == 1 for i in ids]
    assert len(done) == 72 and sorted(done + rest) == list(range(120))
    assert two[0]["summary"]["duplicate_samples"] == 0


def test_a_corrupt_file_keeps_ranks_in_step_and_is_listed(images, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(images, data)
    broken = sorted((data / sorted(os.listdir(data))[0]).iterdir())[0]
    broken.write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG")
    records = launch(tmp_path / "record", "--data", str(data), "--epochs", "1")
    assert records[0]["len"] == records[1]["len"] == [8]
    assert records[0]["batches"] == records[1]["batches"] == [8]
    listed = [item["path"] for rank in records for item in rank["summary"]["skipped_files"]]
    assert listed == [str(broken.resolve())]
    served = sum(len(ids) for rank in records for _, ids in rank["ids"])
    assert served == 119


def test_user_dataset_same_bytes_with_1_and_3_producers():
    """One rank, so in this process (no launch): the helper's NoisyDataset draws its own augmentation from Python's
    random, NumPy's and torch's generators, which the producers seed per sample."""
    from tests.helpers.loader_ddp import NoisyDataset

    def batch_hashes(producers: int) -> list[str]:
        with stoker.Loader(NoisyDataset(), batch_size=8, image_size=16, seed=3, producers=producers, device="cpu",
                           max_producers=3) as loader:
            return [hashlib.sha256(images.numpy().tobytes()).hexdigest() for images, _ in loader]

    one = batch_hashes(1)
    assert len(one) == 8  # ceil(60 / 8)
    assert batch_hashes(3) == one

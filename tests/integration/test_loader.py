"""stoker.Loader in a real 2-rank DDP loop on gloo (tests/helpers/loader_ddp.py, started as torchrun would), on
real image files: the same batches whatever the producers, disjoint ranks, exact resume, bad files."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.data import builtin_data

HELPERS = Path(__file__).resolve().parent.parent / "helpers"
SCRIPT = HELPERS / "loader_ddp.py"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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
def straight(images, tmp_path_factory) -> list[dict]:
    """Two epochs, one producer per rank, uninterrupted: what every other run is compared with."""
    return launch(tmp_path_factory.mktemp("straight") / "record", "--data", str(images), "--producers", "1")


@pytest.mark.parametrize("producers", ["3", "auto"])
def test_same_batches_whatever_the_producers(images, straight, tmp_path, producers):
    other = launch(tmp_path / "record", "--data", str(images), "--producers", producers)
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


@pytest.mark.parametrize("stop_after", [5, 8], ids=["mid-epoch", "epoch-boundary"])
def test_resume_from_state_dict_is_exact(images, straight, tmp_path, stop_after):
    checkpoint = str(tmp_path / "checkpoint")
    first = launch(tmp_path / "first", "--data", str(images), "--producers", "2", "--stop-after", str(stop_after),
                   "--checkpoint", checkpoint)
    second = launch(tmp_path / "second", "--data", str(images), "--producers", "3", "--checkpoint", checkpoint,
                    "--resume")
    for rank in range(2):
        assert first[rank]["hashes"] + second[rank]["hashes"] == straight[rank]["hashes"]
        assert second[rank]["weights"] == straight[rank]["weights"], f"rank {rank}: weights differ"


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


def test_user_dataset_same_bytes_with_1_and_3_producers(tmp_path):
    one = launch(tmp_path / "one", "--data", "noisy", "--producers", "1", "--epochs", "1", world=1)
    three = launch(tmp_path / "three", "--data", "noisy", "--producers", "3", "--epochs", "1", world=1)
    assert one[0]["hashes"] == three[0]["hashes"]

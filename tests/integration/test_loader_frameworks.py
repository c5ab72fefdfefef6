"""stoker.Loader under Lightning (Trainer with strategy="ddp", 2 CPU ranks) and accelerate (save_state and
load_state); both are optional extras (`pip install 'stoker[frameworks]'`), skipped where missing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import stoker
from stoker.data.formats import builtin_data

HELPERS = Path(__file__).resolve().parent.parent / "helpers"


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("frameworks") / "data"
    builtin_data.generate(folder, train_per_class=8, val_per_class=1)  # 80 files: 5 steps of 2 x 8
    return folder / "train"


def lightning(out: Path, *args: str) -> list[dict]:
    environment = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run([sys.executable, str(HELPERS / "loader_lightning.py"), "--out", str(out), *args],
                            capture_output=True, text=True, timeout=300, env=environment)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]


def test_lightning_ddp_disjoint_ranks_and_resume_from_its_checkpoint(images, tmp_path):
    pytest.importorskip("lightning")
    checkpoint = tmp_path / "epoch1.ckpt"  # written at the end of the first epoch, as ModelCheckpoint would
    straight = lightning(tmp_path / "straight", "--data", str(images), "--epochs", "2", "--save", str(checkpoint))
    for epoch in ("0", "1"):
        ranks = [set(straight[0][epoch]), set(straight[1][epoch])]
        assert not ranks[0] & ranks[1]
        assert sorted(ranks[0] | ranks[1]) == list(range(80))
    resumed = lightning(tmp_path / "resumed", "--data", str(images), "--epochs", "2", "--resume", str(checkpoint))
    for rank in range(2):
        assert resumed[rank] == {"1": straight[rank]["1"]}, f"rank {rank}: the resumed epoch differs"


def _digest(images) -> str:
    return hashlib.sha256(images.numpy().tobytes()).hexdigest()


def test_accelerate_save_state_and_load_state_round_trip(images, tmp_path):
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    with stoker.Loader(images, batch_size=8, image_size=16, seed=3, producers=1, device="cpu") as loader:
        accelerator.register_for_checkpointing(loader)
        batches = iter(loader)
        for _ in range(3):
            next(batches)
        accelerator.save_state(str(tmp_path / "state"))
        expected = [_digest(images) for images, _ in batches]
    accelerator = accelerate.Accelerator(cpu=True)
    with stoker.Loader(images, batch_size=8, image_size=16, seed=3, producers=1, device="cpu") as loader:
        accelerator.register_for_checkpointing(loader)
        accelerator.load_state(str(tmp_path / "state"))
        assert [_digest(images) for images, _ in loader] == expected

"""`stoker pack --raw-max-side`: small training images stored as raw RGB pixels (.npy members) train through the
producers' real crop and resize: every sample once, the same batch bytes with 1 and 3 producers, an exact resume
with other producers, and a damaged raw member refused and named while the epoch goes on."""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
from PIL import Image

import stoker
from stoker.data.pixels import imaging
from tests.conftest import assert_same_weights, photograph_jpeg, read_summary, run_cli, shard_members

MAX_SIDE, RAW_MAX_SIDE = 96, 90
SIZES = [(200, 150), (150, 200), (90, 60), (70, 70)]  # (width, height): shrunk to 96 and stored as JPEG; raw


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """Two classes of 16 real photographs cropped (never upscaled) to the SIZES, one of them a PNG."""
    root = tmp_path_factory.mktemp("photos")
    for index in range(32):
        photo = Image.open(io.BytesIO(photograph_jpeg(index % 2, False)))
        size = SIZES[index % len(SIZES)]
        left, top = (index * 17) % (photo.width - size[0]), (index * 11) % (photo.height - size[1])
        folder = root / f"class{index % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        photo.crop((left, top, left + size[0], top + size[1])).save(
            folder / f"{index:03d}.{'png' if index == 6 else 'jpg'}", quality=92)
    return root


@pytest.fixture(scope="module")
def packed(photos, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "shards"
    run_cli("pack", str(photos), str(out), "--max-side", str(MAX_SIDE), "--raw-max-side", str(RAW_MAX_SIDE),
            "--shard-size", "60KB", "--workers", "2")
    return out


def test_small_images_are_stored_as_their_pixels_and_large_ones_as_jpegs(photos, packed):
    stored = shard_members(packed)
    raw = {name: data for name, data in stored.items() if name.endswith(".npy")}
    jpegs = {name: data for name, data in stored.items() if name.endswith(".jpg")}
    assert len(raw) == 16 and len(jpegs) == 16 and len(list(packed.glob("*.tar"))) > 1
    for name, data in raw.items():
        original = next(photos.glob(name.rsplit(".", 1)[0] + ".*")).read_bytes()
        expected = simplejpeg.decode_jpeg(original) if original[:2] == b"\xff\xd8" else \
            np.asarray(Image.open(io.BytesIO(original)).convert("RGB"))
        assert np.array_equal(imaging.raw_pixels(data), expected)  # lossless and whole: a PNG too
    assert all(max(imaging.stored_size(data) or ()) == MAX_SIDE for data in jpegs.values())


def test_raw_pixels_of_a_shrunk_image_are_those_the_jpeg_would_encode(photos, tmp_path):
    run_cli("pack", str(photos), str(tmp_path / "all"), "--max-side", "64", "--raw-max-side", "64", "--workers", "1")
    stored = shard_members(tmp_path / "all")
    assert sum(name.endswith(".npy") for name in stored) == 32
    original = (photos / "class0" / "000.jpg").read_bytes()  # 200x150
    pixels = imaging.raw_pixels(stored["class0/000.npy"])
    assert pixels.shape == (48, 64, 3)
    assert np.array_equal(pixels, imaging.shrunk_pixels(original, (150, 200), 64))


def epochs(data: Path, producers: int, state: dict | None = None, save_after: int = -1) -> tuple[list, list, dict]:
    """(hash of each batch's uint8 bytes, its sample ids per epoch, the state after `save_after` batches) of two
    epochs of RandomResizedCrop + flip at 32 px, batches of 6, from `state` where given."""
    hashes: list[str] = []
    ids: list[tuple[int, list[int]]] = []
    saved: dict = {}
    with stoker.Loader(data, batch_size=6, image_size=32, seed=7, device=None, producers=producers,
                       max_producers=3) as loader:
        first = 0
        if state is not None:
            loader.load_state_dict(state)
            first = state["epoch"]
        for epoch in range(first, 2):
            loader.set_epoch(epoch)
            for images, _ in loader:
                hashes.append(hashlib.sha256(images.numpy().tobytes()).hexdigest())
                ids.append((epoch, loader.batch_ids.tolist()))
                if len(hashes) == save_after:
                    saved = loader.state_dict()
        saved["summary"] = loader.summary()
    return hashes, ids, saved


def test_raw_members_train_every_sample_once_the_same_bytes_whatever_the_producers_and_resume_exactly(packed):
    one, ids, state = epochs(packed, 1, save_after=4)
    assert len(one) == 12  # ceil(32 / 6) a epoch
    for epoch in (0, 1):
        seen = [i for e, batch in ids if e == epoch for i in batch]
        assert sorted(seen) == list(range(32))
    assert state["summary"]["skipped_files"] == []
    three, _, _ = epochs(packed, 3)
    assert three == one
    resumed, _, _ = epochs(packed, 2, state={k: v for k, v in state.items() if k != "summary"})
    assert resumed == one[4:]


def more_rows(found: re.Match) -> bytes:
    return b"'shape': (" + str(int(found[1]) + 1).encode()


def test_a_damaged_raw_member_is_refused_and_named_and_the_epoch_goes_on(packed, tmp_path):
    """One raw member cut short inside its pixels, another whose header claims more rows than it holds."""
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    cut: list[str] = []
    for shard in sorted(packed.glob("*.tar")):
        with tarfile.open(shard) as source, tarfile.open(damaged / shard.name, "w", format=tarfile.GNU_FORMAT) as out:
            for member in source.getmembers():
                data = source.extractfile(member).read()  # type: ignore[union-attr]
                if member.name.endswith(".npy") and len(cut) < 2:
                    data = data[:-100] if not cut else re.sub(rb"'shape': \((\d+)", more_rows, data, count=1)
                    assert data != source.extractfile(member).read()  # type: ignore[union-attr]
                    cut.append(f"{damaged / shard.name}:{member.name.rsplit('.', 1)[0]}")
                member.size = len(data)
                out.addfile(member, io.BytesIO(data))
    _, ids, state = epochs(damaged, 1)
    listed = {item["path"]: item["reason"] for item in state["summary"]["skipped_files"]}
    assert listed.keys() == set(cut)
    assert all(reason.startswith("truncated: raw pixels of") for reason in listed.values())
    assert len({i for e, batch in ids if e == 1 for i in batch}) == 30


def test_stoker_train_on_raw_members_resumes_exactly_with_other_producers(packed, tmp_path):
    """Interrupted at step 5 of 32 (2 epochs of 32 in batches of 2) with 1 producer, resumed with 3: bitwise the
    weights of the run that was never stopped."""
    common = ("--data", str(packed), "--epochs", "2", "--seed", "3", "--batch-size", "2", "--image-size", "32",
              "--quiet")
    run_cli("train", *common, "--producers", "1", "--out", str(tmp_path / "straight"))
    stopped = run_cli("train", *common, "--producers", "1", "--out", str(tmp_path / "resumed"),
                      env={"STOKER_FAULT": "consumer:interrupt-parent:rank=0,step=5;"}, check=False)
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    run_cli("train", "--resume", str(tmp_path / "resumed"), "--producers", "3", "--quiet")
    summary = read_summary(tmp_path / "resumed")
    assert summary["status"] == "completed" and 5 < summary["start_step"] < 32
    assert summary["duplicate_samples"] == 0 and summary["missing_samples"] == 0 and summary["skipped_files"] == []
    assert_same_weights(tmp_path / "straight", tmp_path / "resumed")

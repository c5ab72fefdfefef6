"""--image-size-ramp through `stoker train`: each epoch trains at the side FFCV's ImageNet recipe gives it (its
`get_resolution`, written here from its definition), validation stays at --val-image-size, a run interrupted
mid-ramp and resumed trains on the bytes of an uninterrupted one, and a bad ramp stops before any process starts
with the setting named."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import stoker
from tests.conftest import assert_same_weights, read_summary, run_cli
from tests.unit.test_size_ramp import ffcv_resolution

RAMP = "16:48@0-2"  # 16 px at epoch 0, 48 px from epoch 2 on, 32 px between
EPOCHS, BATCH = 3, 16


def _train(textures, out: Path, records: Path, *extra: str, env: dict | None = None, check: bool = True):
    train, val = textures
    return run_cli("train", "--data", str(train), "--val", str(val), "--batch-size", str(BATCH),
                   "--image-size-ramp", RAMP, "--val-image-size", "24", "--model", "sized:recording_cnn",
                   "--devices", "cpu:1", "--epochs", str(EPOCHS), "--seed", "3", "--out", str(out), "--quiet",
                   "--slots-per-consumer", "2", *extra, check=check,
                   env={"STOKER_TEST_SHAPES": str(records / "shapes.txt"),
                        "STOKER_TEST_DIGESTS": str(records / "digests.txt"), **(env or {})})


def _consumer(path: Path, mode: str) -> list[str]:
    """What the consumer's model saw in `mode`, in order (the controller's model check, MainProcess, left out)."""
    rows = [line.split("|") for line in path.read_text().splitlines()]
    return [value for process, seen, value in rows if process != "MainProcess" and seen == mode]


def test_each_epoch_trains_at_the_ramps_side_and_a_resume_mid_ramp_trains_on_the_same_bytes(textures, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    straight.mkdir()
    split.mkdir()
    _train(textures, straight / "run", straight, "--producers", "1")
    summary = read_summary(straight / "run")
    steps = summary["steps"] // EPOCHS
    shapes = [ast.literal_eval(shape) for shape in _consumer(straight / "shapes.txt", "train")]
    assert len(shapes) == EPOCHS * steps
    sides = [{shape[2:] for shape in shapes[epoch * steps:(epoch + 1) * steps]} for epoch in range(EPOCHS)]
    expected = [ffcv_resolution(epoch, 16, 48, 0, 2) for epoch in range(EPOCHS)]
    assert expected == [16, 32, 48]  # three sides: the ramp's middle is not a step from MIN to MAX
    assert sides == [{(side, side)} for side in expected]
    assert {ast.literal_eval(shape)[1:] for shape in _consumer(straight / "shapes.txt", "eval")} == {(3, 24, 24)}
    assert (summary["image_size"], summary["val_image_size"]) == (48, 24)

    # Interrupted in epoch 1 (32 px), resumed with other producers: the batches from the checkpoint on are the
    # uninterrupted run's, byte for byte, and so are the weights.
    result = _train(textures, split / "run", split, "--producers", "2", check=False,
                    env={"STOKER_FAULT": f"consumer:interrupt-parent:rank=0,step={steps + 2};"})
    assert result.returncode == 130, result.stderr[-2000:]
    (split / "digests.txt").rename(split / "before.txt")
    run_cli("train", "--resume", str(split / "run"), "--quiet", "--producers", "2",
            env={"STOKER_TEST_SHAPES": str(split / "shapes.txt"), "STOKER_TEST_DIGESTS": str(split / "digests.txt")})
    start = read_summary(split / "run")["start_step"]
    assert steps <= start < 2 * steps  # resumed mid-ramp, in epoch 1
    resumed = _consumer(split / "digests.txt", "train")
    assert resumed == _consumer(straight / "digests.txt", "train")[start:]
    assert_same_weights(straight / "run", split / "run")


def test_bad_ramps_stop_before_any_process_naming_the_setting(textures, tmp_path):
    train, val = textures
    for index, (ramp, words) in enumerate((("48:16@0-2", "MIN 48 is above MAX 16"),
                                           ("16:48@3-1", "END epoch 1 is before START epoch 3"),
                                           ("0:48@0-2", "sizes from 8 to 2048 px"),
                                           ("16-48", "expected MIN:MAX@START-END"))):
        out = tmp_path / f"run{index}"
        result = run_cli("train", "--data", str(train), "--val", str(val), "--image-size-ramp", ramp,
                         "--devices", "cpu:1", "--out", str(out), "--quiet", check=False)
        assert result.returncode == 2, result.stderr[-2000:]
        assert f"image_size_ramp='{ramp}'" in result.stderr and words in result.stderr, result.stderr[-2000:]
        assert not out.exists()


@pytest.mark.parametrize("device", [None, "cpu"], ids=["host", "device"])
def test_a_loader_hands_out_each_epoch_at_the_ramps_side(textures, device):
    with stoker.Loader(textures[0], batch_size=BATCH, image_size_ramp=RAMP, producers=1, device=device) as loader:
        for epoch in range(EPOCHS):
            loader.set_epoch(epoch)
            sides = {tuple(images.shape[1:]) for images, _ in loader}
            side = ffcv_resolution(epoch, 16, 48, 0, 2)
            assert sides == {(3, side, side)}, epoch
        assert loader.summary()["duplicate_samples"] == 0


def test_a_loader_refuses_a_ramp_over_a_map_style_dataset():
    class Squares:
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return np.zeros((16, 16, 3), np.uint8), index % 2

    with pytest.raises(ValueError, match="image_size_ramp='16:48@0-2': a map-style dataset's items keep"):
        stoker.Loader(Squares(), batch_size=2, image_size_ramp=RAMP)

"""The training recipe end to end through `stoker train`, with every switch on: the same batches (pixels and
mixing) whatever the number of producers, replicas (and their EMAs) identical, an interrupted and resumed run
bitwise the uninterrupted one; and fine-tuning from --init pays."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from stoker.training.models import build_model
from tests.conftest import assert_same_weights, read_summary, run_cli

EVERY_SWITCH = ("--augment", "trivial", "--mixup", "0.2", "--cutmix", "1.0", "--label-smoothing", "0.1",
                "--ema", "0.9", "--clip-grad-norm", "1.0", "--random-erasing", "0.5", "--warmup-epochs", "0.5",
                "--schedule", "step", "--lr-head-multiplier", "2", "--no-decay-norm-bias", "true")


def _init_file(folder: Path) -> Path:
    """Pretrained weights with another head (7 classes) under a 'model' key."""
    torch.manual_seed(3)
    path = folder / "pretrained.pt"
    torch.save({"model": build_model("resnet8", 7).state_dict()}, path)
    return path


def _train(textures, out: Path, *extra: str, env: dict | None = None, check: bool = True):
    train, val = textures
    return run_cli("train", "--data", str(train), "--val", str(val), "--batch-size", "8", "--image-size", "32",
                   "--devices", "cpu:2", "--epochs", "1", "--seed", "5", "--out", str(out), "--quiet",
                   "--slots-per-consumer", "2",  # few steps prepared ahead: the interrupt leaves steps to resume
                   *EVERY_SWITCH, *extra, env=env, check=check)


def test_every_switch_same_weights_whatever_the_producers_and_across_a_resume(textures, tmp_path):
    """1 producer straight through against 3 producers interrupted and resumed: bitwise the same model and EMA
    (either difference alone would break it); replicas and their EMAs identical."""
    init = _init_file(tmp_path)
    straight, split = tmp_path / "straight", tmp_path / "split"
    _train(textures, straight, "--producers", "1", "--init", str(init), "--check-replicas-every", "1")
    result = _train(textures, split, "--producers", "3", "--init", str(init),
                    env={"STOKER_FAULT": "consumer:interrupt-parent:rank=0,step=2;"}, check=False)
    assert result.returncode == 130, result.stderr[-2000:]
    run_cli("train", "--resume", str(split), "--devices", "cpu:2", "--quiet")
    summary = read_summary(straight)
    assert summary["status"] == "completed" and summary["replicas_identical"] is True
    assert summary["replica_mismatch_steps"] == []
    assert summary["ema_val_accuracy"] is not None and summary["val_top5_accuracy"] is not None
    assert 2 < read_summary(split)["start_step"] < 8  # the resumed part trained steps of its own
    assert_same_weights(straight, split)
    assert_same_weights(straight, split, "model_ema.pt")
    last = sorted((straight / "checkpoints").glob("step_*"))[-1]
    ema_0 = torch.load(last / "rank_0.pt", weights_only=True)["ema"]
    ema_1 = torch.load(last / "rank_1.pt", weights_only=True)["ema"]
    for name in ema_0:  # the EMA of the averaged model: the same on both replicas
        assert torch.equal(ema_0[name], ema_1[name]), name


def test_bad_init_stops_before_any_process_with_exit_2(textures, tmp_path):
    state = build_model("resnet8", 10).state_dict()
    del state["stem.0.weight"]
    path = tmp_path / "bad.pt"
    torch.save(state, path)
    train, val = textures
    result = run_cli("train", "--data", str(train), "--val", str(val), "--init", str(path), "--out",
                     str(tmp_path / "run"), "--quiet", check=False)
    assert result.returncode == 2
    assert "missing: stem.0.weight" in result.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_validation_runs_at_val_image_size(textures, tmp_path):
    """--image-size 16 --val-image-size 24 through `stoker train`: the consumer's model trains on 16 px batches
    and validates on 24 px ones (the model writes down every input it sees); summary.json records both sides."""
    shapes = tmp_path / "shapes.txt"
    train, val = textures
    run_cli("train", "--data", str(train), "--val", str(val), "--batch-size", "16", "--image-size", "16",
            "--val-image-size", "24", "--model", "sized:recording_cnn", "--devices", "cpu:1", "--epochs", "1",
            "--out", str(tmp_path / "run"), "--quiet", env={"STOKER_TEST_SHAPES": str(shapes)})
    seen = [line.split("|") for line in shapes.read_text().splitlines()]
    # The controller's own forwards (its model check, MainProcess) are left out: the consumer's are the test.
    consumer = [(mode, ast.literal_eval(shape)) for process, mode, shape in seen if process != "MainProcess"]
    assert {shape[1:] for mode, shape in consumer if mode == "train"} == {(3, 16, 16)}
    assert {shape[1:] for mode, shape in consumer if mode == "eval"} == {(3, 24, 24)}
    summary = read_summary(tmp_path / "run")
    assert (summary["image_size"], summary["val_image_size"]) == (16, 24)
    assert summary["val_accuracy"] is not None


def test_recipe_settings_that_cannot_apply_stop_with_exit_2_naming_them(textures, tmp_path):
    train, val = textures
    common = ("train", "--data", str(train), "--val", str(val), "--quiet", "--devices", "cpu:1")
    headless = run_cli(*common, "--model", "sized:conv_head", "--lr-head-multiplier", "3", "--out",
                       str(tmp_path / "a"), check=False)
    assert headless.returncode == 2 and "lr_head_multiplier=3.0" in headless.stderr, headless.stderr[-2000:]
    tiny = run_cli(*common, "--val-image-size", "4", "--out", str(tmp_path / "b"), check=False)
    assert tiny.returncode == 2 and "val_image_size='4'" in tiny.stderr, tiny.stderr[-2000:]
    assert not (tmp_path / "a" / "summary.json").exists() and not (tmp_path / "b").exists()

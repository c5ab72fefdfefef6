"""Using what a run trained: model_best.pt is the model of the best validation, not the last; `stoker.load` gives
back the accuracy validation measured. One short real run (2 consumers, gloo) serves every test here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import stoker
from tests.conftest import read_summary, run_cli

TRAIN_PER_CLASS, VAL_PER_CLASS = 30, 10


def write_rotated_digits(root: Path) -> tuple[Path, Path]:
    """scikit-learn's digits; validation's class folders rotated by one (the 3s are filed under 4): the better the
    model learns the training set, the lower its validation accuracy, so validation accuracy goes down."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    seen: dict[int, int] = {}
    for index, (image, label) in enumerate(zip(bunch.images, bunch.target)):
        count = seen[label] = seen.get(label, 0) + 1
        if count > TRAIN_PER_CLASS + VAL_PER_CLASS:
            continue
        split, folder = ("train", label) if count <= TRAIN_PER_CLASS else ("val", (label + 1) % 10)
        target = root / split / str(folder)
        target.mkdir(parents=True, exist_ok=True)
        Image.fromarray((image * (255 / 16)).round().astype(np.uint8), mode="L").save(target / f"{index:04d}.png")
    return root / "train", root / "val"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(run folder, train, val) of a 3-epoch run whose validation accuracy goes down."""
    train, val = write_rotated_digits(tmp_path_factory.mktemp("digits"))
    out = tmp_path_factory.mktemp("runs") / "rotated"
    run_cli("train", "--data", str(train), "--val", str(val), "--devices", "cpu:2", "--producers", "1",
            "--augment", "none", "--image-size", "16", "--batch-size", "16", "--epochs", "3", "--lr", "0.02",
            "--seed", "0", "--out", str(out), "--quiet", "--report", "false")
    return out, train, val


def val_accuracies(run_dir: Path) -> list[float]:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = sorted((e["epoch"], e["accuracy"]) for e in events if e["event"] == "val")
    return [accuracy for _, accuracy in vals]


def accuracy_of(model_file: Path, val: Path) -> float:
    """Top-1 of the file's model on the folder, counted here one file at a time (no stoker pipeline)."""
    model = stoker.load(model_file)
    files = sorted(val.glob("*/*.png"))
    batch = torch.stack([model.preprocess(f) for f in files])
    predicted = model(batch).argmax(1).tolist()
    return float(np.mean([model.classes[p] == f.parent.name for p, f in zip(predicted, files)]))


def test_model_best_is_the_epoch_of_the_best_validation_not_the_last(run):
    run_dir, _, val = run
    accuracies = val_accuracies(run_dir)
    best = int(np.argmax(accuracies))  # the first of equals: a later tie does not replace the file
    assert len(accuracies) == 3 and accuracies[-1] < accuracies[best], accuracies  # the run this test needs
    summary = read_summary(run_dir)
    assert summary["model_best"] == str(run_dir / "model_best.pt")
    assert (summary["best_epoch"], summary["best_val_accuracy"]) == (best + 1, accuracies[best])
    card = torch.load(run_dir / "model_best.pt", weights_only=True)["card"]
    assert (card["kind"], card["epoch"], card["val_accuracy"]) == ("best", best + 1, accuracies[best])
    # what the files hold is what validation measured: the best epoch's model, and the last one's
    assert accuracy_of(run_dir / "model_best.pt", val) == pytest.approx(accuracies[best], abs=1e-9)
    assert accuracy_of(run_dir / "model.pt", val) == pytest.approx(accuracies[-1], abs=1e-9)

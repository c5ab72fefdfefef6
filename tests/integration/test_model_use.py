"""Using what a run trained: model_best.pt is the model of the best validation, not the last; `stoker.load` gives
back the accuracy validation measured. One short real run (2 consumers, gloo) serves every test here."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import stoker
from stoker.cli import main
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
            "--seed", "0", "--ema", "0.9", "--out", str(out), "--quiet", "--report", "false")
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


def test_the_ema_model_carries_the_same_card(run):
    run_dir, _, _ = run
    ema, final = stoker.load(run_dir / "model_ema.pt"), stoker.load(run_dir)
    assert (ema.card.kind, final.card.kind) == ("ema", "final")
    assert (ema.classes, ema.image_size, ema.card.model) == (final.classes, 16, "resnet8")
    assert read_summary(run_dir)["model_ema"] == str(run_dir / "model_ema.pt")


@pytest.fixture(scope="module")
def evaluated(run, tmp_path_factory) -> tuple[dict, str]:
    """(the JSON, the table) of `stoker eval` on the run's validation folder."""
    run_dir, _, val = run
    figures = tmp_path_factory.mktemp("eval") / "eval.json"
    table = io.StringIO()
    with contextlib.redirect_stdout(table):
        assert main(["eval", str(run_dir / "model.pt"), "--data", str(val), "--devices", "cpu", "--batch-size",
                     "7", "--producers", "1", "--json", str(figures)]) == 0
    return json.loads(figures.read_text()), table.getvalue()


def test_eval_top1_is_the_runs_own_final_validation_accuracy(run, evaluated):
    run_dir, _, _ = run
    result, table = evaluated
    summary = read_summary(run_dir)
    assert result["count"] == 10 * VAL_PER_CLASS and not result["skipped_files"]
    assert result["top1"] == summary["val_accuracy"]  # counts of the same images: exactly equal
    assert result["loss"] == pytest.approx(summary["val_loss"], rel=1e-4)
    assert result["top1"] <= result["top5"] <= 1
    matrix = result["confusion"]["matrix"]
    assert result["confusion"]["classes"] == summary["classes"] and sum(map(sum, matrix)) == result["count"]
    assert sum(matrix[i][i] for i in range(10)) == round(result["top1"] * result["count"])
    for position, name in enumerate(summary["classes"]):
        assert result["per_class"][name] == matrix[position][position] / VAL_PER_CLASS
    assert f"top-1      {100 * result['top1']:.2f}%" in table and "confusion (rows: true class" in table


def test_predict_lists_every_image_and_its_top1_agrees_with_eval(run, evaluated, tmp_path, capsys):
    run_dir, _, val = run
    images = tmp_path / "images"
    shutil.copytree(val, images / "nested")  # class folders or not: every image below, recursively
    (images / "junk.png").write_bytes(b"not a png")
    assert main(["predict", str(run_dir / "model.pt"), str(images), "--top-k", "3", "--devices", "cpu",
                 "--producers", "1"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == 10 * VAL_PER_CLASS + 1
    bad = [row for row in rows if row["error"]]
    assert [row["path"] for row in bad] == [str(images / "junk.png")] and bad[0]["class_1"] == ""
    good = [row for row in rows if not row["error"]]
    assert all(float(r["probability_1"]) >= float(r["probability_2"]) >= float(r["probability_3"]) for r in good)
    top1 = np.mean([Path(row["path"]).parent.name == row["class_1"] for row in good])
    assert top1 == pytest.approx(evaluated[0]["top1"], abs=1e-9)


@pytest.mark.parametrize("command", ["eval", "predict"])
def test_bad_input_is_one_line_and_exit_2(run, tmp_path, capsys, command):
    run_dir, _, val = run
    empty = tmp_path / "empty"
    empty.mkdir()
    foreign = tmp_path / "model.pt"
    foreign.write_bytes(b"PK\x03\x04 not really")
    extra = tmp_path / "extra"
    shutil.copytree(val, extra)
    (extra / "10").mkdir()
    shutil.copy(next((extra / "1").iterdir()), extra / "10")

    def error_of(*args: str) -> str:
        assert main([command, *args]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("stoker: error: "), lines
        return lines[0]

    folder = ["--data", str(empty)] if command == "eval" else [str(empty)]
    assert str(foreign) in error_of(str(foreign), *folder)
    assert str(empty) in error_of(str(run_dir), *folder)
    if command == "eval":
        assert "class folder(s) '10' are not classes of the model" in error_of(str(run_dir), "--data", str(extra))

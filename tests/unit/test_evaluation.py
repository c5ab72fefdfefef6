"""Validation metrics against scikit-learn's own: the confusion matrix, top-5, per-class accuracy; the summary's
matrix up to 50 classes and the most confused pairs beyond; the report's confusion panel."""

from __future__ import annotations

import json

import numpy as np
import torch
from sklearn.metrics import confusion_matrix, top_k_accuracy_score

from stoker.observe.evaluation import confusion_summary, per_class_accuracy
from stoker.training.val_totals import ValTotals


def test_totals_match_scikit_learn() -> None:
    generator = torch.Generator().manual_seed(0)
    totals = ValTotals(12, torch.device("cpu"))
    all_logits, all_labels = [], []
    for _ in range(3):
        logits = torch.randn(40, 12, generator=generator)
        labels = torch.randint(0, 12, (40,), generator=generator)
        logits[torch.arange(40), labels] += 1.5  # better than chance, so the figures mean something
        totals.add(logits, labels)
        all_logits.append(logits)
        all_labels.append(labels)
    result = totals.reduce()
    assert result is not None
    logits, labels = torch.cat(all_logits).numpy(), torch.cat(all_labels).numpy()
    expected = confusion_matrix(labels, logits.argmax(1), labels=list(range(12)))
    assert np.array_equal(np.array(result.confusion), expected)
    assert result.top5 == top_k_accuracy_score(labels, logits, k=5, labels=list(range(12)))
    assert result.accuracy == (logits.argmax(1) == labels).mean()
    recall = expected.diagonal() / expected.sum(1)
    assert np.allclose([a if a is not None else np.nan for a in result.per_class], recall, equal_nan=True)
    names = [f"c{i}" for i in range(12)]
    assert list(per_class_accuracy(result.confusion, names).values()) == result.per_class


def test_matrix_up_to_50_classes_then_the_20_most_confused_pairs() -> None:
    small = confusion_summary([[3, 1], [0, 4]], ["a", "b"])
    assert small == {"classes": ["a", "b"], "matrix": [[3, 1], [0, 4]]}
    rng = np.random.default_rng(0)
    matrix = rng.integers(0, 3, (60, 60))
    matrix[7, 9], matrix[2, 1] = 50, 40
    names = [f"k{i}" for i in range(60)]
    large = confusion_summary(matrix.tolist(), names)
    pairs = large["most_confused"]
    assert len(pairs) == 20 and "matrix" not in large
    assert pairs[0] == {"true": "k7", "predicted": "k9", "count": 50}
    assert pairs[1] == {"true": "k2", "predicted": "k1", "count": 40}
    off_diagonal = sorted((matrix[t, p] for t in range(60) for p in range(60) if t != p), reverse=True)
    assert [p["count"] for p in pairs] == off_diagonal[:20]
    json.dumps(large)  # it goes into summary.json


def test_eval_json_holds_the_whole_matrix_beyond_50_classes_and_its_table_the_same_pairs() -> None:
    from stoker.observe.eval_report import PAIRS_SHOWN, eval_table
    from stoker.observe.evaluation import whole_confusion

    rng = np.random.default_rng(1)
    matrix = rng.integers(0, 4, (60, 60))  # many ties: the order among equal counts is the test
    names = [f"k{i}" for i in range(60)]
    confusion = whole_confusion(matrix.tolist(), names)
    assert confusion["matrix"] == matrix.tolist() and confusion["classes"] == names
    json.dumps(confusion)
    true, predicted = np.nonzero((matrix > 0) & ~np.eye(60, dtype=bool))
    counts = matrix[true, predicted]
    order = np.lexsort((predicted, true, -counts))[:20]  # most first; ties by true class, then predicted
    assert [(p["true"], p["predicted"], p["count"]) for p in confusion["most_confused"]] == \
        [(names[t], names[q], int(n)) for t, q, n in zip(true[order], predicted[order], counts[order])]
    result = {"model": "m.pt", "architecture": "resnet8", "num_classes": 60, "image_size": 32, "data": "d",
              "count": int(matrix.sum()), "loss": 1.0, "top1": 0.5, "top5": 0.9, "skipped_files": [],
              "per_class": per_class_accuracy(matrix.tolist(), names), "confusion": confusion}
    shown = eval_table(result).split("most confused (true -> predicted: images)\n")[1].splitlines()
    assert shown == [f"  {p['true']} -> {p['predicted']}: {p['count']}"
                     for p in confusion["most_confused"][:PAIRS_SHOWN]]


def test_report_draws_the_confusion_panel(tmp_path) -> None:
    from stoker.observe.report import RunRecord, draw

    summary = {"num_consumers": 1, "compute_fraction": [0.9], "input_stall_fraction": [0.0],
               "averaging_fraction": [0.0], "verdict": {"text": "x"},
               "val_confusion": confusion_summary([[3, 1], [0, 4]], ["a", "b"]),
               "val_per_class_accuracy": {"a": 0.75, "b": 1.0}}
    run = RunRecord("r", summary, {"pipeline": [], "val": [], "step": []})
    for confusion in (summary["val_confusion"], {"classes": None, "most_confused": [
            {"true": "a", "predicted": "b", "count": 3}]}):
        out = tmp_path / "report.png"
        draw([RunRecord("r", {**summary, "val_confusion": confusion}, run.events)], out)
        assert out.stat().st_size > 10_000


def test_adding_a_validation_batch_reads_nothing_back_to_the_host() -> None:
    """On a GPU a value read back (torch.bincount's max().item()) is a host synchronization per validation batch.
    The meta device has shapes but no values: whatever would read one fails there."""
    totals = ValTotals(7, torch.device("meta"))
    totals.add(torch.empty(5, 7, device="meta"), torch.empty(5, dtype=torch.int64, device="meta"))
    assert totals.confusion.shape == (49,)

"""What validation says beyond loss and top-1, for summary.json and the report: top-5, per-class accuracy, the
confusion matrix (whole up to `MATRIX_MAX_CLASSES` classes, else its most confused pairs), and the EMA model's
figures beside the raw model's."""

from __future__ import annotations

from typing import Any

from stoker.pipeline.messages import ValReport
from stoker.training.val_totals import per_class_accuracy as class_recall

MATRIX_MAX_CLASSES = 50
TOP_PAIRS = 20


def val_summary(report: ValReport | None, classes: list[str]) -> dict[str, Any]:
    """The summary.json fields of the last validation (nulls without one)."""
    confusion = report.confusion if report is not None else None
    ema = report.ema if report is not None else None
    return {
        "val_top5_accuracy": report.top5 if report is not None else None,
        "val_per_class_accuracy": per_class_accuracy(confusion, classes) if confusion is not None else None,
        "val_confusion": confusion_summary(confusion, classes) if confusion is not None else None,
        "ema_val_accuracy": ema["accuracy"] if ema else None,
        "ema_val_loss": ema["loss"] if ema else None,
        "ema_val_top5_accuracy": ema["top5"] if ema else None,
    }


def val_line(report: ValReport) -> str:
    """The epoch's log line: the model's validation, and the EMA's beside it (with --ema)."""
    line = f"epoch {report.epoch + 1}: val accuracy {100 * report.accuracy:.2f}% loss {report.loss:.4f}"
    if report.ema:
        line += f"; EMA val accuracy {100 * report.ema['accuracy']:.2f}% loss {report.ema['loss']:.4f}"
    return line


def per_class_accuracy(confusion: list[list[int]], classes: list[str]) -> dict[str, float | None]:
    """Each class's share of its validation samples predicted right (None: the class had none), by name."""
    return dict(zip(classes, class_recall(confusion), strict=True))


def confusion_summary(confusion: list[list[int]], classes: list[str]) -> dict[str, Any]:
    """`matrix` ([true][predicted] counts) up to 50 classes; beyond, the 20 most frequent (true, predicted) mistakes."""
    if len(classes) <= MATRIX_MAX_CLASSES:
        return {"classes": list(classes), "matrix": confusion}
    return {"classes": None, "most_confused": most_confused_pairs(confusion, classes)}


def whole_confusion(confusion: list[list[int]], classes: list[str]) -> dict[str, Any]:
    """`stoker eval`'s JSON: the whole matrix whatever the number of classes (a file, not a terminal), and its most
    confused pairs beside it."""
    return {"classes": list(classes), "matrix": confusion, "most_confused": most_confused_pairs(confusion, classes)}


def most_confused_pairs(confusion: list[list[int]], classes: list[str],
                        count: int = TOP_PAIRS) -> list[dict[str, Any]]:
    """The `count` most frequent (true, predicted) mistakes, most first; ties by true class, then predicted."""
    mistakes = [(n, t, p) for t, row in enumerate(confusion) for p, n in enumerate(row) if t != p and n]
    mistakes.sort(key=lambda item: (-item[0], item[1], item[2]))
    return [{"true": classes[t], "predicted": classes[p], "count": n} for n, t, p in mistakes[:count]]

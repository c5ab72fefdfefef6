"""The table `stoker eval` prints: the headline figures, each class's top-1, and the confusion matrix (its most
confused pairs where the matrix is too wide for a terminal; the JSON holds the whole matrix, whatever the number
of classes: `observe.evaluation.whole_confusion`)."""

from __future__ import annotations

from typing import Any

from stoker.common.terminal import printable

MATRIX_COLUMNS = 12  # classes up to which the matrix itself is printed
PAIRS_SHOWN = 10


def eval_table(result: dict[str, Any]) -> str:
    skipped = len(result["skipped_files"])
    lines = [f"model      {printable(result['model'])} ({result['architecture']}, {result['num_classes']} classes, "
             f"{result['image_size']} px)",
             f"data       {printable(result['data'])}: {result['count']} images"
             + (f", {skipped} skipped (listed in the JSON)" if skipped else "")]
    if not result["count"]:
        return "\n".join([*lines, "no usable image: nothing evaluated"])
    lines += [f"loss       {result['loss']:.4f}", f"top-1      {100 * result['top1']:.2f}%",
              f"top-5      {100 * result['top5']:.2f}%"]
    confusion = result["confusion"]
    matrix = confusion.get("matrix")
    counts = [sum(row) for row in matrix] if matrix is not None else None
    width = max(len(printable(name)) for name in result["per_class"])
    lines.append("per class (top-1)" + (", images" if counts else ""))
    for position, (name, accuracy) in enumerate(result["per_class"].items()):
        shown = "-" if accuracy is None else f"{100 * accuracy:.2f}%"
        lines.append(f"  {printable(name):<{width}}  {shown:>7}" + (f"  {counts[position]}" if counts else ""))
    if matrix is not None and len(matrix) <= MATRIX_COLUMNS:
        lines += _matrix_lines(matrix, [printable(c) for c in confusion["classes"]])
    else:
        lines += _pair_lines(confusion["most_confused"])
    return "\n".join(lines)


def _matrix_lines(matrix: list[list[int]], classes: list[str]) -> list[str]:
    """Rows: the true class, numbered; columns: the predicted class, by the same numbers."""
    cell = max(5, *(len(str(v)) + 1 for row in matrix for v in row))
    number = len(str(len(classes) - 1))
    width = max(len(name) for name in classes)
    header = " " * (2 + number + 1 + width) + "".join(f"{i:>{cell}}" for i in range(len(classes)))
    rows = [f"  {i:>{number}} {name:<{width}}" + "".join(f"{v:>{cell}}" for v in row)
            for i, (name, row) in enumerate(zip(classes, matrix))]
    return ["confusion (rows: true class; columns: predicted class, by number)", header, *rows]


def _pair_lines(pairs: list[dict[str, Any]]) -> list[str]:
    if not pairs:
        return ["no mistakes"]
    return ["most confused (true -> predicted: images)",
            *[f"  {printable(p['true'])} -> {printable(p['predicted'])}: {p['count']}" for p in pairs[:PAIRS_SHOWN]]]

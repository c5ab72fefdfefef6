"""The run report: `RUN_DIR/report.png` and `report.txt` from a run's `metrics.jsonl` and `summary.json`.

Four panels: throughput over time; how each consumer spent its time; ready-queue fill and producer count over
time; training loss and validation accuracy per epoch; with a validation two more: the confusion matrix and
per-class accuracy of its last pass. `stoker report RUN_A RUN_B` draws both runs in the same panels (the confusion
matrix: the first run's, named) and prints their numbers side by side.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stoker.common.config import names_where
from stoker.common.terminal import printable

REPORT_PNG = "report.png"
REPORT_TXT = "report.txt"
THROUGHPUT_BIN_S = 1.0


@dataclass(frozen=True)
class RunRecord:
    name: str
    summary: dict[str, Any]
    events: dict[str, list[dict[str, Any]]]
    segment_starts: list[float] = field(default_factory=list)  # where each part after the first begins, seconds
    settings: dict[str, Any] = field(default_factory=dict)  # config.json: every setting of the run

    @classmethod
    def load(cls, run_dir: Path) -> RunRecord:
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        except OSError as error:
            raise ValueError(f"{run_dir}: not a finished stoker run ({error.strerror}: {error.filename})") from None
        events: dict[str, list[dict[str, Any]]] = defaultdict(list)
        starts = on_one_time_axis(records)
        for record in records:
            events[record["event"]].append(record)
        settings = _read_settings(run_dir, events)
        return cls(run_dir.name, summary, events, starts, settings)


def _read_settings(run_dir: Path, events: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The run's settings: its config.json, else the `start` event's (a run folder copied without it)."""
    try:
        return json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        starts = events.get("start") or [{}]
        return starts[-1].get("config") or {}


def on_one_time_axis(records: list[dict[str, Any]]) -> list[float]:
    """Shift every record of a resumed run's log onto one time axis, in place: each part (its own controller,
    with `t` from 0) follows the one before, and each record gets the `segment` it belongs to. A part ends with its
    `summary` record (or, for one killed before writing it, where `t` goes back). Returns where each part after
    the first begins."""
    starts: list[float] = []
    offset, last_t, segment, ended = 0.0, 0.0, 0, False
    for record in records:
        if ended or record["t"] < last_t:
            offset += last_t
            segment += 1
            starts.append(offset)
            last_t = 0.0
        ended = record["event"] == "summary"
        last_t = record["t"]
        record["t"] = record["t"] + offset
        record["segment"] = segment
    return starts


def write_report(run_dir: Path) -> str:
    """Draw report.png and write report.txt for one run; returns the text."""
    run = RunRecord.load(run_dir)
    draw([run], run_dir / REPORT_PNG)
    text = describe([run])
    (run_dir / REPORT_TXT).write_text(text + "\n")
    return text


def compare(run_dirs: list[Path], out: Path) -> str:
    runs = [RunRecord.load(folder) for folder in run_dirs]
    draw(runs, out)
    return describe(runs)


# ---- the numbers -----------------------------------------------------------------------------------------------

ROWS = (
    ("status", lambda s: s["status"]),
    ("samples/s", lambda s: f"{s['throughput_samples_per_s']:,.0f}" + _span(s)),
    ("consumers", lambda s: str(s["num_consumers"])),
    ("device compute", lambda s: _mean_share(s.get("compute_fraction"))),
    ("input wait", lambda s: _mean_share(s["input_stall_fraction"])),
    ("host (GPU idle for Python)", lambda s: _mean_share(s.get("host_fraction"))),  # GPU runs only (OPTIONAL)
    ("averaging", lambda s: _mean_share(s["averaging_fraction"])),
    ("producers (start/max/end)", lambda s: f"{s['producers_initial']}/{s['producers_max']}/{s['producers_final']}"),
    ("val accuracy", lambda s: f"{s['val_accuracy']:.2%}" if s.get("val_accuracy") is not None else "-"),
    ("EMA val accuracy", lambda s: f"{s['ema_val_accuracy']:.2%}" if s.get("ema_val_accuracy") is not None else "-"),
    ("train loss", lambda s: f"{s['train_loss']:.4f}" if s.get("train_loss") is not None else "-"),
    ("wall time", lambda s: f"{s['wall_s']:.1f} s"),
)


# Rows that say something only for some runs: shown when one of the runs compared is such a run.
OPTIONAL = {
    "host (GPU idle for Python)": lambda s: any(str(d).startswith("cuda") for d in s.get("devices") or ()),
    "EMA val accuracy": lambda s: s.get("ema_val_accuracy") is not None,
}


def rows_for(summaries: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """The table's rows for these runs: every row, less the optional ones that none of them has."""
    return [(label, value) for label, value in ROWS
            if label not in OPTIONAL or any(OPTIONAL[label](summary) for summary in summaries)]


def _span(summary: dict[str, Any]) -> str:
    """What the rate is over: the samples trained in the seconds of training steps (every part of the run), which
    the wall time beside it also counts start-up, validation and checkpoints in."""
    if summary.get("train_s") is None or summary.get("samples_trained") is None:
        return ""  # a summary written before stoker recorded them
    return f" ({summary['samples_trained']:,} in {summary['train_s']:.1f} s of steps)"


def _mean_share(values: list[float] | None) -> str:
    return f"{sum(values) / len(values):.1%}" if values else "-"


def describe(runs: list[RunRecord]) -> str:
    rows = rows_for([run.summary for run in runs])
    width = max(len(label) for label, _ in rows)
    cells = [[value(run.summary) for run in runs] for _, value in rows]
    column = max([24, *(len(cell) for row in cells for cell in row[:-1])])  # the last column needs no padding
    header = (f"{'':<{width}}  " + "  ".join(f"{run.name:<{column}}" for run in runs)).rstrip()
    lines = [header] if len(runs) > 1 else []
    for (label, _), row in zip(rows, cells):
        lines.append((f"{label:<{width}}  " + "  ".join(f"{cell:<{column}}" for cell in row)).rstrip())
    for run in runs:  # long lines: below the table, not in its columns
        prefix = f"{run.name}: " if len(runs) > 1 else ""
        lines.append(f"{prefix}{(run.summary.get('verdict') or {}).get('text', 'no verdict')}")
    if len(runs) > 1:
        lines += differing_settings(runs)
    return "\n".join(lines)


def differing_settings(runs: list[RunRecord]) -> list[str]:
    """The settings that differ between the runs compared, one line each with every run's value."""
    names = sorted({name for run in runs for name in run.settings} - names_where("per_run"))
    differing = [name for name in names if len({json.dumps(run.settings.get(name)) for run in runs}) > 1]
    if not differing:
        return ["settings: the same" if all(run.settings for run in runs) else "settings: not recorded"]
    width = max(len(name) for name in differing)
    return ["settings that differ:", *(f"  {name:<{width}}  " + "  ".join(
        f"{json.dumps(run.settings.get(name)):<24}" for run in runs).rstrip() for name in differing)]


def ending(summary: dict[str, Any], run_dir: Path, width: int | None = None) -> str:
    """What `stoker train` prints last: the report's table and verdict, then where the run's files are; lines
    longer than `width` (a terminal's) wrapped at spaces."""
    lines = [describe([RunRecord(run_dir.name, summary, {})])]
    if summary.get("error"):
        lines.append(f"error: {printable(summary['error'].splitlines()[0])}")
    files = run_files(summary, run_dir)
    name_width = max((len(name) for name, _ in files), default=0)
    lines += [f"files in {run_dir}:", *(f"  {name:<{name_width}}  {what}" for name, what in files)]
    text = "\n".join(lines)
    if width is None:
        return text
    return "\n".join(textwrap.fill(line, width, break_long_words=False, break_on_hyphens=False)
                     for line in text.splitlines())


def run_files(summary: dict[str, Any], run_dir: Path) -> list[tuple[str, str]]:
    """(path relative to the run folder, what it holds) for the files this run left there."""
    files = [("summary.json", "every number of this run: exactly-once accounting, skipped files, timeline"),
             (REPORT_PNG, f"where the time went, in {NUMBER_WORDS[panel_count(summary)]} panels (report.txt: the "
                          "table above)"),
             ("metrics.jsonl", "every step and event"),
             ("model.pt", "the averaged model where the run ended"),
             ("model_ema.pt", "the EMA of the weights where the run ended")]
    found = [(name, what) for name, what in files if (run_dir / name).exists()]
    if summary.get("model_best") and summary.get("best_epoch") is not None:
        found.append(("model_best.pt", f"the best validation accuracy, {100 * summary['best_val_accuracy']:.2f}%, "
                                       f"at epoch {summary['best_epoch']}"))
    if summary.get("checkpoint"):
        checkpoint = Path(summary["checkpoint"])
        resume = "" if summary["status"] == "completed" else f": stoker train --resume {run_dir} continues"
        name = str(checkpoint.relative_to(run_dir)) if checkpoint.is_relative_to(run_dir) else str(checkpoint)
        found.append((name, f"the last checkpoint{resume}"))
    return found


# ---- the panels ------------------------------------------------------------------------------------------------

NUMBER_WORDS = {4: "four", 6: "six"}


def panel_count(summary: dict[str, Any]) -> int:
    """Four panels, and two more (confusion matrix, per-class accuracy) for a run that validated."""
    return 6 if summary.get("val_confusion") else 4


def throughput_series(run: RunRecord) -> tuple[list[float], list[float]]:
    """Samples per second in bins of THROUGHPUT_BIN_S (at their middles), each part of a resumed run on its own
    (parts apart by a NaN, which breaks the line). A step's samples are spread over its own time, from its
    consumer's previous step end to its end, so a step slower than a bin draws its true rate in every bin it spans
    rather than all of its samples in one and nothing in the others; the last bin counts only the time it covers."""
    by_part: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for step in run.events["step"]:
        by_part[(step.get("segment", 0), step["rank"])].append(step)
    parts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
    for (segment, _), steps in sorted(by_part.items()):
        parts[segment].append(_samples_done(steps))
    times: list[float] = []
    rates: list[float] = []
    for segment in sorted(parts):
        if times:
            times.append(times[-1])
            rates.append(math.nan)
        middles, part_rates = _binned_rates(parts[segment])
        times += middles
        rates += part_rates
    return times, rates


def _samples_done(steps: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """One consumer's samples trained by each time, as the corners of a piecewise-linear curve: its first step
    starts its compute before its end, each later one starts where the one before ended; steps reported together
    (one end) count as one."""
    ends: dict[float, int] = defaultdict(int)
    for step in steps:
        ends[step["t"]] += step["samples"]
    first = min(steps, key=lambda step: step["t"])
    start = first["t"] - first.get("compute_s", 0.0) - first.get("averaging_s", 0.0)
    corners = np.array([start, *sorted(ends)], dtype=np.float64)
    done = np.concatenate([[0], np.cumsum([ends[t] for t in sorted(ends)])]).astype(np.float64)
    return corners, done


def _binned_rates(curves: list[tuple[np.ndarray, np.ndarray]]) -> tuple[list[float], list[float]]:
    begin = min(corners[0] for corners, _ in curves)
    end = max(corners[-1] for corners, _ in curves)
    if end <= begin:
        return [], []
    edges = np.append(np.arange(begin, end, THROUGHPUT_BIN_S), end)
    if len(edges) > 2 and edges[-1] - edges[-2] < THROUGHPUT_BIN_S / 2:  # a sliver: part of the bin before it
        edges = np.delete(edges, -2)
    done = sum(np.interp(edges, corners, counts) for corners, counts in curves)
    widths = np.diff(edges)
    keep = widths > 1e-9
    return ((edges[:-1] + widths / 2)[keep].tolist(), (np.diff(done)[keep] / widths[keep]).tolist())


def epoch_losses(run: RunRecord) -> dict[int, float]:
    totals: dict[int, list[float]] = defaultdict(lambda: [0.0, 0])
    for step in run.events["step"]:
        totals[step["epoch"]][0] += step["loss"] * step["samples"]
        totals[step["epoch"]][1] += step["samples"]
    return {epoch: loss / count for epoch, (loss, count) in sorted(totals.items()) if count}


def draw(runs: list[RunRecord], out: Path) -> None:
    import matplotlib.pyplot as plt

    figure = drawn(runs)
    figure.savefig(out, dpi=90)
    plt.close(figure)


def drawn(runs: list[RunRecord]) -> Any:
    """The report's figure (matplotlib's), for `draw` to save."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    confusion = runs[0].summary.get("val_confusion")  # the panel shows the first run's
    columns = panel_count(runs[0].summary) // 2
    figure, grid = plt.subplots(2, columns, figsize=(6 * columns, 8), squeeze=False)
    (speed, split), (pipeline, learning) = grid[0][:2], grid[1][:2]
    if confusion:
        _draw_confusion(grid[0][2], confusion, runs[0].name if len(runs) > 1 else None)
        _draw_per_class(grid[1][2], runs)
    producers, accuracy = pipeline.twinx(), learning.twinx()
    for index, run in enumerate(runs):
        colour = f"C{index}"
        label = run.name if len(runs) > 1 else None
        times, rates = throughput_series(run)
        speed.plot(times, rates, color=colour, label=label)
        for start in run.segment_starts:  # where a resumed part begins
            for axes in (speed, pipeline):
                axes.axvline(start, color=colour, linestyle=":", linewidth=1)
        for loss in run.events.get("consumer_lost", []):  # the others went on without it from here
            for axes in (speed, pipeline):
                axes.axvline(loss["t"], color=colour, linestyle="--", linewidth=1)
        _draw_pipeline(pipeline, producers, run, colour, label)
        _draw_learning(learning, accuracy, run, colour, label)
    producers.set_ylabel("producers")
    accuracy.set_ylabel("val accuracy")
    _draw_split(split, runs)
    resumed = any(run.segment_starts for run in runs)
    lost = any(run.events.get("consumer_lost") for run in runs)
    speed.set(title="throughput" + (" (dotted: resumed)" if resumed else "") + (" (dashed: a consumer died)" if lost
                                                                                  else ""),
              xlabel="seconds of training", ylabel="samples/s")
    pipeline.set(title="ready queue fill (solid) and producers (dashed)", xlabel="seconds of training",
                 ylabel="share of slots filled")
    learning.set(title="train loss (solid) and val accuracy (dashed) per epoch", xlabel="epoch", ylabel="loss")
    for axes in (speed, pipeline, learning):
        axes.grid(alpha=0.3)
        if len(runs) > 1:
            axes.legend(fontsize=8)
    figure.suptitle("\n".join(_headline(run) for run in runs), fontsize=9)
    figure.tight_layout()
    return figure


def _headline(run: RunRecord) -> str:
    """The figure's title for a run: its verdict, after what ended it where it did not complete."""
    verdict = (run.summary.get("verdict") or {}).get("text", "")
    status, error = run.summary.get("status"), run.summary.get("error")
    if status == "failed" and error:
        first = printable(error.splitlines()[0])
        return f"FAILED: {textwrap.shorten(first, 160, placeholder=' ...')}\n{verdict}"
    return f"{status.upper()}: {verdict}" if status == "interrupted" else verdict


def _draw_split(axes, runs: list[RunRecord]) -> None:
    labels, shares = [], defaultdict(list)
    for run in runs:
        summary = run.summary
        died = {loss["consumer"]: loss["died_s"] for loss in summary.get("consumers_lost") or []}
        for rank in range(summary["num_consumers"]):
            prefix = f"{run.name} " if len(runs) > 1 else ""
            death = f" (died at {died[rank]:.0f} s)" if rank in died else ""
            labels.append(f"{prefix}consumer {rank}{death}")
            compute = (summary.get("compute_fraction") or [0.0] * summary["num_consumers"])[rank]
            wait, averaging = summary["input_stall_fraction"][rank], summary["averaging_fraction"][rank]
            host = (summary.get("host_fraction") or [0.0] * summary["num_consumers"])[rank]
            for part, value in (("device compute", compute), ("input wait", wait), ("host", host),
                                ("averaging", averaging), ("other", max(0.0, 1 - compute - wait - host - averaging))):
                shares[part].append(value)
    left = [0.0] * len(labels)
    for part, colour in (("device compute", "C2"), ("input wait", "C3"), ("host", "C4"), ("averaging", "C1"),
                         ("other", "0.7")):
        axes.barh(labels, shares[part], left=left, color=colour, label=part)
        left = [a + b for a, b in zip(left, shares[part])]
    axes.set(title="where each consumer's time went", xlabel="share of wall time", xlim=(0, 1))
    axes.legend(fontsize=8, loc="lower right")


def _draw_pipeline(fill, producers, run: RunRecord, colour: str, label: str | None) -> None:
    samples = run.events["pipeline"]
    fill.plot([s["t"] for s in samples], [s["queue_fill"] for s in samples], color=colour, label=label)
    producers.step([s["t"] for s in samples], [s["producers"] for s in samples], where="post", color=colour,
                   linestyle="--")


def _draw_learning(loss, accuracy, run: RunRecord, colour: str, label: str | None) -> None:
    losses = epoch_losses(run)
    loss.plot([e + 1 for e in losses], list(losses.values()), "o-", color=colour, label=label)
    val = run.events["val"]
    accuracy.plot([v["epoch"] + 1 for v in val], [v["accuracy"] for v in val], "s--", color=colour)


def _draw_confusion(axes, confusion: dict[str, Any], run_name: str | None) -> None:
    """Up to 50 classes the matrix, each row as shares of its true class; beyond, the 20 most confused pairs.
    `run_name`: whose it is, when runs are compared (the panel shows one)."""
    of = f" of {run_name}" if run_name else ""
    if confusion.get("matrix") is not None:
        matrix = [[n / max(1, sum(row)) for n in row] for row in confusion["matrix"]]
        image = axes.imshow(matrix, cmap="Blues", vmin=0, vmax=1)
        classes = confusion["classes"]
        ticks = range(len(classes))
        small = len(classes) <= 20
        axes.set_xticks(list(ticks), classes if small else [], rotation=90, fontsize=7)
        axes.set_yticks(list(ticks), classes if small else [], fontsize=7)
        axes.figure.colorbar(image, ax=axes, fraction=0.046, pad=0.04)
        axes.set(title=f"confusion matrix{of} (last validation, row shares)", xlabel="predicted", ylabel="true")
        return
    pairs = list(reversed(confusion.get("most_confused") or []))
    axes.barh([f"{p['true']} -> {p['predicted']}" for p in pairs], [p["count"] for p in pairs], color="C3")
    axes.tick_params(axis="y", labelsize=7)
    axes.set(title=f"20 most confused pairs{of} (true -> predicted)", xlabel="validation samples")


def _draw_per_class(axes, runs: list[RunRecord]) -> None:
    """Every run's per-class accuracy, side by side per class (the first run's classes), each in its colour."""
    per_class = runs[0].summary.get("val_per_class_accuracy") or {}
    if not per_class or len(per_class) > 50:
        axes.axis("off")
        return
    names = list(per_class)
    height = 0.8 / len(runs)
    for index, run in enumerate(runs):
        theirs = run.summary.get("val_per_class_accuracy") or {}
        axes.barh([i + index * height for i in range(len(names))], [theirs.get(n) or 0.0 for n in names],
                  height=height, color=f"C{index}", label=run.name if len(runs) > 1 else None)
    axes.set_yticks([i + (len(runs) - 1) * height / 2 for i in range(len(names))], names)
    axes.invert_yaxis()
    axes.tick_params(axis="y", labelsize=7)
    axes.set(title="per-class accuracy (last validation)", xlabel="top-1", xlim=(0, 1))
    if len(runs) > 1:
        axes.legend(fontsize=8)

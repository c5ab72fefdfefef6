"""The table and the panels say what the run had: a GPU's host share only on GPU runs, the EMA's accuracy and
model_ema.pt where the run kept an EMA, the panel count the README promises, and in a comparison which run the
confusion and per-class panels show."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from stoker.observe.report import RunRecord, describe, ending

README = Path(__file__).resolve().parents[2] / "README.md"


def _summary(**changes) -> dict:
    """A finished run's summary.json, as much of it as the table reads."""
    return {"status": "completed", "throughput_samples_per_s": 123.0, "num_consumers": 1, "devices": ["cpu:0"],
            "compute_fraction": [0.9], "input_stall_fraction": [0.05], "host_fraction": [0.0],
            "averaging_fraction": [0.0], "producers_initial": 1, "producers_max": 2, "producers_final": 2,
            "val_accuracy": 0.5, "train_loss": 1.25, "wall_s": 12.0,
            "verdict": {"kind": "compute-bound", "text": "compute-bound"}, **changes}


def _record(name: str, **changes) -> RunRecord:
    return RunRecord(name, _summary(**changes), defaultdict(list))


def test_the_host_row_is_shown_for_gpu_runs_only():
    assert "host (GPU idle for Python)" not in describe([_record("cpu")])
    gpu = describe([_record("gpu", devices=["cuda:0"], host_fraction=[0.125])])
    assert re.search(r"host \(GPU idle for Python\) +12\.5%", gpu), gpu
    # Compared with a GPU run, a CPU run's column shows its own 0%.
    assert "host (GPU idle for Python)" in describe([_record("cpu"), _record("gpu", devices=["cuda:0"])])


def test_an_ema_run_shows_the_ema_accuracy_and_its_model_file(tmp_path):
    assert "EMA" not in describe([_record("plain")])
    text = describe([_record("ema", ema_val_accuracy=0.875)])
    assert re.search(r"EMA val accuracy +87\.50%", text), text
    for name in ("summary.json", "model.pt", "model_ema.pt"):
        (tmp_path / name).write_text("x")
    shown = ending(_summary(ema_val_accuracy=0.875, model_ema=str(tmp_path / "model_ema.pt")), tmp_path)
    assert re.search(r"^  model_ema\.pt +the EMA of the weights", shown, re.MULTILINE), shown


def _titled(figure) -> list[str]:
    return [axes.get_title() for axes in figure.axes if axes.get_title()]


def _confusion(accuracy: float) -> dict:
    return {"val_confusion": {"classes": ["a", "b"], "matrix": [[3, 1], [0, 4]]},
            "val_per_class_accuracy": {"a": accuracy, "b": 1.0}}


def test_the_readme_gives_the_panel_count_of_report_png():
    from stoker.observe.report import drawn, panel_count

    with_val, without = _record("run", **_confusion(0.75)), _record("run")
    assert (panel_count(with_val.summary), panel_count(without.summary)) == (6, 4)
    assert len(_titled(drawn([with_val]))) == 6 and len(_titled(drawn([without]))) == 4
    readme = README.read_text()
    assert "in six panels" in readme and "in four panels" not in readme
    assert "six panels (four without a validation)" in " ".join(readme.split())


def test_a_comparison_names_the_run_its_confusion_matrix_shows_and_draws_every_run_per_class():
    from stoker.observe.report import drawn

    figure = drawn([_record("run_a", **_confusion(0.75)), _record("run_b", **_confusion(0.25))])
    confusion = next(axes for axes in figure.axes if axes.get_title().startswith("confusion"))
    assert "run_a" in confusion.get_title()
    per_class = next(axes for axes in figure.axes if axes.get_title().startswith("per-class"))
    assert [text.get_text() for text in per_class.get_legend().get_texts()] == ["run_a", "run_b"]
    widths = sorted(round(bar.get_width(), 2) for bar in per_class.patches)
    assert widths == [0.25, 0.75, 1.0, 1.0]  # class a of each run, class b of each

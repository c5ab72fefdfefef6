"""What a person sees in a terminal: the real CLI in a pseudo-terminal of 140x40, its output read through a
terminal emulator (pyte), scrollback included. One live panel for the whole run, log lines and the consumers'
warnings above it, the live verdict the summary's, and an ending without JSON."""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests.conftest import HELPERS, read_summary
from tests.helpers.terminal import CTRL_C, Terminal, run_in_terminal

pytestmark = pytest.mark.timeout(240)
WARNING = "noisy: a warning written by a consumer"  # tests/helpers/noisy.py writes it


def stoker_in_terminal(textures, out, *extra: str, env: dict | None = None, on_output=None) -> Terminal:
    train_dir, val_dir = textures
    environment = {**os.environ, "PYTHONPATH": f"{HELPERS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   **(env or {})}
    return run_in_terminal([sys.executable, "-m", "stoker", "train", "--data", str(train_dir), "--val", str(val_dir),
                            "--batch-size", "8", "--image-size", "32", "--out", str(out), *extra], env=environment,
                           on_output=on_output)


@pytest.fixture(scope="module")
def three_epochs(textures, tmp_path_factory):
    """Three epochs with validation, slow input (one producer, 25 ms per file read), and a consumer that writes a
    warning straight to its stderr twice during training."""
    out = tmp_path_factory.mktemp("terminal")
    terminal = stoker_in_terminal(textures, out, "--epochs", "3", "--devices", "cpu:1", "--producers", "1",
                                  "--model", "noisy:noisy_cnn", "--report", "true",
                                  env={"STOKER_READ_LATENCY_MS": "25"})
    return out, terminal


def panel_rows(lines: list[str]) -> dict[str, list[int]]:
    """Where each kind of the panel's rows is, by line number."""
    return {"epoch bar": [i for i, line in enumerate(lines) if re.match(r"\s*epoch \d+/\d+\s+━", line)],
            "run bar": [i for i, line in enumerate(lines) if re.match(r"\s*run\s+━", line)],
            "consumers": [i for i, line in enumerate(lines) if line.split()[:3] == ["consumer", "device", "compute"]],
            "numbers": [i for i, line in enumerate(lines) if "samples/s" in line and "ready queue" in line]}


def live_verdict(lines: list[str]) -> str:
    """The panel's last row, the verdict (rich wraps it at the terminal's width: rejoined at the spaces)."""
    [numbers] = panel_rows(lines)["numbers"]
    end = next(i for i in range(numbers + 1, len(lines)) if lines[i].split()[:1] == ["status"])
    return " ".join(line.strip() for line in lines[numbers + 1:end] if line.strip())


def test_one_panel_for_the_whole_run_with_log_lines_and_warnings_above_it(three_epochs):
    _, terminal = three_epochs
    assert terminal.returncode == 0, terminal.text
    lines = terminal.lines
    rows = panel_rows(lines)
    assert all(len(found) == 1 for found in rows.values()), f"{rows}\n{terminal.text}"
    top = rows["epoch bar"][0]
    assert "epoch 3/3" in lines[top] and "45/45" in lines[rows["run bar"][0]]
    above = lines[:top]
    for epoch in (1, 2, 3):
        assert sum(f"epoch {epoch}: val accuracy" in line for line in above) == 1, terminal.text
    assert sum(WARNING in line for line in above) == 2, terminal.text


def test_the_live_verdict_is_the_summarys_and_the_reports(three_epochs):
    out, terminal = three_epochs
    summary = read_summary(out)
    verdict = summary["verdict"]["text"]
    assert live_verdict(terminal.lines) == verdict
    assert (out / "report.txt").read_text().splitlines()[-1] == verdict
    [numbers] = panel_rows(terminal.lines)["numbers"]
    shown = float(terminal.lines[numbers].split(" samples/s")[0].replace(",", ""))
    assert abs(shown - summary["throughput_samples_per_s"]) <= 1  # the last panel: the run's, not the last 5 s


@pytest.fixture(scope="module")
def interrupted(textures, tmp_path_factory):
    """Two consumers averaging 30M parameters after every step (sync-bound), Ctrl-C typed once the run bar shows
    two steps done."""
    out = tmp_path_factory.mktemp("interrupted")
    typed = []

    def interrupt_at_step_two(screen: list[str], type_keys) -> None:
        done = [int(m.group(1)) for line in screen if (m := re.match(r"\s*run\s+\S+\s+(\d+)/\d+", line))]
        if not typed and done and done[0] >= 2:
            type_keys(CTRL_C)
            typed.append(done[0])

    terminal = stoker_in_terminal(textures, out, "--epochs", "20", "--devices", "cpu:2", "--model",
                                  "stoker.bench.scaling:simulated_model", "--report", "true",
                                  env={"STOKER_SIMULATED_PARAMS": "30000000"}, on_output=interrupt_at_step_two)
    assert typed, terminal.text
    return out, terminal


def test_ctrl_c_says_what_it_does_then_the_usual_ending(interrupted):
    out, terminal = interrupted
    assert terminal.returncode == 130, terminal.text
    lines = terminal.lines
    rows = panel_rows(lines)
    assert all(len(found) == 1 for found in rows.values()), f"{rows}\n{terminal.text}"
    said = [i for i, line in enumerate(lines)
            if line.endswith("Ctrl-C: stopping after the steps already prepared, with a checkpoint (Ctrl-C again "
                             "to stop now)")]
    assert len(said) == 1 and said[0] < rows["epoch bar"][0], terminal.text
    summary = read_summary(out)
    assert summary["status"] == "interrupted"
    ending = " ".join(line.strip() for line in lines[rows["numbers"][0]:])
    assert "status interrupted" in " ".join(ending.split())
    assert f"the last checkpoint: stoker train --resume {out} continues" in ending, terminal.text


def test_the_live_verdict_of_a_sync_bound_run_is_the_summarys_and_the_reports(interrupted):
    out, terminal = interrupted
    verdict = read_summary(out)["verdict"]
    assert verdict["kind"] == "sync-bound", verdict
    assert live_verdict(terminal.lines) == verdict["text"]
    assert (out / "report.txt").read_text().splitlines()[-1] == verdict["text"]


def test_the_ending_has_the_table_the_verdict_and_the_files_and_no_json(three_epochs):
    out, terminal = three_epochs
    lines = terminal.lines
    ending = lines[next(i for i, line in enumerate(lines) if line.split()[:1] == ["status"]):]
    assert not any("{" in line or '"status"' in line for line in ending), terminal.text
    assert ending[0].split() == ["status", "completed"]
    verdict = read_summary(out)["verdict"]["text"]  # wrapped at spaces to the terminal's width
    assert verdict in " ".join(line.strip() for line in ending), terminal.text
    assert f"files in {out}:" in ending and any(line.split()[:1] == ["summary.json"] for line in ending)

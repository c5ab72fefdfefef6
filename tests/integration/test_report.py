"""Where the time goes: the verdict on three constructed runs, the report drawn from a real run's files, the
TensorBoard sink, and plain log lines without control characters when output is not a terminal. The log lines,
summary.json and report.txt of the input-bound and the sync-bound run must tell the same verdict with the same
numbers, and no share may pass 100%."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from tests.conftest import read_summary, run_cli

pytestmark = pytest.mark.timeout(240)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def train(textures, out, *extra, env=None):
    train_dir, val_dir = textures
    return run_cli("train", "--data", str(train_dir), "--val", str(val_dir), "--batch-size", "8", "--epochs", "1",
                   "--image-size", "32", "--out", str(out), *extra, env=env)


@pytest.fixture(scope="module")
def slow_input_run(textures, tmp_path_factory):
    """Every file read waits 25 ms and one producer does all the reading: input-bound by construction, whatever
    the machine's load. One consumer, so no averaging competes with the wait (two consumers averaging on two
    loaded cores read "sync-bound"). Two slots per consumer: the batches built while the consumer starts (seconds
    on a loaded machine) cover two of the 15 steps, not four. Not quiet, TensorBoard on."""
    out = tmp_path_factory.mktemp("slow_input")
    result = train(textures, out, "--devices", "cpu:1", "--producers", "1", "--slots-per-consumer", "2",
                   "--log-every-s", "0.5",
                   "--tensorboard", "true", "--report", "true", env={"STOKER_READ_LATENCY_MS": "25"})
    return out, result


def test_slow_input_source_is_called_input_bound(slow_input_run):
    verdict = read_summary(slow_input_run[0])["verdict"]
    assert verdict["kind"] == "input-bound" and "consumers wait" in verdict["text"]


def test_slow_device_step_is_called_compute_bound(textures, tmp_path):
    # One consumer: no averaging to compete with the 80 ms step on a loaded machine.
    result = train(textures, tmp_path, "--quiet", "--devices", "cpu:1", "--producers", "2",
                   env={"STOKER_STEP_TIME_MS": "80"})
    verdict = read_summary(tmp_path)["verdict"]
    assert verdict["kind"] == "compute-bound", verdict
    # --quiet: no progress lines, and no per-epoch validation lines either (they were printed anyway)
    assert "val accuracy" not in result.stderr and "samples/s" not in result.stderr, result.stderr


@pytest.fixture(scope="module")
def sync_bound_run(textures, tmp_path_factory):
    """Two consumers averaging 30M parameters after every step: sync-bound. Not quiet, --json."""
    out = tmp_path_factory.mktemp("sync_bound")
    result = train(textures, out, "--devices", "cpu:2", "--model", "stoker.bench.scaling:simulated_model",
                   "--log-every-s", "0.5", "--report", "true", "--json", env={"STOKER_SIMULATED_PARAMS": "30000000"})
    return out, result


def test_large_averaging_cost_is_called_sync_bound_with_a_suggestion(sync_bound_run):
    verdict = read_summary(sync_bound_run[0])["verdict"]
    assert verdict["kind"] == "sync-bound", verdict
    assert "try --sync-every" in verdict["text"] and "or --overlap-averaging true" in verdict["text"]


def test_sync_bound_run_tells_one_verdict_everywhere(sync_bound_run):
    assert_one_verdict(sync_bound_run[0], sync_bound_run[1].stderr)


def test_input_bound_run_tells_one_verdict_everywhere(slow_input_run):
    assert_one_verdict(slow_input_run[0], slow_input_run[1].stderr)


def test_the_ending_is_the_table_the_verdict_and_where_the_files_are_without_json(slow_input_run):
    run_dir, result = slow_input_run
    summary = read_summary(run_dir)
    lines = result.stdout.splitlines()
    assert "{" not in result.stdout and '"status"' not in result.stdout
    assert len(lines) < 25 and summary["verdict"]["text"] in lines
    assert f"files in {run_dir}:" in lines
    for name in ("summary.json", "report.png", "metrics.jsonl", "model.pt"):
        assert any(line.split()[:1] == [name] for line in lines), name
        assert (run_dir / name).exists()
    checkpoint = Path(summary["checkpoint"]).relative_to(run_dir)
    assert any(line.split()[:1] == [str(checkpoint)] for line in lines)


def test_json_asked_for_is_the_summary_on_stdout_and_the_ending_on_stderr(sync_bound_run):
    run_dir, result = sync_bound_run
    assert json.loads(result.stdout) == read_summary(run_dir)
    assert f"files in {run_dir}:" in result.stderr.splitlines()


def progress_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "samples/s" in line and "producers" in line]


def assert_one_verdict(run_dir, stderr: str) -> None:
    """The last progress line, summary.json and report.txt: the same verdict text (numbers included), and the
    shares of the consumers' time in every progress line and in the summary at most 100%."""
    summary = read_summary(run_dir)
    lines = progress_lines(stderr)
    assert lines[-1].rsplit(" | ", 1)[1] == summary["verdict"]["text"]
    assert (run_dir / "report.txt").read_text().splitlines()[-1] == summary["verdict"]["text"]
    for line in lines:
        shares = re.search(r"compute (\d+)% input wait (\d+)% averaging (\d+)%", line).groups()
        assert all(int(share) <= 100 for share in shares) and sum(map(int, shares)) <= 101, line  # 3 roundings
    for rank in range(summary["num_consumers"]):
        parts = [summary[key][rank] for key in ("compute_fraction", "input_stall_fraction", "averaging_fraction")]
        assert all(0 <= part <= 1 for part in parts) and sum(parts) <= 1 + 1e-3, parts


def test_output_without_a_terminal_is_plain_lines_with_the_verdict(slow_input_run):
    stderr = slow_input_run[1].stderr
    assert "\x1b" not in stderr and "\r" not in stderr
    progress = progress_lines(stderr)
    assert progress and any("input-bound" in line for line in progress)


def test_report_is_drawn_at_the_end_and_redrawn_and_compared_on_demand(slow_input_run, textures, tmp_path):
    run_dir = slow_input_run[0]
    png = run_dir / "report.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    width, height = struct.unpack(">II", png.read_bytes()[16:24])
    assert (width, height) == (1620, 720)  # three columns: the run validated, so the confusion panel is drawn
    assert "input-bound" in (run_dir / "report.txt").read_text()
    png.unlink()
    redraw = run_cli("report", str(run_dir))
    assert png.read_bytes()[:8] == PNG_MAGIC and "samples/s" in redraw.stdout
    other = tmp_path / "other"
    train(textures, other, "--quiet", "--report", "false")
    assert not (other / "report.png").exists()
    comparison = run_cli("report", str(run_dir), str(other), "--out", str(tmp_path / "both.png"))
    assert (tmp_path / "both.png").read_bytes()[:8] == PNG_MAGIC
    header = comparison.stdout.splitlines()[0]
    assert run_dir.name in header and "other" in header


def test_tensorboard_event_files_hold_the_documented_tags(slow_input_run):
    from tensorboardX.proto import event_pb2

    [events] = list((slow_input_run[0] / "tensorboard").glob("events.out.tfevents.*"))
    tags = set()
    data = events.read_bytes()
    while data:  # TFRecord: length (8 bytes), its CRC (4), the record, its CRC (4)
        (length,) = struct.unpack("<Q", data[:8])
        event = event_pb2.Event.FromString(data[12:12 + length])
        tags.update(value.tag for value in event.summary.value)
        data = data[16 + length:]
    assert {"train/loss", "val/accuracy", "pipeline/samples_per_s", "pipeline/input_wait",
            "consumer0/wait_s"} <= tags

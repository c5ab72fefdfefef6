"""Where the time goes: the verdict on three constructed runs, the report drawn from a real run's files, the
TensorBoard sink, and plain log lines without control characters when output is not a terminal. The log lines,
summary.json and report.txt of the input-bound and the sync-bound run must tell the same verdict with the same
numbers, and no share may pass 100%."""

from __future__ import annotations

import re
import struct

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
    """Every file read waits 25 ms and one producer does all the reading: input-bound. Not quiet, TensorBoard on."""
    out = tmp_path_factory.mktemp("slow_input")
    result = train(textures, out, "--producers", "1", "--log-every-s", "0.5", "--tensorboard", "true",
                   "--report", "true", env={"STOKER_READ_LATENCY_MS": "25"})
    return out, result


def test_slow_input_source_is_called_input_bound(slow_input_run):
    verdict = read_summary(slow_input_run[0])["verdict"]
    assert verdict["kind"] == "input-bound" and "consumers wait" in verdict["text"]


def test_slow_device_step_is_called_compute_bound(textures, tmp_path):
    train(textures, tmp_path, "--quiet", "--producers", "2", env={"STOKER_STEP_TIME_MS": "80"})
    verdict = read_summary(tmp_path)["verdict"]
    assert verdict["kind"] == "compute-bound", verdict


def test_large_averaging_cost_is_called_sync_bound_with_a_suggestion(textures, tmp_path):
    result = train(textures, tmp_path, "--devices", "cpu:2", "--model", "stoker.bench.scaling:simulated_model",
                   "--log-every-s", "0.5", "--report", "true", env={"STOKER_SIMULATED_PARAMS": "30000000"})
    verdict = read_summary(tmp_path)["verdict"]
    assert verdict["kind"] == "sync-bound", verdict
    assert "try --sync-every" in verdict["text"] and "or --overlap-averaging true" in verdict["text"]
    assert_one_verdict(tmp_path, result.stderr)


def test_input_bound_run_tells_one_verdict_everywhere(slow_input_run):
    assert_one_verdict(slow_input_run[0], slow_input_run[1].stderr)


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
    assert (width, height) == (1080, 720)
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

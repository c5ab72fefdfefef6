"""summary.json describes the whole run, not the last process: a resumed run adds its part to the parts before it.

Each checkpoint carries the exactly-once accounting up to its step (`accounting.npz`): rows for the epochs done
before it, and the acknowledged-id counts of the epoch it splits. The accounting is taken at the checkpoint's
exact step, not when the checkpoint is committed (consumers may have trained further by then), because a resume
continues from that step: whatever was trained after it is trained again and must not count twice. A resumed
run starts from that accounting, so an epoch split by an interrupt still counts every sample once. The time each
process ran and its throughput are listed per part in `segments`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stoker.common.checkpoint import CheckpointError, Position
from stoker.observe.metrics import EpochAccount, RunStats, accounting_rows, host_share, time_shares
from stoker.pipeline.messages import StepReport

log = logging.getLogger(__name__)

ACCOUNTING_FILE = "accounting.npz"


@dataclass
class Ledger:
    """What the parts before this one did (`rows`: accounting of the epochs they finished, `segments`), and the
    steps this part trained since its last checkpoint, to take the accounting at the next checkpoint's step."""

    rows: list[dict[str, int]] = field(default_factory=list)
    train_loss: dict[int, float] = field(default_factory=dict)  # epoch -> mean loss, for the epochs in `rows`
    skipped: dict[str, str] = field(default_factory=dict)
    segments: list[dict[str, Any]] = field(default_factory=list)
    _recent: deque = field(default_factory=deque)  # (global step, epoch, sample ids, loss x count)

    def record_step(self, report: StepReport) -> None:
        self._recent.append((report.global_step, report.epoch, report.sample_ids, report.loss * report.count))

    def take_back(self, agreed_step: int) -> None:
        """Steps after `agreed_step` are trained again by a new group of consumers: they no longer count."""
        self._recent = deque(entry for entry in self._recent if entry[0] <= agreed_step)

    def checkpointed(self, global_step: int) -> None:
        """Steps before a checkpoint are never taken out again: at most the steps between two checkpoints (an
        epoch at most) are kept."""
        while self._recent and self._recent[0][0] < global_step:
            self._recent.popleft()

    def snapshot(self, stats: RunStats, position: Position) -> bytes:
        """The accounting at `position`, as the bytes of the checkpoint's accounting file."""
        self.checkpointed(position.global_step)
        epochs = {e: EpochAccount(a.counts.copy(), a.expected, a.skipped_ids, a.loss_sum)
                  for e, a in stats.epochs.items()}
        for _, epoch, ids, loss in self._recent:  # trained after the checkpoint's step: a resume trains it again
            np.subtract.at(epochs[epoch].counts, ids, 1)
            epochs[epoch].loss_sum -= loss
        split_epoch, split_step = position.epoch, position.step
        done = {e: a for e, a in epochs.items() if e < split_epoch}
        rows = self.rows + [row for row in accounting_rows(done) if row["epoch"] not in {r["epoch"] for r in self.rows}]
        losses = {**self.train_loss, **{e: a.loss_sum / max(1, a.consumed()) for e, a in done.items()}}
        split = epochs.get(split_epoch) if split_step else None
        header = {"rows": rows, "train_loss": {str(e): v for e, v in losses.items()},
                  "skipped": {**self.skipped, **stats.skipped}, "split_epoch": split_epoch if split else None,
                  "loss_sum": split.loss_sum if split else 0.0}
        buffer = io.BytesIO()
        np.savez_compressed(buffer, header=np.array(json.dumps(header)),
                            counts=split.counts if split else np.zeros(0, np.int32),
                            expected=split.expected if split else np.zeros(0, bool),
                            skipped_ids=np.array(sorted(split.skipped_ids) if split else [], np.int64))
        return buffer.getvalue()

    def resume(self, accounting: bytes | None, run_dir: Path, stats: RunStats) -> None:
        """Start from a checkpoint's accounting (the split epoch's counts go into `stats`) and the segments of the
        parts before. `accounting`: the bytes of the checkpoint's accounting file, read by the machine whose disk
        holds it (`read_accounting`), never from a path another machine sent. None (a checkpoint written before
        accounting was kept, or one of several machines): this part then counts alone."""
        self.segments = previous_segments(run_dir)
        if accounting is None:
            return
        with np.load(io.BytesIO(accounting)) as saved:
            header = json.loads(str(saved["header"]))
            self.rows = header["rows"]
            self.train_loss = {int(e): v for e, v in header["train_loss"].items()}
            self.skipped = header["skipped"]
            if header["split_epoch"] is not None:
                stats.epochs[header["split_epoch"]] = EpochAccount(
                    saved["counts"].copy(), saved["expected"].copy(), set(saved["skipped_ids"].tolist()),
                    header["loss_sum"])

    def so_far(self, stats: RunStats) -> dict[str, Any]:
        """`whole_figures` over every part so far, this one as `stats` has it now: the throughput and the time
        shares that the live view's last line and the verdict give (the producer counts are the summary's)."""
        return whole_figures([*self.segments, {**part_times(stats), "producers_initial": 0}])

    def whole_run(self, part: dict[str, Any], stats: RunStats, start_step: int, start_epoch: int) -> dict[str, Any]:
        """The summary of this part, with the fields that describe the run made to cover every part; this part
        starts after `start_step` steps and `start_epoch` whole epochs."""
        mine = [row for row in stats.epoch_accounting() if row["epoch"] not in {r["epoch"] for r in self.rows}]
        rows = sorted(self.rows + mine, key=lambda row: row["epoch"])
        segment = {"start_step": start_step, "end_step": start_step + part["steps"], "status": part["status"],
                   "wall_s": part["wall_s"], "throughput_samples_per_s": part["throughput_samples_per_s"],
                   **part_times(stats), "producers_initial": part["producers_initial"],
                   "producers_max": part["producers_max"]}
        skipped = {**self.skipped, **stats.skipped}
        return {**part,
                **whole_figures([*self.segments, segment]),
                "epochs": start_epoch + part["epochs"],  # the parts before finished those
                "steps": start_step + part["steps"],
                "samples_consumed": [row["consumed"] for row in rows],
                "duplicate_samples": sum(row["duplicates"] for row in rows),
                # Summed over epochs: a file unusable in every epoch counts once in each (3 files, 8 epochs: 24);
                # epoch_accounting has each epoch's (docs/contracts.md says so beside the field).
                "missing_samples": sum(row["missing"] for row in rows),
                "missing_samples_skipped_as_unusable": sum(row["missing_unusable"] for row in rows),
                "epoch_accounting": rows,
                "skipped_files": [{"path": p, "reason": r} for p, r in skipped.items()],
                "train_loss": part["train_loss"] if part["train_loss"] is not None
                              else self.train_loss.get(max(self.train_loss, default=-1)),
                "segments": [*self.segments, segment],
                "wall_s": round(sum(s["wall_s"] for s in self.segments) + part["wall_s"], 3)}


def part_times(stats: RunStats) -> dict[str, Any]:
    """What a part's whole-run figures are summed from: the samples it trained, its time in training steps (the
    throughput's span: the first step's start to the last one's end, the slowest consumer's), and each consumer's
    seconds as (compute, input wait, averaging, host, wall)."""
    return {"samples_trained": sum(c.samples for c in stats.consumers), "train_s": stats.training_s(),
            "consumer_s": [[c.compute_s, c.wait_s, c.averaging_s, c.host_s, c.wall_s()] for c in stats.consumers]}


def whole_figures(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The throughput, the time shares and the producer counts over every part that recorded its times (parts
    written by a stoker before they did are left out): samples over time in training steps, each share of the
    consumers' summed seconds, as `time_shares` defines it for one part."""
    timed = [part for part in parts if _has_times(part, len(parts[-1]["consumer_s"]))]
    samples, train_s = sum(p["samples_trained"] for p in timed), sum(p["train_s"] for p in timed)
    ranks = [[sum(p["consumer_s"][rank][i] for p in timed) for i in range(5)]
             for rank in range(len(parts[-1]["consumer_s"]))]
    shares = [time_shares(compute, wait, averaging, wall, host) for compute, wait, averaging, host, wall in ranks]
    hosts = [host_share(compute, wait, averaging, wall, host) for compute, wait, averaging, host, wall in ranks]
    return {"throughput_samples_per_s": round(samples / train_s, 2) if train_s > 0 else 0.0,
            "samples_trained": samples, "train_s": round(train_s, 3),
            "compute_fraction": [round(share[0], 4) for share in shares],
            "input_stall_fraction": [round(share[1], 4) for share in shares],
            "averaging_fraction": [round(share[2], 4) for share in shares],
            "host_fraction": [round(host, 4) for host in hosts],
            "producers_initial": next(p["producers_initial"] for p in parts if "producers_initial" in p),
            "producers_max": max(p.get("producers_max", 0) for p in parts)}


def _has_times(part: dict[str, Any], consumers: int) -> bool:
    times = part.get("consumer_s")
    return (isinstance(part.get("samples_trained"), int) and isinstance(part.get("train_s"), (int, float))
            and isinstance(times, list) and len(times) == consumers
            and all(isinstance(row, list) and len(row) == 5 and all(isinstance(x, (int, float)) for x in row)
                    for row in times))


def read_accounting(checkpoint: Path, meta: dict[str, Any]) -> bytes | None:
    """The accounting file of a verified checkpoint, if its meta.json lists it, checked against that checksum
    again (it is read after the checkpoint was chosen); None when it has none."""
    expected = meta["files"].get(ACCOUNTING_FILE)
    if expected is None:
        log.warning("%s has no %s: the summary accounts for the resumed part only", checkpoint, ACCOUNTING_FILE)
        return None
    payload = (checkpoint / ACCOUNTING_FILE).read_bytes()
    if hashlib.sha256(payload).hexdigest() != expected:
        raise CheckpointError(f"{checkpoint / ACCOUNTING_FILE}: checksum mismatch (modified while resuming)")
    return payload


def exactly_once_breach(summary: dict[str, Any]) -> str | None:
    """What a finished run must say when a sample was trained on twice, or never without being unusable."""
    twice = summary["duplicate_samples"]
    never = summary["missing_samples"] - summary["missing_samples_skipped_as_unusable"]
    if summary["status"] != "completed" or not (twice or never):
        return None
    epochs = [row["epoch"] for row in summary["epoch_accounting"]
              if row["duplicates"] or row["missing"] > row["missing_unusable"]]
    return (f"exactly-once delivery broken: {twice} sample(s) trained on more than once and {never} never (not "
            f"counting unusable files), in epoch(s) {', '.join(str(e + 1) for e in epochs)}; see epoch_accounting "
            "in summary.json")


SEGMENT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "start_step": int, "end_step": int, "status": str, "wall_s": (int, float), "throughput_samples_per_s": (int, float)}


def previous_segments(run_dir: Path) -> list[dict[str, Any]]:
    """The parts before this one, as the last summary lists them; a summary that is not stoker's (edited,
    damaged) is left out with a warning, not trusted until a crash at the end of the run."""
    file = run_dir / "summary.json"
    try:
        previous = json.loads(file.read_text())
    except (OSError, ValueError):
        return []  # the part before was killed before it could write one
    segments = previous.get("segments") if isinstance(previous, dict) else None
    if segments is None and isinstance(previous, dict):
        return []
    if not (isinstance(segments, list) and all(_is_segment(segment) for segment in segments)):
        log.warning("%s is not a summary stoker wrote (its segments are not a list of parts): the timeline "
                    "starts again with this part", file)
        return []
    return segments


def _is_segment(segment: Any) -> bool:
    return (isinstance(segment, dict)
            and all(isinstance(segment.get(key), kind) and not isinstance(segment.get(key), bool)
                    for key, kind in SEGMENT_FIELDS.items()))

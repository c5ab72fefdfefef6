"""What the run measured: per-consumer time split, exactly-once accounting, losses, and `metrics.jsonl`."""

from __future__ import annotations

import json
import time
from collections import defaultdict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import numpy as np

from stoker.data.formats.folders import Skipped
from stoker.pipeline.autoscaler import host_share, time_shares

if TYPE_CHECKING:  # the consumer module imports torch; `stoker report` and `--help` need not
    from stoker.pipeline.messages import StepReport


RATE_WINDOW_S = 5.0


def step_fields(report: StepReport, first_rank: int) -> dict[str, Any]:
    """A `step` event's fields (docs/metrics.md), with the rank numbered across machines."""
    return {"rank": first_rank + report.rank, "epoch": report.epoch, "step": report.step,
            "global_step": report.global_step,
            "samples": report.count, "loss": round(report.loss, 6), "wait_s": round(report.wait_s, 6),
            "compute_s": round(report.compute_s, 6), "averaging_s": round(report.averaging_s, 6),
            "host_s": round(report.host_s, 6), **report.memory}


class MetricsLog:
    """One JSON object per line: every step report and every event, with the time since the run started
    (schema: docs/metrics.md); with `tensorboard_dir`, the same numbers as TensorBoard scalars too. A resumed run
    appends to the log of the run it continues."""

    def __init__(self, path: Path, tensorboard_dir: Path | None = None, append: bool = False) -> None:
        self._started = time.monotonic()
        self._handle: IO[str] | None = open(path, "a" if append else "w", buffering=1)
        self._tensorboard = TensorBoardSink(tensorboard_dir) if tensorboard_dir is not None else None

    def write(self, event: str, **fields: Any) -> None:
        if self._handle is not None:
            record = {"event": event, "t": round(time.monotonic() - self._started, 4), **fields}
            self._handle.write(json.dumps(record, default=_plain) + "\n")
            if self._tensorboard is not None:
                self._tensorboard.write(record)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.close()
        sink, self._tensorboard = self._tensorboard, None
        if sink is not None:
            sink.close()


class TensorBoardSink:
    """Step, validation and pipeline events as TensorBoard scalars, indexed by the global step."""

    PIPELINE = ("samples_per_s", "queue_fill", "producers", "producer_utilization", "compute", "input_wait",
                "averaging")

    def __init__(self, folder: Path) -> None:
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(str(folder))
        self._global_step = 0

    def write(self, record: dict[str, Any]) -> None:
        event, add = record["event"], self._writer.add_scalar
        if event == "step":
            self._global_step = max(self._global_step, record["global_step"])
            if record["rank"] == 0:
                add("train/loss", record["loss"], record["global_step"])
            for part in ("compute_s", "wait_s", "averaging_s"):
                add(f"consumer{record['rank']}/{part}", record[part], record["global_step"])
        elif event == "val":
            add("val/accuracy", record["accuracy"], self._global_step)
            add("val/loss", record["loss"], self._global_step)
        elif event == "pipeline":
            for key in self.PIPELINE:
                add(f"pipeline/{key}", record[key], self._global_step)

    def close(self) -> None:
        self._writer.close()


def read_events(path: Path) -> dict[str, list[dict[str, Any]]]:
    """A `metrics.jsonl` read back: its records grouped by event, each list in the order written."""
    events: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in path.read_text().splitlines():
        record = json.loads(line)
        events[record["event"]].append(record)
    return events


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return str(value)


@dataclass
class ConsumerTimes:
    wait_s: float = 0.0
    compute_s: float = 0.0
    averaging_s: float = 0.0
    steps: int = 0
    samples: int = 0
    first_step_at: float | None = None
    host_s: float = 0.0
    last_step_at: float | None = None

    def wall_s(self) -> float:
        if self.first_step_at is None or self.last_step_at is None:
            return 0.0
        return self.last_step_at - self.first_step_at


@dataclass
class EpochAccount:
    """Acknowledged sample ids of one epoch: exactly once means every count is 1, except skipped files."""

    counts: np.ndarray
    expected: np.ndarray  # bool: scheduled in this run (all of it, unless the run resumed or stopped mid-epoch)
    skipped_ids: set[int] = field(default_factory=set)
    loss_sum: float = 0.0

    def consumed(self) -> int:
        return int(self.counts.sum())

    def duplicates(self) -> int:
        return int(np.maximum(self.counts - 1, 0).sum())

    def missing_ids(self) -> np.ndarray:
        return np.flatnonzero(self.expected & (self.counts == 0))


def accounting_rows(epochs: dict[int, EpochAccount]) -> list[dict[str, int]]:
    """Exactly-once per epoch: what was consumed, twice, or never (and of that, how much was unusable)."""
    rows = []
    for epoch, account in sorted(epochs.items()):
        never = account.missing_ids()
        rows.append({"epoch": epoch, "consumed": account.consumed(), "duplicates": account.duplicates(),
                     "missing": len(never), "missing_unusable": len(set(never.tolist()) & account.skipped_ids)})
    return rows


def _keep_whole_steps(steps: deque[tuple[float, int]], now: float, count: int) -> None:
    """Append one step's end; drop ends before the newest one that lies RATE_WINDOW_S back (the rate's anchor)."""
    steps.append((now, count))
    while len(steps) > 2 and now - steps[1][0] >= RATE_WINDOW_S:
        steps.popleft()


def _rank_rate(steps: deque[tuple[float, int]], now: float) -> float:
    """The samples of the steps after the anchor over the time since it ended: whole steps only, so a step
    slower than the window is not read as two reports a message apart. Steps reported together (a GPU consumer
    sends them in groups) share an end and count as one span."""
    if not steps:
        return 0.0
    anchor, last = steps[0][0], steps[-1][0]
    span = last - anchor
    if span <= 0 or now - last > max(RATE_WINDOW_S, 2 * span):
        return 0.0
    return sum(n for t, n in steps if t > anchor) / span


class RunStats:
    """Consumers report with their rank on this machine; steps and hashes are kept by global rank
    (`first_rank + rank`) so that machines' stats can be merged at the end."""

    def __init__(self, num_consumers: int, samples_per_epoch: int, steps_per_epoch: int,
                 first_rank: int = 0) -> None:
        self.first_rank = first_rank
        self.samples_per_epoch = samples_per_epoch
        self.steps_per_epoch = steps_per_epoch
        self._finished_last_step: dict[int, set[int]] = defaultdict(set)  # epoch -> ranks done with its last step
        self.consumers = [ConsumerTimes() for _ in range(num_consumers)]
        self.members = num_consumers  # consumers training now: fewer after one died and the others went on
        self.epochs: dict[int, EpochAccount] = {}
        self.skipped: dict[str, str] = {}
        self.digests: dict[int, dict[int, str]] = defaultdict(dict)  # global step -> rank -> digest
        self.recent: dict[int, deque[tuple[float, int]]] = defaultdict(deque)  # rank -> (time, samples), the rate

    def record_step(self, report: StepReport, now: float) -> None:
        times = self.consumers[report.rank]
        if times.first_step_at is None:
            times.first_step_at = now - report.compute_s - report.averaging_s
        else:
            times.wait_s += report.wait_s
            times.host_s += report.host_s
        times.last_step_at = now
        times.compute_s += report.compute_s
        times.averaging_s += report.averaging_s
        times.steps += 1
        times.samples += report.count
        account = self._account(report.epoch)
        np.add.at(account.counts, report.sample_ids, 1)
        account.loss_sum += report.loss * report.count
        if report.step == (report.epoch_steps or self.steps_per_epoch) - 1:
            self._finished_last_step[report.epoch].add(self.first_rank + report.rank)
        _keep_whole_steps(self.recent[report.rank], now, report.count)

    @property
    def steps_done(self) -> int:
        """Steps this part of the run trained (consumers that died trained fewer)."""
        return max(times.steps for times in self.consumers)

    def retract(self, report: StepReport) -> None:
        """Take back a step that a group which broke trained and the survivors train again (their state went
        back to before it): its samples, time and loss no longer count."""
        times = self.consumers[report.rank]
        times.compute_s -= report.compute_s
        times.averaging_s -= report.averaging_s
        times.wait_s -= report.wait_s
        times.host_s -= report.host_s
        times.steps -= 1
        times.samples -= report.count
        account = self._account(report.epoch)
        np.subtract.at(account.counts, report.sample_ids, 1)
        account.loss_sum -= report.loss * report.count
        self._finished_last_step[report.epoch].discard(self.first_rank + report.rank)

    def record_digest(self, report: StepReport) -> bool | None:
        """Keep a replica's hash; once every replica reported for that step, whether they are all equal."""
        assert report.digest is not None, "called for reports that carry a digest"
        check = self.digests[report.global_step]
        check[self.first_rank + report.rank] = report.digest
        return len(set(check.values())) == 1 if len(check) >= self.members else None

    def export(self) -> dict[str, Any]:
        """What another machine's stats need from this one to merge it, as tensors and JSON (`stoker.training.wire`)."""
        import torch  # only the controllers of several machines call this; `stoker report` and `--help` need not

        return {"consumers": [asdict(times) for times in self.consumers],
                "epochs": {epoch: {"counts": torch.from_numpy(account.counts),
                                   "expected": torch.from_numpy(account.expected),
                                   "skipped_ids": sorted(map(int, account.skipped_ids)), "loss_sum": account.loss_sum}
                           for epoch, account in self.epochs.items()},
                "skipped": self.skipped, "digests": dict(self.digests),
                "finished_last_step": {epoch: sorted(ranks) for epoch, ranks in self._finished_last_step.items()}}

    def merge(self, other: dict[str, Any]) -> None:
        """Add another machine's consumers, acknowledged ids, skipped files and hashes to these."""
        self.consumers.extend(ConsumerTimes(**times) for times in other["consumers"])
        self.members += len(other["consumers"])
        for epoch, theirs in other["epochs"].items():
            mine = self._account(epoch)
            mine.counts += theirs["counts"].numpy()
            mine.expected |= theirs["expected"].numpy()
            mine.skipped_ids.update(theirs["skipped_ids"])
            mine.loss_sum += theirs["loss_sum"]
        for path, reason in other["skipped"].items():
            self.skipped.setdefault(path, reason)
        for step, check in other["digests"].items():
            self.digests[step].update(check)
        for epoch, ranks in other["finished_last_step"].items():
            self._finished_last_step[epoch] |= set(ranks)

    @property
    def completed_epochs(self) -> list[int]:
        """Epochs whose last step every consumer finished in this run."""
        done = self._finished_last_step
        return sorted(e for e, ranks in done.items() if ranks and len(ranks) >= self.members)

    def record_skipped(self, epoch: int | None, skipped: dict[int, Skipped]) -> None:
        for item in skipped.values():
            self.skipped.setdefault(item.path, item.reason)
        if epoch is not None:
            self._account(epoch).skipped_ids.update(skipped)

    def expect(self, epoch: int, sample_ids: np.ndarray) -> None:
        self._account(epoch).expected[sample_ids] = True

    def forget_epoch(self, epoch: int) -> None:
        """The epoch begins again from its first batch (a Loader's loop left it early): its books start over."""
        self.epochs.pop(epoch, None)
        self._finished_last_step.pop(epoch, None)

    def _account(self, epoch: int) -> EpochAccount:
        if epoch not in self.epochs:
            size = self.samples_per_epoch
            self.epochs[epoch] = EpochAccount(np.zeros(size, np.int32), np.zeros(size, bool))
        return self.epochs[epoch]

    def rate(self, now: float) -> float:
        """Samples per second: each consumer's rate over its last whole steps (spanning RATE_WINDOW_S, or the last
        one where a step takes longer), summed over consumers; a consumer without a step for longer than twice
        that span has stalled and adds 0."""
        return sum(_rank_rate(steps, now) for steps in self.recent.values())

    def replicas_identical(self, final: dict[int, str]) -> bool:
        checks = [*self.digests.values(), final]
        return all(len(set(check.values())) == 1 for check in checks if check)

    def mismatched_steps(self) -> list[int]:
        return [step for step, check in self.digests.items() if len(set(check.values())) > 1]

    def latest_train_loss(self) -> float | None:
        """The mean loss of the latest epoch that trained a sample: the next epoch's books open when its first
        batches are handed out, which on a small run is most of an epoch early."""
        trained = [epoch for epoch, account in self.epochs.items() if account.consumed()]
        return self.train_loss(max(trained)) if trained else None

    def train_loss(self, epoch: int) -> float | None:
        account = self.epochs.get(epoch)
        if account is None or not account.consumed():
            return None
        return account.loss_sum / account.consumed()

    def shares(self) -> list[tuple[float, float, float]]:
        """Per consumer: (compute, input wait, averaging) as `time_shares` of its wall time, from its first step's
        start to its last step's end (waiting for the very first batch is start-up, not counted)."""
        return [cast(tuple[float, float, float],  # three shares in, three rounded out
                     tuple(round(share, 4)
                           for share in time_shares(c.compute_s, c.wait_s, c.averaging_s, c.wall_s(), c.host_s)))
                for c in self.consumers]

    def host_fractions(self) -> list[float]:
        """Per consumer: the `host_share` of its wall time (0 on the CPU, where the host is the device)."""
        return [round(host_share(c.compute_s, c.wait_s, c.averaging_s, c.wall_s(), c.host_s), 4)
                for c in self.consumers]

    def compute_fractions(self) -> list[float]:
        return [compute for compute, _, _ in self.shares()]

    def stall_fractions(self) -> list[float]:
        return [wait for _, wait, _ in self.shares()]

    def averaging_fractions(self) -> list[float]:
        return [averaging for _, _, averaging in self.shares()]

    def training_s(self) -> float:
        """The span the throughput is over: the slowest consumer's first step start to last step end."""
        return max((c.wall_s() for c in self.consumers), default=0.0)

    def throughput(self) -> float:
        span = self.training_s()
        return sum(c.samples for c in self.consumers) / span if span > 0 else 0.0

    def epoch_accounting(self) -> list[dict[str, int]]:
        return accounting_rows(self.epochs)

    def accounting(self) -> dict[str, Any]:
        """Duplicates and missing samples over the run, and how many of the missing were skipped as unusable."""
        rows = self.epoch_accounting()
        return {"duplicate_samples": sum(r["duplicates"] for r in rows),
                "missing_samples": sum(r["missing"] for r in rows),
                "missing_samples_skipped_as_unusable": sum(r["missing_unusable"] for r in rows)}

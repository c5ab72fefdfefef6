"""The run's summary (`RUN_DIR/summary.json`, docs/contracts.md) from what the controller holds."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from stoker.common import faults
from stoker.common.config import TrainConfig
from stoker.common.files import write_json
from stoker.observe.diagnosis import TimeSplit, Verdict, diagnose, feed_cores
from stoker.observe.evaluation import val_summary
from stoker.observe.metrics import MetricsLog, RunStats
from stoker.observe.summary import Ledger, exactly_once_breach
from stoker.pipeline.messages import ValReport
from stoker.run import cluster
from stoker.run.membership import ConsumerDeath, with_deaths
from stoker.training.model_file import BEST_MODEL_FILE, ModelFileError, read_model

log = logging.getLogger(__name__)


def run_verdict(stats: RunStats, ledger: Ledger, config: TrainConfig, overlap_allowed: bool,
                producers: dict[str, Any], deaths: list[ConsumerDeath]) -> Verdict:
    """The verdict over the run so far, from every consumer's totals (after --resume, the parts before this one
    too), with what each consumer's death cost: the live view, the log lines, the summary and the report all show
    this one. `producers`: the engine's side (`EngineDriver.verdict_fields`)."""
    if not stats.steps_done:
        return Verdict("starting", "no training step finished")
    run = ledger.so_far(stats)
    return with_deaths(diagnose(TimeSplit(
        compute=mean(run["compute_fraction"]), input_wait=mean(run["input_stall_fraction"]),
        averaging=mean(run["averaging_fraction"]), sync_every=config.sync_every,
        overlapped=config.overlap_averaging, host=mean(run["host_fraction"]), compiled=config.compile,
        slots=config.slots_per_consumer, overlap_allowed=overlap_allowed, image_size=config.resolved_image_size,
        **producers)), deaths)


def final_status(status: str, error: str | None, forced: bool, checkpoint_failure: str | None,
                 machines: cluster.Cluster, stats: RunStats, final_digests: dict[int, str]) -> tuple[str, str | None]:
    """The run's status once everything is closed: a checkpoint that could not be committed fails it, and on
    several machines (unless a second signal forced the stop) so does every machine's books gathered and
    compared (`cluster.gather_accounting`)."""
    if checkpoint_failure and status != "failed":
        status, error = "failed", checkpoint_failure
    if machines.multi and status != "failed" and not forced:
        error = cluster.gather_accounting(machines, stats, final_digests)
        status = "failed" if error else status
    return status, error


def conclude(summary: dict[str, Any], metrics: MetricsLog, run_dir: Path, leader: bool) -> None:
    """The run's end on every machine: an exactly-once breach logged, the summary in metrics.jsonl, the
    machines' group left, and on the first machine `summary.json` written."""
    if breach := exactly_once_breach(summary):
        log.error("%s", breach)
    metrics.write("summary", **{k: v for k, v in summary.items() if k != "skipped_files"})
    metrics.close()
    cluster.leave_controllers()
    if leader:
        write_json(run_dir / "summary.json", summary)


def draw_report(run_dir: Path) -> None:
    """`report.png` and `report.txt`; the run itself is done and saved, so a report that cannot be drawn is
    not fatal."""
    from stoker.observe.report import write_report

    try:
        faults.maybe_inject("controller", "drawing the report")
        write_report(run_dir)  # its text ends the command's output (cli), not the log
    except Exception as error:
        log.warning("could not draw the run report: %s: %s", type(error).__name__, error)


@dataclass(frozen=True)
class RunFacts:
    """What the summary is made of, as the controller holds it at the end."""

    stats: RunStats
    ledger: Ledger  # the parts of the run before this one
    val_reports: list[ValReport]
    final_digests: dict[int, str]  # global rank -> the replica's hash at the end
    gpu_memory: list[dict[str, int]]  # per local consumer that finished
    world: int
    machines: int
    devices: list[str]
    producers: dict[str, Any]  # `EngineDriver.producer_fields()`
    samples_expected: int
    verdict: dict[str, Any]
    checkpoint: Path | None
    run_dir: Path
    classes: list[str]
    ema: bool
    image_size: int
    val_image_size: int
    start_step: int
    start_epoch: int  # epochs done before this part
    started: float  # time.monotonic() at the start
    consumers_lost: tuple[dict[str, Any], ...] = ()  # `run.membership.ConsumerDeath.as_json()`, in order
    consumers_rejoined: tuple[dict[str, Any], ...] = ()  # consumers started again after a death, as they joined
    consumers_left_out: tuple[int, ...] = ()  # consumers that died past --consumer-restarts: their devices stay out
    consumers_at_end: int | None = None  # consumers training at the end (None: `world`)


def run_summary(run: RunFacts, status: str, error: str | None) -> dict[str, Any]:
    last_val = run.val_reports[-1] if run.val_reports else None
    digests = run.final_digests
    at_end = run.world if run.consumers_at_end is None else run.consumers_at_end
    summary = {
        "status": status,
        **({"error": error} if error else {}),
        "epochs": len(run.stats.completed_epochs),
        "steps": run.stats.steps_done,
        "num_consumers": run.world,
        "consumers_lost": list(run.consumers_lost),
        "consumers_rejoined": list(run.consumers_rejoined),
        "consumers_left_out": list(run.consumers_left_out),
        "consumers_at_end": at_end,
        "machines": run.machines,
        "devices": run.devices,
        "gpu_memory": run.gpu_memory,
        **run.producers,
        "samples_expected": run.samples_expected,
        "samples_consumed": [a.consumed() for _, a in sorted(run.stats.epochs.items())],
        **run.stats.accounting(),
        "epoch_accounting": run.stats.epoch_accounting(),
        "skipped_files": [{"path": p, "reason": r} for p, r in run.stats.skipped.items()],
        "input_stall_fraction": run.stats.stall_fractions(),
        "averaging_fraction": run.stats.averaging_fractions(),
        "compute_fraction": run.stats.compute_fractions(),
        "host_fraction": run.stats.host_fractions(),
        "verdict": run.verdict,
        "throughput_samples_per_s": round(run.stats.throughput(), 2),
        "feed_cores_per_device": feed_cores(run.producers.get("feed_cpu_ms_per_image"), run.stats.throughput(),
                                            at_end),
        "val_accuracy": last_val.accuracy if last_val else None,
        "val_loss": last_val.loss if last_val else None,
        "train_loss": run.stats.latest_train_loss(),
        "replicas_identical": bool(digests) and len(digests) == at_end
                              and run.stats.replicas_identical(digests),
        "replica_mismatch_steps": run.stats.mismatched_steps(),
        "checkpoint": str(run.checkpoint) if run.checkpoint else None,
        "model": str(run.run_dir / "model.pt") if status == "completed" else None,
        **best_model_fields(run.run_dir / BEST_MODEL_FILE),
        **val_summary(last_val, run.classes),
        "model_ema": str(run.run_dir / "model_ema.pt") if status == "completed" and run.ema else None,
        "classes": run.classes,
        "image_size": run.image_size,
        "val_image_size": run.val_image_size,
        "start_step": run.start_step,
        "wall_s": round(time.monotonic() - run.started, 3),
    }
    return run.ledger.whole_run(summary, run.stats, run.start_step, run.start_epoch)


def best_model_fields(path: Path) -> dict[str, Any]:
    """model_best.pt and the validation that chose it, as the file itself records them (a resumed run's best
    may come from an earlier part)."""
    try:
        card = read_model(path)[0] if path.exists() else None
    except ModelFileError:
        card = None
    return {"model_best": str(path) if card is not None else None,
            "best_epoch": card.epoch if card is not None else None,
            "best_val_accuracy": card.val_accuracy if card is not None else None}

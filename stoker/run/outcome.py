"""The run's summary (`RUN_DIR/summary.json`, docs/contracts.md) from what the controller holds."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoker.observe.evaluation import val_summary
from stoker.observe.metrics import RunStats
from stoker.observe.summary import Ledger
from stoker.pipeline.messages import ValReport
from stoker.training.model_file import BEST_MODEL_FILE, ModelFileError, read_model


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
    producers: dict[str, Any]  # `pipeline.engine.producer_fields`
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
    consumers_lost: tuple[dict[str, Any], ...] = ()  # `run.membership.Loss.as_json()`, in order
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

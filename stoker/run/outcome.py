"""The run's summary (`RUN_DIR/summary.json`, docs/design.md's contract) from what the controller holds."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stoker.observe.evaluation import val_summary
from stoker.pipeline.engine import producer_fields
from stoker.training.model_file import BEST_MODEL_FILE, ModelFileError, read_model

if TYPE_CHECKING:
    from stoker.run.controller import Controller


def run_summary(run: Controller, status: str, error: str | None) -> dict[str, Any]:
    last_epoch = max(run.stats.epochs, default=None)
    last_val = run.val_reports[-1] if run.val_reports else None
    digests = run.final_digests
    summary = {
        "status": status,
        **({"error": error} if error else {}),
        "epochs": len(run.stats.completed_epochs),
        "steps": run.stats.consumers[0].steps,
        "num_consumers": run.cluster.world,
        "machines": run.cluster.nodes,
        "devices": run.devices,
        "gpu_memory": [run.finished[rank].memory for rank in sorted(run.finished)],
        **producer_fields(run._engine),
        "samples_expected": run.plan.samples_per_epoch,
        "samples_consumed": [a.consumed() for _, a in sorted(run.stats.epochs.items())],
        **run.stats.accounting(),
        "epoch_accounting": run.stats.epoch_accounting(),
        "skipped_files": [{"path": p, "reason": r} for p, r in run.stats.skipped.items()],
        "input_stall_fraction": run.stats.stall_fractions(),
        "averaging_fraction": run.stats.averaging_fractions(),
        "compute_fraction": run.stats.compute_fractions(),
        "host_fraction": run.stats.host_fractions(),
        "verdict": run.run_verdict().as_json(),
        "throughput_samples_per_s": round(run.stats.throughput(), 2),
        "val_accuracy": last_val.accuracy if last_val else None,
        "val_loss": last_val.loss if last_val else None,
        "train_loss": run.stats.train_loss(last_epoch) if last_epoch is not None else None,
        "replicas_identical": bool(digests) and len(digests) == run.cluster.world
                              and run.stats.replicas_identical(digests),
        "replica_mismatch_steps": run.stats.mismatched_steps(),
        "checkpoint": str(run.checkpoints.last) if run.checkpoints.last else None,
        "model": str(run.run_dir / "model.pt") if status == "completed" else None,
        **best_model_fields(run.run_dir / BEST_MODEL_FILE),
        **val_summary(last_val, list(run.data.train.classes)),
        "model_ema": str(run.run_dir / "model_ema.pt") if status == "completed" and run.config.ema else None,
        "classes": list(run.data.train.classes),
        "image_size": run.image_size,
        "val_image_size": run.val_image_size,
        "start_step": run.start_at.global_step,
        "wall_s": round(time.monotonic() - run.started, 3),
    }
    return run.ledger.whole_run(summary, run.stats, run.start_at.global_step)


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

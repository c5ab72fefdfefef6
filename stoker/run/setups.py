"""What each consumer process is started with, from the run's settings."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from stoker.common.config import (
    AveragingSettings,
    DeviceSettings,
    ModelSettings,
    OptimizerSettings,
    RecipeSettings,
    TrainConfig,
)
from stoker.common.devices import threads_per_consumer
from stoker.pipeline.ring import RingSpec
from stoker.run.cluster import Cluster
from stoker.training.consumer import ConsumerSetup
from stoker.training.model_file import BEST_MODEL_FILE, model_card
from stoker.training.rendezvous import StoreAddress


def consumer_setups(config: TrainConfig, devices: list[str], cluster: Cluster, store: StoreAddress, ring: RingSpec,
                    classes: Sequence[str], total_steps: int, steps_per_epoch: int, resume_from: Path | None,
                    run_dir: Path) -> list[ConsumerSetup]:
    """One per local device; local rank r is global rank `cluster.first_rank + r`. `--init` only starts a new
    run: a resumed one continues from its checkpoint."""
    threads = threads_per_consumer(devices)
    # Into model.pt, model_best.pt and model_ema.pt; at the validation side, which stoker.load's preprocess, eval
    # and predict use.
    card = model_card(config.model, list(classes), config.resolved_val_image_size)
    model = config.section(ModelSettings)
    if resume_from is not None:
        model = ModelSettings(model=model.model, init=None)
    return [ConsumerSetup(
        rank=cluster.first_rank + rank, local_rank=rank, world_size=cluster.world, device=device, store=store,
        ring=ring, num_classes=len(classes), total_steps=total_steps, num_threads=threads, resume_from=resume_from,
        seed=config.seed, model=model, optimizer=config.section(OptimizerSettings),
        recipe=config.section(RecipeSettings), averaging=config.section(AveragingSettings),
        devices=config.section(DeviceSettings), warmup_steps=int(round(config.warmup_epochs * steps_per_epoch)),
        model_card=card, best_model=run_dir / BEST_MODEL_FILE, local_consumers=len(devices))
        for rank, device in enumerate(devices)]

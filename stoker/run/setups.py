"""What each consumer process is started with, from the run's settings."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from stoker.common.config import TrainConfig
from stoker.common.devices import threads_per_consumer
from stoker.pipeline.ring import RingSpec
from stoker.run.cluster import Cluster
from stoker.training.averager import OuterSpec
from stoker.training.consumer import ConsumerSetup
from stoker.training.model_file import BEST_MODEL_FILE, model_card
from stoker.training.recipe import RecipeSetup
from stoker.training.rendezvous import StoreAddress


def consumer_setups(config: TrainConfig, devices: list[str], cluster: Cluster, store: StoreAddress, ring: RingSpec,
                    classes: Sequence[str], total_steps: int, resume_from: Path | None, recipe: RecipeSetup,
                    run_dir: Path) -> list[ConsumerSetup]:
    """One per local device; local rank r is global rank `cluster.first_rank + r`."""
    threads = threads_per_consumer(devices)
    num_classes = len(classes)
    # Into model.pt, model_best.pt and model_ema.pt; at the validation side, which stoker.load's preprocess, eval
    # and predict use.
    card = model_card(config.model, list(classes), config.resolved_val_image_size)
    outer = None if config.outer_optimizer == "none" else OuterSpec(config.outer_optimizer, config.outer_lr,
                                                                     config.outer_momentum)
    return [ConsumerSetup(
        rank=cluster.first_rank + rank, local_rank=rank, world_size=cluster.world, device=device,
        store=store, ring=ring, model=config.model, num_classes=num_classes, optimizer=config.optimizer,
        lr=config.lr, schedule=config.schedule, total_steps=total_steps, momentum=config.momentum,
        weight_decay=config.weight_decay, sync_every=config.sync_every, outer=outer,
        overlap_averaging=config.overlap_averaging, average_in_backward=config.average_in_backward,
        seed=config.seed, num_threads=threads, collective_timeout_s=config.collective_timeout_s,
        check_replicas_every=config.check_replicas_every, resume_from=resume_from, precision=config.precision,
        channels_last=config.channels_last, compile=config.compile, deterministic=config.deterministic, recipe=recipe,
        model_card=card, best_model=run_dir / BEST_MODEL_FILE)
        for rank, device in enumerate(devices)]

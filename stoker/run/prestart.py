"""Before any process starts: every check a run can fail on for its settings, its data, its model or its folder,
and the one frozen `RunPlan` the controller runs from (devices, machines, samples, the epoch plan, the engine's
sizes, the run folder and where training starts). A user error is raised here, before a producer or consumer
exists; the controller itself checks nothing.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from stoker.common import checkpoint
from stoker.common.config import (
    RUN_CONFIG_FILE,
    AveragingSettings,
    DataSettings,
    FeedSettings,
    TrainConfig,
    names_where,
    takes,
)
from stoker.common.devices import available_cores, oversubscription, resolve_devices, shares_one_batch
from stoker.common.files import write_json
from stoker.common.positions import Position
from stoker.data.pixels import pixels_change
from stoker.data.sources import Data, load_data
from stoker.observe.metrics import MetricsLog
from stoker.observe.summary import read_accounting
from stoker.pipeline.driver import check_room
from stoker.pipeline.engine import EngineSpec, HostShare, Samples
from stoker.pipeline.plan import EpochPlan
from stoker.run import cluster, resume, rundir
from stoker.run.checkpoint_fit import model_fit_check
from stoker.run.cluster import Cluster
from stoker.training.ema import ema_warning
from stoker.training.groups import check_head_multiplier
from stoker.training.init import check_init
from stoker.training.model_file import BEST_MODEL_FILE
from stoker.training.models import build_model, check_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resumed:
    """Where this run starts: the position, the checkpoint it continues (None: a new run), that checkpoint's
    accounting (read on the machine whose disk holds it), and how many consumers' states it holds (0: none)."""

    start_at: Position = Position(0, 0, 0)
    folder: Path | None = None
    accounting: bytes | None = None
    consumers: int = 0


@dataclass(frozen=True)
class RunPlan:
    """What a run is, checked: `prepare(config)` makes it and starts no process. The run folder's lock is held
    from here until the controller's run ends."""

    config: TrainConfig
    devices: list[str]
    cluster: Cluster
    elastic: bool  # the others go on when a consumer dies
    data: Data
    plan: EpochPlan  # continuing where `resumed` starts
    engine: EngineSpec
    run_dir: Path
    run_lock: rundir.RunDirLock
    resumed: Resumed

    @property
    def num_slots(self) -> int:
        return self.engine.build.num_slots

    @property
    def num_consumers(self) -> int:
        return len(self.devices)  # on this machine

    def sample_counts(self) -> dict[str, int]:
        return sample_counts(self.data)

    @functools.cached_property
    def overlap_allowed(self) -> bool:
        """Whether the verdict may advise --overlap-averaging true: the run's other settings may refuse it."""
        return self.config.overlap_averaging or takes(self.config, overlap_averaging=True)

    def open_folder(self) -> MetricsLog:
        """At the run's start, on every machine: the lock's holder recorded, the settings written (`--resume`
        reads them), the folder marked as this job's (torchrun's restarts go on in it), and the metrics log."""
        config, machines, run_dir = self.config, self.cluster, self.run_dir
        self.run_lock.record_holder()
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run_dir / RUN_CONFIG_FILE, config.as_json())
        rundir.mark_job(run_dir)
        metrics_file = "metrics.jsonl" if machines.leader else f"metrics-node{machines.node}.jsonl"
        return MetricsLog(run_dir / metrics_file, run_dir / "tensorboard" if config.tensorboard else None,
                          append=config.resume is not None)


def sample_counts(data: Data) -> dict[str, int]:
    return {"train": len(data.train), "val": len(data.val or ())}


def prepare(config: TrainConfig) -> RunPlan:
    """Every check before any process starts, in the order a user meets them; the run folder locked last."""
    devices = resolve_devices(config.devices, config.batch_size)
    if warning := oversubscription(devices, available_cores()):
        log.warning("%s", warning)
    machines = cluster.from_environment(len(devices))
    on_gpus = any(device.startswith("cuda") for device in devices)
    averaging = config.section(AveragingSettings)
    elastic = averaging.continues_after_failure(len(devices), machines.nodes, on_gpus)
    averaging.check_failure_settings(len(devices), machines.multi, on_gpus, config.devices)
    data = load_data(config)
    one_batch = shares_one_batch(config.devices, devices)
    plan = _epoch_plan(config, data, machines, one_batch)
    # A slot holds a batch of --batch-size, or with --global-batch fixed the largest share a consumer may take.
    fewest = config.min_consumers if elastic else machines.world
    engine = EngineSpec.from_sections(config.section(FeedSettings), config.section(DataSettings), config.seed,
                                      Samples(data.train, data.val), HostShare.measure(devices),
                                      slots=config.slots_per_consumer * len(devices),
                                      batch_size=plan.largest_share(fewest))
    check_room(engine, "producers" if config.producers != "auto" else "initial_producers (or min_producers)")
    if warning := config.producer_timeout_warning(machines.world):
        log.warning("%s", warning)
    _check_model(config, len(data.train.classes))
    run_dir = Path(config.out or config.resume or rundir.default_run_dir())
    # Held until the run ends: taken before the folder is looked at, so two starts cannot both find it free.
    run_lock = rundir.RunDirLock(run_dir, machines.node)
    try:
        config, resumed, plan = _meet(config, machines, data, plan, run_dir)
    except BaseException:
        run_lock.close()
        raise
    share = plan.largest_share(fewest)
    if share != engine.build.batch_size:  # resumed on fewer consumers than its first count
        engine = engine.holding(share)
        check_room(engine, "producers")
    if one_batch:  # said once every check passed: a user error stays one line
        log.info("devices auto: %d CPU consumers share each step's batch of %d, as cpu:1 trains it (cpu:%d would "
                 "train %d a step)", machines.local_consumers, config.batch_size, machines.local_consumers,
                 config.batch_size * machines.local_consumers)
    return RunPlan(config, devices, machines, elastic, data, plan, engine, run_dir, run_lock, resumed)


def _epoch_plan(config: TrainConfig, data: Data, machines: Cluster, one_batch: bool) -> EpochPlan:
    """`one_batch`: the consumers of a machine split one `--batch-size` (`--devices auto` on the CPU): the plan of
    one consumer a machine (the reference count), its global batch fixed."""
    if config.batch_size > len(data.train):
        raise ValueError(f"batch_size={config.batch_size} is larger than the training set "
                         f"({len(data.train)} images)")
    plan = EpochPlan(len(data.train), len(data.val or ()), config.batch_size, machines.world, config.seed,
                     config.drop_last, reference_consumers=machines.nodes if one_batch else None,
                     fixed_global=one_batch or config.global_batch == "fixed")
    if plan.steps_per_epoch == 0:
        raise ValueError(f"drop_last=true with {len(data.train)} training images leaves no step: one takes "
                         f"{plan.per_step}")
    if warning := ema_warning(config.ema, plan.steps_per_epoch * config.epochs):
        log.warning("%s", warning)
    return plan


def _check_model(config: TrainConfig, classes: int) -> None:
    """The model builds for the classes and sizes given, `--init` fits it, and the head multiplier finds a head."""
    check_model(config.model, classes, config.resolved_image_size)
    if config.size_ramp is not None and config.size_ramp.low != config.resolved_image_size:
        check_model(config.model, classes, config.size_ramp.low, "image_size_ramp")
    if config.resolved_val_image_size != config.resolved_image_size:
        check_model(config.model, classes, config.resolved_val_image_size, "val_image_size")
    if config.init is not None and config.resume is None:
        check_init(config.init, config.model, classes)
    if config.lr_head_multiplier != 1.0:
        check_head_multiplier(build_model(config.model, classes), config.model, config.lr_head_multiplier)


def _meet(config: TrainConfig, machines: Cluster, data: Data, plan: EpochPlan,
          run_dir: Path) -> tuple[TrainConfig, Resumed, EpochPlan]:
    """The run folder checked, the machines met and agreed, and where training starts (the config says
    `resume` where torchrun started this job again)."""
    restarted = config.resume is None and rundir.started_again(run_dir)
    if config.resume is None and not restarted:
        rundir.check_new_run_dir(run_dir)
    cluster.join_controllers(machines, config.collective_timeout_s)
    cluster.check_same_settings(machines, _shared_settings(config, machines, data))
    if _after_a_restart(machines, run_dir, restarted) == "resume":
        log.warning("started again by torchrun: resuming %s from its last checkpoint", run_dir)
        config = config.replace(resume=run_dir)
    if config.resume is None:
        return config, Resumed(), plan
    resumed, plan = _resume_point(config, machines, data, plan, run_dir)
    return config, resumed, plan


def _after_a_restart(machines: Cluster, run_dir: Path, restarted: bool) -> str | None:
    """torchrun started this job's workers again (a machine lost, or a failure): the first machine decides from
    its folder and every machine's whether all go on from the last checkpoint at the machines there are now
    (`rundir.after_a_restart`); an error it finds stops every machine."""
    everyone = cluster.gather_to_leader(machines, restarted)
    decision: tuple[str | None, str | None] | None = None
    if machines.leader:
        try:
            decision = (rundir.after_a_restart(run_dir, restarted, any(everyone or ())), None)
        except rundir.RunDirError as error:
            decision = (None, str(error))
    action, refusal = cluster.from_leader(machines, decision)
    if refusal is not None:
        raise rundir.RunDirError(refusal)
    return action


def _shared_settings(config: TrainConfig, machines: Cluster, data: Data) -> dict[str, Any]:
    """What every machine must agree on (paths and producer counts are each machine's own business)."""
    local = names_where("machine_local")
    return {**{k: v for k, v in config.as_json().items() if k not in local},
            "consumers_per_machine": machines.local_consumers, "train_files": len(data.train),
            "val_files": len(data.val or ()), "classes": list(data.train.classes)}


def _resume_point(config: TrainConfig, machines: Cluster, data: Data, plan: EpochPlan,
                  run_dir: Path) -> tuple[Resumed, EpochPlan]:
    """The first machine finds the newest valid checkpoint; every machine continues from it."""
    assert config.resume is not None
    accounting: bytes | None = None
    found: tuple[str | None, Any, Any, Any, Any, str | None] | None = None
    if machines.leader:
        try:
            folder, meta = rundir.newest_checkpoint(config.resume, model_fit_check(config, len(data.train.classes)))
            resume.check_resumable(folder, meta, config, list(data.train.classes), sample_counts(data))
            if (change := pixels_change(meta.get("pixels"))) is not None:
                log.warning("%s: %s", folder, change)
            accounting = read_accounting(folder, meta)
            _set_aside_discarded_best(run_dir, meta["position"]["epoch"])
            found = (str(folder), meta["position"], meta["num_consumers"],
                     meta.get("reference_consumers", meta["num_consumers"]), resume.replicas_agree(meta), None)
        except (ValueError, checkpoint.CheckpointError) as failure:  # RunDirError, ResumeError
            found = (None, None, None, None, None, str(failure))
    folder, position, consumers, reference, agree, error = cluster.from_leader(machines, found)
    if error is not None:
        raise rundir.RunDirError(error)
    start = Position(**position)
    if consumers != machines.world:
        resume.check_other_count(config, consumers, machines.world, agree)
    # The epoch in progress goes on from its first sample not trained, in steps of this run's count: the plan
    # is made again where the checkpoint's count (or the first count, after a death) differs.
    offset = start.offset if start.offset is not None else replace(
        plan, num_consumers=consumers).offset(start.epoch, start.step)
    plan = replace(plan, reference_consumers=reference).continuing(start.epoch, start.step, offset)
    return Resumed(replace(start, offset=offset), Path(folder), accounting, consumers), plan


def _set_aside_discarded_best(run_dir: Path, epochs_done: int) -> None:
    aside = resume.set_aside_later_best(run_dir, epochs_done)
    if aside is not None:
        log.warning("%s chose its model in an epoch after the checkpoint this run resumes from (%d epochs "
                    "done); it is now %s, and this run's validations choose the best again",
                    BEST_MODEL_FILE, epochs_done, aside.name)

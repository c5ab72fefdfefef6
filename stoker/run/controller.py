"""The controller: validates, indexes the data, owns the slot ring and the queues, runs the processes, decides
when to fork or retire producers, has checkpoints committed (`checkpoints.py`) and writes the run summary. It never
touches pixels or gradients.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from statistics import mean
from typing import TYPE_CHECKING, Any

import numpy as np

from stoker.common import checkpoint, faults, zygote
from stoker.common.config import RUN_CONFIG_FILE, AveragingSettings, ModelSettings, TrainConfig, names_where, takes
from stoker.common.devices import available_cores, oversubscription, resolve_devices
from stoker.common.files import write_json
from stoker.common.memory import available_memory
from stoker.common.positions import Position
from stoker.common.procs import (
    CONTEXT,
    POLL_S,
    StokerRunError,
    describe_exit,
    name_process,
    start,
    stop_processes,
)
from stoker.data.sources import load_data
from stoker.observe.diagnosis import TimeSplit, Verdict, diagnose, divergence
from stoker.observe.evaluation import val_line
from stoker.observe.metrics import MetricsLog, RunStats, WindowTotals, host_share, step_fields, time_shares
from stoker.observe.progress import ProgressView, Snapshot
from stoker.observe.summary import Ledger, exactly_once_breach, read_accounting
from stoker.pipeline.autoscaler import StepStamp, static_budget
from stoker.pipeline.driver import SCALE_WINDOW_S, EngineDriver, check_room
from stoker.pipeline.engine import Build, Engine, ProducerCounts, producer_fields
from stoker.pipeline.messages import (
    ConsumerFailed,
    Finish,
    Finished,
    Save,
    Saved,
    SlotFree,
    StartupPhase,
    StepReport,
    ValReport,
)
from stoker.pipeline.parts import most_parts_in_flight
from stoker.pipeline.plan import EpochPlan
from stoker.pipeline.pool import check_hang_timeout, parts_held
from stoker.pipeline.scheduler import Scheduler, Unfinished
from stoker.run import cluster, resume, rundir
from stoker.run.checkpoint_fit import model_fit_check
from stoker.run.checkpoints import Checkpoints
from stoker.run.failures import FailureWitness
from stoker.run.lifecycle import Interrupted, Lifecycle
from stoker.run.membership import Membership, check_membership_settings, with_losses
from stoker.run.outcome import RunFacts, run_summary
from stoker.run.setups import consumer_setups
from stoker.run.startup_watch import StartupTimeout, StartupWatch
from stoker.training.consumer import ConsumerSetup, consumer_main
from stoker.training.ema import ema_warning
from stoker.training.groups import check_head_multiplier
from stoker.training.init import check_init
from stoker.training.memory_share import fixed_share_note
from stoker.training.model_file import BEST_MODEL_FILE
from stoker.training.models import build_model, check_model
from stoker.training.recovery import Joining, Regroup, Stranded
from stoker.training.rendezvous import LOOPBACK, LocalStore, StoreAddress, host_tcp_store, sweep_dead_stores

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = 1.0  # before a dead consumer's first start again; doubled for each next one



class Controller:
    """`Controller(config)` validates everything and starts nothing; `run()` trains and returns the summary."""

    def __init__(self, config: TrainConfig, show_progress: bool = True) -> None:
        faults.maybe_inject("controller", "starting up")
        self.config = config
        self.show_progress = show_progress
        self.devices = resolve_devices(config.devices)
        self.num_consumers = len(self.devices)  # on this machine
        if warning := oversubscription(self.devices, available_cores()):
            log.warning("%s", warning)
        self.cluster = cluster.from_environment(self.num_consumers)
        on_gpus = any(device.startswith("cuda") for device in self.devices)
        self.elastic = config.section(AveragingSettings).continues_after_failure(self.num_consumers,
                                                                                 self.cluster.nodes, on_gpus)
        check_membership_settings(config, self.num_consumers, self.cluster.multi, on_gpus)
        self.data = load_data(config)
        self.image_size = config.resolved_image_size
        self.val_image_size = config.resolved_val_image_size
        if config.batch_size > len(self.data.train):
            raise ValueError(f"batch_size={config.batch_size} is larger than the training set "
                             f"({len(self.data.train)} images)")
        self.plan = EpochPlan(len(self.data.train), len(self.data.val or ()), config.batch_size,
                              self.cluster.world, config.seed, config.drop_last,
                              fixed_global=config.global_batch == "fixed")
        if self.plan.steps_per_epoch == 0:
            raise ValueError(f"drop_last=true with {len(self.data.train)} training images leaves no step: one takes "
                             f"{config.batch_size * self.cluster.world} (batch_size x {self.cluster.world} consumers)")
        if warning := ema_warning(config.ema, self.plan.steps_per_epoch * config.epochs):
            log.warning("%s", warning)
        self.num_slots = config.slots_per_consumer * self.num_consumers
        self.counts = ProducerCounts.from_settings(config.producers, config.min_producers, config.initial_producers,
                                                   config.max_producers, static_budget(self.devices, available_cores()),
                                                   available_cores(),
                                                   most_parts_in_flight(config.batch_size, self.num_slots),
                                                   available_memory())
        # A slot holds a batch of --batch-size, or with --global-batch fixed the largest share a consumer may take.
        self.build = Build(self.data.train, self.data.val, config.augment, config.seed, self._largest_share(),
                           self.image_size, self.num_slots, config.producer_timeout_s, config.max_bad_fraction,
                           self.val_image_size, max_in_flight=parts_held(self.data.train))
        check_room(self.build, self.counts, "producers" if config.producers != "auto"
                   else "initial_producers (or min_producers)")
        check_hang_timeout(config.producer_timeout_s, config.collective_timeout_s, self.cluster.world)
        check_model(config.model, len(self.data.train.classes), self.image_size)
        if self.val_image_size != self.image_size:
            check_model(config.model, len(self.data.train.classes), self.val_image_size, "val_image_size")
        if config.init is not None and config.resume is None:
            check_init(config.init, config.model, len(self.data.train.classes))
        if config.lr_head_multiplier != 1.0:
            check_head_multiplier(build_model(config.model, len(self.data.train.classes)), config.model,
                                  config.lr_head_multiplier)
        self.run_dir = Path(config.out or config.resume or rundir.default_run_dir())
        # Held until run() ends: taken before the folder is looked at, so two starts cannot both find it free.
        self.run_lock = rundir.RunDirLock(self.run_dir, self.cluster.node)
        try:
            restarted = config.resume is None and rundir.started_again(self.run_dir)
            if config.resume is None and not restarted:
                rundir.check_new_run_dir(self.run_dir)
            cluster.join_controllers(self.cluster, config.collective_timeout_s)
            cluster.check_same_settings(self.cluster, self._shared_settings())
            if self._after_a_restart(restarted) == "resume":
                log.warning("started again by torchrun: resuming %s from its last checkpoint", self.run_dir)
                self.config = config = config.replace(resume=self.run_dir)
            self.start_at, self.resume_from = self._resume_point()
            share = self._largest_share()
            if share != self.build.batch_size:  # resumed on fewer consumers than its first count
                self.build = replace(self.build, batch_size=share)
                check_room(self.build, self.counts, "producers")
            self._reset_state()
        except BaseException:
            self.run_lock.close()
            raise

    def _after_a_restart(self, restarted: bool) -> str | None:
        """torchrun started this job's workers again (a machine lost, or a failure): the first machine decides from
        its folder and every machine's whether all go on from the last checkpoint at the machines there are now
        (`rundir.after_a_restart`); an error it finds stops every machine."""
        everyone = cluster.gather_to_leader(self.cluster, restarted)
        decision: tuple[str | None, str | None] | None = None
        if self.cluster.leader:
            try:
                decision = (rundir.after_a_restart(self.run_dir, restarted, any(everyone or ())), None)
            except rundir.RunDirError as error:
                decision = (None, str(error))
        action, refusal = cluster.from_leader(self.cluster, decision)
        if refusal is not None:
            raise rundir.RunDirError(refusal)
        return action

    def _largest_share(self) -> int:
        """The samples a batch slot must hold: `--batch-size`, or with `--global-batch fixed` the share of each
        consumer when the fewest train that the run goes on with (`--min-consumers`; the count it has, where a death
        ends it)."""
        fewest = self.config.min_consumers if self.elastic else self.cluster.world
        return self.plan.largest_share(fewest)

    def _shared_settings(self) -> dict[str, Any]:
        """What every machine must agree on (paths and producer counts are each machine's own business)."""
        local = names_where("machine_local")
        return {**{k: v for k, v in self.config.as_json().items() if k not in local},
                "consumers_per_machine": self.num_consumers, "train_files": len(self.data.train),
                "val_files": len(self.data.val or ()), "classes": list(self.data.train.classes)}

    def _resume_point(self) -> tuple[Position, Path | None]:
        """The first machine finds the newest valid checkpoint; every machine continues from it."""
        self.resume_accounting: bytes | None = None  # read here, on the machine whose disk holds it
        self.checkpoint_consumers = 0  # consumers whose states the checkpoint holds (0: none is resumed)
        if self.config.resume is None:
            return Position(0, 0, 0), None
        found: tuple[str | None, Any, Any, Any, Any, str | None] | None = None
        if self.cluster.leader:
            try:
                fits = model_fit_check(self.config, len(self.data.train.classes))
                folder, meta = rundir.newest_checkpoint(self.config.resume, fits)
                resume.check_resumable(folder, meta, self.config, list(self.data.train.classes),
                                       self._sample_counts())
                self.resume_accounting = read_accounting(folder, meta)
                self._set_aside_discarded_best(meta["position"]["epoch"])
                found = (str(folder), meta["position"], meta["num_consumers"],
                         meta.get("reference_consumers", meta["num_consumers"]), resume.replicas_agree(meta), None)
            except (ValueError, checkpoint.CheckpointError) as failure:  # RunDirError, ResumeError
                found = (None, None, None, None, None, str(failure))
        folder, position, consumers, reference, agree, error = cluster.from_leader(self.cluster, found)
        if error is not None:
            raise rundir.RunDirError(error)
        start = Position(**position)
        if consumers != self.cluster.world:
            resume.check_other_count(self.config, consumers, self.cluster.world, agree)
        # The epoch in progress goes on from its first sample not trained, in steps of this run's count: the plan
        # is made again where the checkpoint's count (or the first count, after a death) differs.
        offset = start.offset if start.offset is not None else replace(
            self.plan, num_consumers=consumers).offset(start.epoch, start.step)
        self.plan = replace(self.plan, reference_consumers=reference).continuing(start.epoch, start.step, offset)
        self.checkpoint_consumers = consumers
        return replace(start, offset=offset), Path(folder)

    def _set_aside_discarded_best(self, epochs_done: int) -> None:
        aside = resume.set_aside_later_best(self.run_dir, epochs_done)
        if aside is not None:
            log.warning("%s chose its model in an epoch after the checkpoint this run resumes from (%d epochs "
                        "done); it is now %s, and this run's validations choose the best again",
                        BEST_MODEL_FILE, epochs_done, aside.name)

    def _sample_counts(self) -> dict[str, int]:
        return {"train": len(self.data.train), "val": len(self.data.val or ())}

    def _reset_state(self) -> None:
        self.driver = EngineDriver(self.build, self.counts)  # ring, producers, order of work; started with the run
        self.consumers: list = []
        # CPU consumers are forked from a zygote that imported torch once; a GPU's are spawned (common/zygote.py)
        self.consumer_zygote = zygote.CONSUMERS if zygote.consumers_may_fork(self.devices) else None
        self.consumer_lease = zygote.Lease()
        self.ready_queues: list = []
        self.store: dist.Store | None = None
        self.local_store: LocalStore | None = None
        self.agreement: cluster.StopAgreement | None = None  # several machines: where all stop when one is told to
        self.stop = self.driver.stop
        self.mailbox = self.driver.mailbox
        self.witness = FailureWitness(self.consumers, self.mailbox, self.config.collective_timeout_s)
        self.membership = Membership(self.devices, CONTEXT.Value("i", 0) if self.elastic else None,
                                     self.config.min_consumers, self.config.sync_every,
                                     self.config.collective_timeout_s, time.monotonic())
        self.failure_causes: dict[int, str] = {}  # consumer -> the error it reported before it died
        self.restarts_used: dict[int, int] = {}  # consumer -> times it was started again
        self.restart_at: dict[int, float] = {}  # consumer -> when it is to be started again
        self.starting_again: dict[int, Any] = {}  # consumer -> its new process, until it says it is ready
        self.joiners: set[int] = set()  # consumers started again and ready, waiting for a moment to join
        self.left_out: list[int] = []  # consumers whose device stays out: they died past --consumer-restarts
        self.setups: list[ConsumerSetup] = []
        self.stats = RunStats(self.num_consumers, self.plan.samples_per_epoch, self.plan.steps_per_epoch,
                              self.cluster.first_rank)
        for item in self.data.refused:
            self.stats.skipped.setdefault(item.path, item.reason)
        self.ledger = Ledger()  # the parts of the run before this one
        if self.resume_from is not None:  # the folder other machines receive is never opened there
            self.ledger.resume(self.resume_accounting, self.run_dir, self.stats)
        self.checkpoints = Checkpoints(self.run_dir, self.config, self.cluster, self.num_consumers,
                                       list(self.data.train.classes),
                                       self._sample_counts(), self.ledger)
        self.checkpoints.reference_consumers = self.plan.reference.num_consumers
        self.finished: dict[int, Finished] = {}
        self.final_digests: dict[int, str] = {}  # global rank -> the replica's hash at the end, every machine
        self.val_reports: list[ValReport] = []
        self.last_queue_fill = 0.0
        self.lifecycle = Lifecycle()  # what a signal means now; `lifecycle.interrupted`: one arrived here
        self.stopping = False  # stopping early: this machine or another one was interrupted
        self.finishing = False
        self.closed = False

    # ---- the run -----------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        try:
            with self.lifecycle.handling_signals():
                return self._run()
        finally:
            self.run_lock.close()

    def _run(self) -> dict[str, Any]:
        name_process("stoker controller")
        self.run_lock.record_holder()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_json(self.run_dir / RUN_CONFIG_FILE, self.config.as_json())  # every machine: `--resume` reads it
        rundir.mark_job(self.run_dir)  # under torchrun: its restarts of this job go on in this folder
        metrics_file = "metrics.jsonl" if self.cluster.leader else f"metrics-node{self.cluster.node}.jsonl"
        self.metrics = MetricsLog(self.run_dir / metrics_file,
                                  self.run_dir / "tensorboard" if self.config.tensorboard else None,
                                  append=self.config.resume is not None)
        self.started = self.membership.started = time.monotonic()
        status, error, forced = "completed", None, False
        try:
            self._start()
            self._loop()
            self._show(final=True)  # the last panel or log line holds the numbers of the summary
            if self.stopping:
                status = "interrupted"
        except Interrupted:
            status, forced = "interrupted", True
            self.lifecycle.stop_now()
        except (StokerRunError, OSError) as failure:
            status, error = "failed", str(failure)
            log.error("run failed: %s", failure)
        except Exception as failure:  # a bug, or a malformed message from another machine: still a summary
            status, error = "failed", f"internal error: {type(failure).__name__}: {failure}"
            log.exception("run failed with an internal error")
        finally:
            self.lifecycle.closing()
            self.close()
        if self.checkpoints.failure and status != "failed":
            status, error = "failed", self.checkpoints.failure
        if self.cluster.multi and status != "failed" and not forced:
            error = cluster.gather_accounting(self.cluster, self.stats, self.final_digests)
            status = "failed" if error else status
        summary = self.summary(status, error)
        if breach := exactly_once_breach(summary):
            log.error("%s", breach)
        self.metrics.write("summary", **{k: v for k, v in summary.items() if k != "skipped_files"})
        self.metrics.close()
        cluster.leave_controllers()
        if self.cluster.leader:
            write_json(self.run_dir / "summary.json", summary)
            if self.config.report:
                with self.lifecycle.reporting():
                    self._write_report()
        return summary

    def _write_report(self) -> None:
        from stoker.observe.report import write_report

        try:
            faults.maybe_inject("controller", "drawing the report")
            write_report(self.run_dir)  # its text ends the command's output (cli), not the log
        except Exception as error:  # the run itself is done and saved; a report that cannot be drawn is not fatal
            log.warning("could not draw the run report: %s: %s", type(error).__name__, error)

    def _start(self) -> None:
        # First: children started after it write their warnings above the live panel, not through it.
        self.view = ProgressView(self.plan.steps_per_epoch * self.config.epochs, self.plan.steps_per_epoch,
                                 self.config.log_every_s, self.show_progress)
        sweep_dead_stores()
        config = self.config
        self.scheduler = Scheduler(self.plan, config.epochs, self.start_at, self.num_slots, self.data.val is not None,
                                   config.checkpoint_every, self.run_dir, self.cluster.first_rank, self.num_consumers)
        if self.consumer_zygote is not None:  # first: its imports go on while the producers start
            self.consumer_lease = self.consumer_zygote.acquire()
        self.driver.start(self.stats, self.metrics, self.scheduler)
        self._start_consumers()
        faults.maybe_inject("controller", "consumers started")
        self.metrics.write("start", devices=self.devices, producers=self.counts.initial, config=config.as_json(),
                           resume_from=self.resume_from)

    def _consumer_store(self) -> StoreAddress:
        """One machine: a file in a private folder, nothing on the network. Several: the first machine hosts
        the store through which every machine's consumers form their group."""
        if not self.cluster.multi:
            self.local_store = LocalStore()
            return self.local_store.address
        address = None
        if self.cluster.leader:
            self.store, address = host_tcp_store(os.environ.get("MASTER_ADDR", LOOPBACK), self.cluster.world,
                                                 self.config.collective_timeout_s)
        host, port = cluster.from_leader(self.cluster, (address.host, address.port) if address else None)
        return StoreAddress(host=host, port=port)

    def _start_consumers(self) -> None:
        store = self._consumer_store()
        if self.cluster.multi:
            self.agreement = cluster.StopAgreement.join(self.cluster, self.store, store,
                                                        self.config.collective_timeout_s)
        reference = self.plan.reference
        setups = consumer_setups(self.config, self.devices, self.cluster, store, self.engine.ring.spec,
                                 self.data.train.classes, reference.steps_per_epoch * self.config.epochs,
                                 reference.steps_per_epoch, self.resume_from, self.run_dir)
        one_sample = self.plan.one_sample_batches()  # the compile warm-up's size 1 only where the run meets it
        note = fixed_share_note(self.config.batch_size, self._largest_share(), self.cluster.world,
                                self.config.global_batch)
        self.setups = [replace(setup, start_step=self.start_at.global_step, elastic=self.elastic,
                               checkpoint_consumers=self.checkpoint_consumers, one_sample=one_sample,
                               share_note=note) for setup in setups]
        self.startup = StartupWatch(self.config.collective_timeout_s)
        for rank, setup in enumerate(self.setups):
            self.ready_queues.append(CONTEXT.Queue())
            self.consumers.append(self._start_consumer(rank, setup))
            self.startup.start(rank)

    def _start_consumer(self, rank: int, setup: ConsumerSetup) -> Any:
        outbox = self.mailbox.open()
        try:
            return start(consumer_main, (setup, self.ready_queues[rank], outbox, self.stop,
                                         self.membership.generation), f"stoker consumer {rank}",
                         self.consumer_zygote.context if self.consumer_zygote is not None else CONTEXT)
        except (EOFError, ConnectionError) as error:  # the consumers' zygote died before it could fork
            if self.consumer_zygote is None:
                raise
            raise StokerRunError(self.consumer_zygote.ended_before_forking(error)) from None
        finally:
            outbox.close()

    def _loop(self) -> None:
        window_started = time.monotonic()
        window = WindowTotals()
        while not all(consumer in self.finished for consumer in self.membership.members):
            self._follow_interrupts()
            regrouping = self.membership.regrouping  # nothing new is built or handed over meanwhile
            if not regrouping:
                self.engine.dispatch()
                self._deliver(window)
            for message in self.driver.pump(POLL_S, dispatch=not regrouping):  # the producers' go to the engine
                self._handle(message, window)
            self._check_consumers()
            self._check_startup()
            self._kill_stuck_consumers()
            self._start_consumers_again()
            self._admit_joiners()
            if self.membership.ready(self.finished):
                self._regroup()
            self.membership.check_deadline()
            self.checkpoints.record_commits(self.metrics)
            if time.monotonic() - window_started >= SCALE_WINDOW_S:
                self._close_window(window, time.monotonic() - window_started)
                window_started, window = time.monotonic(), WindowTotals()
            self._show()

    def _follow_interrupts(self) -> None:
        """An interrupt stops every consumer after the same row of work: on one machine the furthest row started;
        on several, the furthest row any machine started once it heard of the interrupt (`StopAgreement`)."""
        agreement = self.agreement
        if agreement is None:
            self.stopping = self.lifecycle.interrupted
            if self.stopping and not self.finishing:
                self.scheduler.cut(skip_validation=True)  # a signal waits for no whole validation pass
            return
        if self.lifecycle.interrupted:
            agreement.request()
        elif not agreement.requested():
            return
        elif not self.stopping:
            log.warning("another machine was interrupted: stopping with it after a step every machine reaches, "
                        "with a checkpoint")
        self.stopping = True
        if not agreement.posted:
            agreement.post(self.scheduler.cut())
        if (row := agreement.poll_row()) is not None:
            self.scheduler.cut(row)

    def _deliver(self, window: WindowTotals) -> None:
        for rank, message in self.driver.deliverable():
            self.ready_queues[self.membership.members[rank]].put(message)
            if isinstance(message, Save):
                self.checkpoints.expect(message.position)
            if faults.armed() and getattr(message, "kind", None) == "val":
                faults.maybe_inject("controller", f"val batch {message.step} of epoch {message.epoch} handed over")
        waiting = self.agreement is not None and self.agreement.waiting
        if not self.finishing and not waiting and self.scheduler.exhausted():
            self._finish()
        window.queue_samples += 1
        window.queue_fill += self.engine.queue_fill()

    def _finish(self) -> None:
        """Every consumer got its last batch: save where an interrupt stopped us, then write the final model."""
        self.finishing = True
        position = self.scheduler.position
        if self.stopping and position.global_step not in self.scheduler.saves_issued:
            folder = checkpoint.checkpoint_dir(self.run_dir, position.global_step, temporary=True)
            for consumer in self.membership.members:
                self.ready_queues[consumer].put(Save(folder, position.global_step, position))
            self.checkpoints.expect(position)
        for consumer in self.membership.members:
            self.ready_queues[consumer].put(Finish(self.run_dir / "model.pt"))

    def _handle(self, message: Any, window: WindowTotals) -> None:
        now = time.monotonic()
        if isinstance(message, SlotFree):
            if self.membership.slot_counts(message.generation):
                self.engine.release(message.slot)
        elif isinstance(message, StepReport):
            if self.membership.counts(message):
                self._record_step(message, window, now)
        elif isinstance(message, ValReport):
            self.val_reports.append(message)
            self.metrics.write("val", epoch=message.epoch, loss=message.loss, accuracy=message.accuracy,
                               count=message.count, top5=message.top5, ema=message.ema)
            if self.show_progress:  # --quiet: no progress lines (the numbers are in metrics.jsonl and the ending)
                log.info("%s", val_line(message))
        elif isinstance(message, Saved):
            self.checkpoints.saved(message, self.stats)
        elif isinstance(message, Finished):
            self.finished[message.rank] = message
            self.final_digests[self.cluster.first_rank + message.rank] = message.digest
        elif isinstance(message, Stranded):
            self.membership.strand(message)
        elif isinstance(message, Joining):
            self._joining(message.rank)
        elif isinstance(message, StartupPhase):
            self.startup.reported(message.rank, message.phase)
        elif isinstance(message, ConsumerFailed):
            if self.membership.elastic:  # it ends now; its death is what the survivors regroup after
                self.failure_causes[message.rank] = str(message.error)
                log.error("consumer %d failed: %s\n%s", message.rank, message.error, message.error.trace)
                return
            causes = self.witness.causes(message)
            if not causes and self.cluster.multi:
                causes = ["a consumer on another machine may have stopped first (see that machine's log)"]
            raise StokerRunError("; ".join([*causes, str(message.error)]) + f"\n{message.error.trace}")

    def _record_step(self, message: StepReport, window: WindowTotals, now: float) -> None:
        self.stats.record_step(message, now)
        self.ledger.record_step(message)
        window.add(message)
        self.metrics.write("step", **step_fields(message, self.cluster.first_rank))
        if message.count and (diverged := divergence(message.loss, message.global_step,
                                                     self.cluster.first_rank + message.rank, self.config.lr)):
            raise StokerRunError(diverged)
        if message.digest is not None:
            self._compare_replicas(message)

    def _compare_replicas(self, report: StepReport) -> None:
        identical = self.stats.record_digest(report)
        if identical is not None:
            self.metrics.write("replica_check", global_step=report.global_step, identical=identical)
            if not identical:
                log.error("replicas differ after the averaging of step %d", report.global_step)

    def _check_startup(self) -> None:
        try:
            self.startup.check()
        except StartupTimeout as error:
            raise StokerRunError(str(error)) from None

    def _check_consumers(self) -> None:
        for consumer, process in list(self.starting_again.items()):
            if not process.is_alive():  # died while it started: a restart used, and maybe another planned
                del self.starting_again[consumer]
                log.warning("consumer %d (pid %s) %s while it started again", consumer, process.pid,
                            describe_exit(process))
                self._plan_restart(consumer)
        for rank in list(self.membership.members):
            process = self.consumers[rank]
            if not process.is_alive() and rank not in self.finished:
                self._read_last_messages(rank)
                if rank in self.finished:
                    continue
                cause = f"consumer {rank} (pid {process.pid}) {describe_exit(process)}"
                if self.consumer_zygote is not None and not self.consumer_zygote.alive():
                    cause += ": the zygote consumers are forked from died, and every consumer with it"
                if not self.membership.elastic or not self.stats.steps_done:  # before the first step: starting up
                    self.witness.log_reported_failures()
                    raise StokerRunError(cause)
                self._lose(rank, cause)

    # ---- a consumer's death, when the others go on --------------------------------------------------------------

    def _lose(self, consumer: int, cause: str) -> None:
        if reported := self.failure_causes.pop(consumer, None):
            cause = f"{cause}: {reported.splitlines()[0]}"
        loss = self.membership.lose(consumer, cause)  # below --min-consumers: the run fails
        if loss is None:  # started again, died before it joined
            log.warning("%s before it joined the others", cause)
        else:
            log.warning("%s; the other %d consumer(s) go on without it", cause, len(self.membership.members))
            self.metrics.write("consumer_lost", consumer=consumer, device=loss.device, cause=cause,
                               t=round(loss.died_s, 3), consumers=len(self.membership.members))
        self._plan_restart(consumer)

    # ---- a consumer started again -------------------------------------------------------------------------------

    def _plan_restart(self, consumer: int) -> None:
        """Start the consumer again on its device after a back-off (1 s, 2 s, 4 s, ...), at most
        `--consumer-restarts` times; past that its device stays out."""
        used = self.restarts_used.get(consumer, 0)
        if used >= self.config.consumer_restarts:
            self.left_out.append(consumer)
            log.warning("consumer %d (%s) stays out: it died after %d start(s) again (consumer_restarts=%d)",
                        consumer, self.devices[consumer], used, self.config.consumer_restarts)
            return
        self.restarts_used[consumer] = used + 1
        self.restart_at[consumer] = time.monotonic() + RESTART_BACKOFF_S * 2 ** used

    def _start_consumers_again(self) -> None:
        if self.membership.regrouping or self.stopping or self.finishing:
            return
        for consumer, due in list(self.restart_at.items()):
            if time.monotonic() < due:
                continue
            del self.restart_at[consumer]
            old = self.ready_queues[consumer]  # the dead consumer's: what it was sent is dropped with it
            old.cancel_join_thread()
            old.close()
            self.ready_queues[consumer] = CONTEXT.Queue()
            setup = replace(self.setups[consumer], joining=True, resume_from=None, elastic=True,
                            model_settings=ModelSettings(model=self.config.model, init=None))
            self.failure_causes.pop(consumer, None)
            self.consumers[consumer] = self._start_consumer(consumer, setup)
            self.starting_again[consumer] = self.consumers[consumer]
            log.info("consumer %d started again on %s", consumer, self.devices[consumer])

    def _joining(self, consumer: int) -> None:
        """A consumer started again is ready: it joins at the next regroup, once no checkpoint is being written
        (none while the run ends). A `Joining` said again (its regroup was overtaken) keeps its place."""
        if consumer in self.membership.members:
            self.membership.join(consumer)
            return
        process = self.starting_again.pop(consumer, None)
        if process is None or not process.is_alive():
            return  # from a start that died meanwhile (its death was counted)
        if self.stopping or self.finishing:
            process.kill()
            return
        self.joiners.add(consumer)

    def _admit_joiners(self) -> None:
        if not self.joiners or self.membership.regrouping or self.checkpoints.pending:
            return
        for consumer in sorted(self.joiners):
            self.membership.join(consumer)
            self.metrics.write("consumer_joining", consumer=consumer, device=self.devices[consumer])
        self.joiners = set()

    def _kill_stuck_consumers(self) -> None:
        for consumer in self.membership.stuck():
            process = self.consumers[consumer]
            self.failure_causes[consumer] = (f"stuck: its peers gave up waiting for it after collective_timeout_s="
                                             f"{self.config.collective_timeout_s:g}")
            log.warning("consumer %d (pid %s) is stuck outside the collective its peers left: killing it", consumer,
                        process.pid)
            process.kill()
            process.join(timeout=5.0)

    def _regroup(self) -> None:
        """Every survivor left the broken group: go back to the state they all hold, plan the rest of the run
        for them from there, and send each its place in the new group."""
        membership, old = self.membership, self.scheduler
        membership.drop_finished(self.finished)
        agreed = membership.agreed_step()
        taken_back = membership.take_back(agreed)
        for report in taken_back:
            self.stats.retract(report)
        for global_step in [step for step in self.stats.digests if step > agreed]:
            del self.stats.digests[global_step]  # trained again: its replicas are compared again
        self.ledger.take_back(agreed)
        self._credit_lost_steps(old, agreed)
        self.driver.drain(3 * self.config.producer_timeout_s, lambda message: self._handle(message, WindowTotals()))
        position = old.position_after(agreed)
        consumers = len(membership.members)
        self.plan = self.plan.regrouped(consumers, position.epoch, position.step, position.offset or 0)
        self.checkpoints.regroup(consumers, agreed, self.stats)
        self.scheduler = Scheduler(self.plan, self.config.epochs, position, self.num_slots,
                                   self.data.val is not None, self.config.checkpoint_every, self.run_dir,
                                   self.cluster.first_rank, consumers, self._unfinished(position))
        if self.stopping:
            self.scheduler.cut(-1)  # interrupted meanwhile: only the checkpoint where the survivors stand
        self.engine.follow(self.scheduler)
        self.stats.members = consumers
        fresh = tuple(rank for rank, consumer in enumerate(membership.members) if consumer in membership.fresh)
        source = next(rank for rank in range(consumers) if rank not in fresh)
        for rank, consumer in enumerate(membership.members):
            self.ready_queues[consumer].put(Regroup(membership.current, rank, consumers, agreed, fresh, source))
        steps_back = len({report.global_step for report in taken_back})
        started = membership.regrouping_since or time.monotonic()
        membership.regrouped(agreed, steps_back)
        self.finishing = False
        log.warning("%d consumer(s)%s go on from the state after step %d (%d step(s) trained again)", consumers,
                    f", {len(fresh)} of them started again," if fresh else "", agreed, steps_back)
        self.metrics.write("regrouped", consumers=consumers, members=list(membership.members), agreed_step=agreed,
                           recovered_s=round(time.monotonic() - started, 4), steps_taken_back=steps_back,
                           joined=[membership.members[rank] for rank in fresh], epoch=position.epoch,
                           offset=position.offset)

    def _credit_lost_steps(self, old: Scheduler, agreed: int) -> None:
        """A dead consumer's steps up to the agreed state are in the survivors' weights (its part of every
        averaging up to it arrived) even where its report did not (on a GPU, steps are reported in groups):
        they count, with the samples the plan gave it, less those that were unusable."""
        for loss in self.membership.losses:
            if loss.recovered_s is not None:
                continue
            first = max(self.membership.last_reported.get(loss.consumer, -1) + 1, old.start.global_step)
            for global_step in range(first, agreed + 1):
                work = old.work_of(global_step, loss.rank)
                skipped = self.stats.epochs[work.epoch].skipped_ids if work.epoch in self.stats.epochs else set()
                ids = np.array([i for i in work.sample_ids.tolist() if i not in skipped], np.int64)
                report = StepReport(loss.consumer, work.epoch, work.step, global_step, len(ids), 0.0, 0.0, 0.0,
                                    0.0, ids, None, epoch_steps=old.plan.steps_in(work.epoch))
                self.stats.record_step(report, time.monotonic())
                self.ledger.record_step(report)

    def _unfinished(self, position: Position) -> Unfinished:
        """What of the row before `position` the broken group may not have done: the validation of the epoch it
        ended, and the checkpoint at it."""
        if position.global_step <= self.start_at.global_step:
            return Unfinished()  # this part started there: the part before did both
        epoch_end = position.step == 0 and position.epoch > 0
        every = self.config.checkpoint_every
        due = epoch_end or bool(every and position.global_step % every == 0)
        validated = any(report.epoch == position.epoch - 1 for report in self.val_reports)
        return Unfinished(validate=epoch_end and self.data.val is not None and not validated,
                          save=due and position.global_step not in self.checkpoints.completed)

    def _read_last_messages(self, rank: int) -> None:
        """A consumer that finished sends Saved and Finished and exits at once: they may still be in its pipe."""
        while rank not in self.finished and (messages := self.driver.pump(POLL_S)):
            for message in messages:
                self._handle(message, WindowTotals())

    def _close_window(self, window: WindowTotals, elapsed_s: float) -> None:
        """Every SCALE_WINDOW_S: record the pipeline's state and let the autoscaler decide."""
        consumer_time = max(1e-9, elapsed_s * self.num_consumers)
        queue_fill = window.queue_fill / max(1, window.queue_samples)
        self.last_queue_fill = queue_fill
        parts = (window.compute_s, window.wait_s, window.averaging_s, consumer_time)
        compute, wait, averaging = time_shares(*parts, host_s=window.host_s)
        host = host_share(*parts, window.host_s)
        n = self.num_consumers  # a rate of all consumers: their mean time in steps, as train_s
        self.driver.close_window(
            elapsed_s, window.samples, window.steps, queue_fill, wait,
            train_s=(window.wait_s + window.host_s + window.compute_s + window.averaging_s) / n,
            shares={"compute": compute, "input_wait": wait, "averaging": averaging, "host": host},
            decide=not self.finishing,
            stamps=tuple(StepStamp(s.ended_s, s.samples, s.train_s / n, s.wait_s / n, s.consumer)
                         for s in window.stamps),
            lockstep=self.config.sync_every == 1 and not self.config.overlap_averaging)

    def run_verdict(self) -> Verdict:
        """The verdict over the run so far, from every consumer's totals: the live view, the log lines, the summary
        and the report all show this one."""
        if not self.stats.steps_done:
            return Verdict("starting", "no training step finished")
        run = self.ledger.so_far(self.stats)  # after --resume, the parts before this one too
        return with_losses(diagnose(TimeSplit(
            compute=mean(run["compute_fraction"]), input_wait=mean(run["input_stall_fraction"]),
            averaging=mean(run["averaging_fraction"]), sync_every=self.config.sync_every,
            overlapped=self.config.overlap_averaging, host=mean(run["host_fraction"]), compiled=self.config.compile,
            slots=self.config.slots_per_consumer, overlap_allowed=self.overlap_allowed, image_size=self.image_size,
            **self.engine.verdict_fields())), self.membership.losses)

    @functools.cached_property
    def overlap_allowed(self) -> bool:
        """Whether the verdict may advise --overlap-averaging true: the run's other settings may refuse it."""
        return self.config.overlap_averaging or takes(self.config, overlap_averaging=True)

    def _steps_left(self, position: Position) -> int:
        """Global steps from `position` to the end of the run, as the plan stands now."""
        if position.epoch >= self.config.epochs:
            return 0
        rest = self.plan.steps_in(position.epoch) - position.step
        return rest + self.plan.steps_per_epoch * (self.config.epochs - position.epoch - 1)

    @property
    def engine(self) -> Engine:
        return self.driver.engine

    def _show(self, final: bool = False) -> None:
        if not (final or self.view.due()):
            return
        step = self.start_at.global_step + self.stats.steps_done
        position = self.scheduler.position_after(max(step, self.scheduler.start.global_step) - 1)
        epoch = min(self.config.epochs - 1, position.epoch)
        steps_per_epoch = self.plan.steps_in(epoch)
        self.view.update(Snapshot(
            epoch=epoch, epochs=self.config.epochs, epoch_step=min(position.step, steps_per_epoch) if
            position.epoch == epoch else steps_per_epoch, steps_per_epoch=steps_per_epoch, step=step,
            total_steps=position.global_step + self._steps_left(position),
            samples_per_s=(self.ledger.so_far(self.stats)["throughput_samples_per_s"] if final
                           else self.stats.rate(time.monotonic())),
            loss=self.stats.latest_train_loss(),
            val_accuracy=self.val_reports[-1].accuracy if self.val_reports else None,
            consumers=tuple(self.stats.shares()), queue_fill=self.last_queue_fill, producers=self.engine.num_active,
            producer_budget=self.engine.producer_limit(),
            producer_utilization=self.engine.gauges.producer_utilization(),
            verdict=self.run_verdict().text,
            host=tuple(self.stats.host_fractions())))

    # ---- the end ------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Idempotent. Stop event, join with timeout, terminate, then release shared memory."""
        if self.closed:
            return
        self.closed = True
        if hasattr(self, "view"):
            self.view.close()
        self.driver.stop_producers()
        stop_processes(self.consumers, timeout_s=10.0)
        stop_processes(CONTEXT.active_children(), timeout_s=5.0)  # one a signal caught between start and record
        self.consumer_lease.release()
        for channel in self.ready_queues:
            channel.cancel_join_thread()
            channel.close()
        self.driver.close()
        self.checkpoints.close(self.metrics)
        checkpoint.discard_incomplete(self.run_dir)
        if self.local_store is not None:
            self.local_store.close()
        self.agreement = self.store = None

    def summary(self, status: str, error: str | None) -> dict[str, Any]:
        classes = list(self.data.train.classes)
        return run_summary(RunFacts(
            stats=self.stats, ledger=self.ledger, val_reports=self.val_reports, final_digests=self.final_digests,
            gpu_memory=[self.finished[rank].memory for rank in sorted(self.finished)], world=self.cluster.world,
            machines=self.cluster.nodes, devices=self.devices,
            producers=producer_fields(self.driver.engine if self.driver.started else None),
            samples_expected=self.plan.samples_trained_per_epoch, verdict=self.run_verdict().as_json(),
            checkpoint=self.checkpoints.last, run_dir=self.run_dir, classes=classes, ema=bool(self.config.ema),
            image_size=self.image_size, val_image_size=self.val_image_size, start_step=self.start_at.global_step,
            start_epoch=self.start_at.epoch, started=self.started,
            consumers_lost=tuple(loss.as_json() for loss in self.membership.losses),
            consumers_rejoined=tuple(self.membership.rejoined), consumers_left_out=tuple(self.left_out),
            consumers_at_end=None if self.cluster.multi else len(self.membership.members)), status, error)

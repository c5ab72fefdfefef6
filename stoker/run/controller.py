"""The controller: validates, indexes the data, owns the slot ring and the queues, runs the processes, decides
when to fork or retire producers, commits checkpoints and writes the run summary. It never touches pixels or
gradients.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from statistics import mean
from typing import Any

from stoker.common import checkpoint, faults
from stoker.common.checkpoint import Position
from stoker.common.config import RUN_CONFIG_FILE, TrainConfig
from stoker.common.devices import available_cores, resolve_devices, threads_per_consumer
from stoker.common.files import write_json
from stoker.common.procs import (
    CONTEXT,
    POLL_S,
    Mailbox,
    StokerRunError,
    describe_exit,
    name_process,
    start,
    stop_processes,
)
from stoker.data.sources import load_data
from stoker.observe.diagnosis import TimeSplit, Verdict, diagnose
from stoker.observe.evaluation import val_summary
from stoker.observe.metrics import MetricsLog, RunStats, WindowTotals, step_fields, time_shares
from stoker.observe.progress import ProgressView, Snapshot
from stoker.observe.summary import ACCOUNTING_FILE, Ledger, exactly_once_breach
from stoker.pipeline.autoscale import STARTUP_WINDOWS, Autoscaler, Window, default_ceiling, static_budget
from stoker.pipeline.messages import ConsumerFailed, Finish, Finished, Save, Saved, SlotFree, StepReport, ValReport
from stoker.pipeline.plan import EpochPlan
from stoker.pipeline.pool import ProducerPool, check_hang_timeout
from stoker.pipeline.producer import ProducerFailed, ProducerSetup, Task, TaskDone
from stoker.pipeline.ring import RingSpec, SlotRing, check_shm_space, sweep_dead_segments
from stoker.pipeline.scheduler import Issue, Scheduler
from stoker.run import cluster, rundir
from stoker.run.failures import FailureWitness
from stoker.run.lifecycle import Interrupted, Lifecycle
from stoker.training.averager import OuterSpec
from stoker.training.consumer import ConsumerSetup, consumer_main
from stoker.training.init import check_init
from stoker.training.models import check_model
from stoker.training.recipe import recipe_setup
from stoker.training.rendezvous import LOOPBACK, LocalStore, StoreAddress, host_tcp_store

log = logging.getLogger(__name__)

SCALE_WINDOW_S = 1.0
KEEP_CHECKPOINTS = 3


class Controller:
    """`Controller(config)` validates everything and starts nothing; `run()` trains and returns the summary."""

    def __init__(self, config: TrainConfig, show_progress: bool = True) -> None:
        self.config = config
        self.show_progress = show_progress
        self.devices = resolve_devices(config.devices)
        self.num_consumers = len(self.devices)  # on this machine
        self.cluster = cluster.from_environment(self.num_consumers)
        self.data = load_data(config)
        self.image_size = config.resolved_image_size
        if config.batch_size > len(self.data.train):
            raise ValueError(f"batch_size={config.batch_size} is larger than the training set "
                             f"({len(self.data.train)} images)")
        self.plan = EpochPlan(len(self.data.train), len(self.data.val or ()), config.batch_size,
                              self.cluster.world, config.seed)
        self.num_slots = config.slots_per_consumer * self.num_consumers
        self.static_budget = static_budget(self.devices, available_cores())  # what fits the free cores
        # The most producers this run may have at once: the ring has a status row for each.
        self.budget = config.producers if config.producers != "auto" else (
            config.max_producers or default_ceiling(max(self.static_budget, config.min_producers), available_cores()))
        self._ring_bytes_check()
        check_hang_timeout(config.producer_timeout_s, config.collective_timeout_s, self.cluster.world)
        check_model(config.model, len(self.data.train.classes), self.image_size)
        if config.init is not None and config.resume is None:
            check_init(config.init, config.model, len(self.data.train.classes))
        self.recipe = recipe_setup(config, len(self.data.train.classes), self.plan.steps_per_epoch,
                                   config.resume is not None)
        self.run_dir = Path(config.out or config.resume or rundir.default_run_dir())
        if config.resume is None:
            rundir.check_new_run_dir(self.run_dir)
        cluster.join_controllers(self.cluster, config.collective_timeout_s)
        cluster.check_same_settings(self.cluster, self._shared_settings())
        self.start_at, self.resume_from = self._resume_point()
        self._reset_state()

    def _shared_settings(self) -> dict[str, Any]:
        """What every machine must agree on (paths and producer counts are each machine's own business)."""
        local = {"out", "resume", "data", "val", "devices", "producers", "min_producers", "initial_producers",
                 "max_producers", "log_every_s", "report", "tensorboard"}
        return {**{k: v for k, v in self.config.as_json().items() if k not in local},
                "consumers_per_machine": self.num_consumers, "train_files": len(self.data.train),
                "val_files": len(self.data.val or ()), "classes": list(self.data.train.classes)}

    def _resume_point(self) -> tuple[Position, Path | None]:
        """The first machine finds the newest valid checkpoint; every machine continues from it."""
        if self.config.resume is None:
            return Position(0, 0, 0), None
        found = None
        if self.cluster.leader:
            try:
                folder, meta = rundir.newest_checkpoint(self.config.resume)
                found = (str(folder), meta["position"], meta["num_consumers"], None)
            except rundir.RunDirError as error:
                found = (None, None, None, str(error))
        folder, position, consumers, error = cluster.from_leader(self.cluster, found)
        if error is not None:
            raise rundir.RunDirError(error)
        if consumers != self.cluster.world:
            raise ValueError(f"resume={str(self.config.resume)!r}: the checkpoint has {consumers} consumers, this "
                             f"run {self.cluster.world}; resume with the same machines and devices")
        return Position(**position), Path(folder)

    def _ring_bytes_check(self) -> None:
        spec = RingSpec("check", self.num_slots, self.config.batch_size, self.image_size, self.budget)
        check_shm_space(spec.nbytes)

    def _reset_state(self) -> None:
        self.ring: SlotRing | None = None
        self.pool: ProducerPool | None = None
        self.consumers: list = []
        self.ready_queues: list = []
        self.store = None
        self.local_store: LocalStore | None = None
        self.agreement: cluster.StopAgreement | None = None  # several machines: where all stop when one is told to
        self.stop = CONTEXT.Event()
        self.mailbox = Mailbox()
        self.witness = FailureWitness(self.consumers, self.mailbox, self.config.collective_timeout_s)
        self.stats = RunStats(self.num_consumers, self.plan.samples_per_epoch, self.plan.steps_per_epoch,
                              self.cluster.first_rank)
        for item in self.data.refused:
            self.stats.skipped.setdefault(item.path, item.reason)
        self.ledger = Ledger(self.plan.steps_per_epoch)  # the parts of the run before this one
        if self.resume_from is not None:
            self.ledger.resume(self.resume_from, self.run_dir, self.stats)
        self.tasks: dict[int, Issue] = {}
        self.task_ids = iter(range(1 << 62))
        self.slot_owner: dict[int, int] = {}
        self.delivered = [0] * self.num_consumers  # batches handed over and not yet taken, per consumer
        self.pending_saves: dict[int, dict[int, dict[str, str]]] = {}
        self.last_checkpoint: Path | None = None
        self.commits = checkpoint.BackgroundCommits()
        self.commit_failure: str | None = None  # a commit that failed while closing
        self.finished: dict[int, Finished] = {}
        self.final_digests: dict[int, str] = {}  # global rank -> the replica's hash at the end, every machine
        self.val_reports: list[ValReport] = []
        self.producers_initial = 0
        self.timeline: list[dict[str, Any]] = []
        self.autoscaler: Autoscaler | None = None
        self.producer_busy = (0.0, 0.0)  # (busy producer-seconds per producer, seconds): utilization over the run
        self.split: TimeSplit | None = None  # the latest window's, for the autoscaler and `pipeline` events
        self.last_queue_fill = 0.0
        self.lifecycle = Lifecycle()  # what a signal means now; `lifecycle.interrupted`: one arrived here
        self.stopping = False  # stopping early: this machine or another one was interrupted
        self.finishing = False
        self.closed = False

    # ---- the run -----------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        with self.lifecycle.handling_signals():
            return self._run()

    def _run(self) -> dict[str, Any]:
        name_process("stoker controller")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_json(self.run_dir / RUN_CONFIG_FILE, self.config.as_json())  # every machine: `--resume` reads it
        metrics_file = "metrics.jsonl" if self.cluster.leader else f"metrics-node{self.cluster.node}.jsonl"
        self.metrics = MetricsLog(self.run_dir / metrics_file,
                                  self.run_dir / "tensorboard" if self.config.tensorboard else None,
                                  append=self.config.resume is not None)
        self.started = time.monotonic()
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
        if self.commit_failure and status != "failed":
            status, error = "failed", self.commit_failure
        if self.cluster.multi and status != "failed" and not forced:
            error = self._gather_machines()
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

    def _gather_machines(self) -> str | None:
        """Bring every machine's accounting to the first one: exactly-once is checked over the union. Returns
        an error when a machine could not report."""
        try:
            parts = cluster.gather_to_leader(self.cluster, (self.stats.export(), self.final_digests))
            for stats, digests in (parts or [])[1:]:
                self.stats.merge(stats)
                self.final_digests.update(digests)
        except RuntimeError as error:  # a machine stopped before the end: its peers' collective says so
            log.error("could not gather the other machines' accounting: %s", error)
            return f"a machine stopped before reporting its accounting ({error})"
        except (ValueError, TypeError, KeyError) as error:  # a machine sent accounting of another shape
            log.error("another machine's accounting could not be merged: %s", error)
            return f"a machine sent accounting that could not be merged ({type(error).__name__}: {error})"
        return None

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
        sweep_dead_segments()
        self.ring = SlotRing.create(self.num_slots, self.config.batch_size, self.image_size, self.budget)
        self.scheduler = Scheduler(self.plan, self.config.epochs, self.start_at, self.num_slots,
                                   self.data.val is not None, self.config.checkpoint_every, self.run_dir,
                                   self.cluster.first_rank, self.num_consumers)
        self.pool = ProducerPool(self._producer_setup(), self.ring, self.mailbox, self.stop, self.budget,
                                 self.config.producer_timeout_s)
        initial = self.budget if self.config.producers != "auto" else min(
            self.config.initial_producers or self.config.min_producers, self.budget)
        for _ in range(initial):
            self.pool.grow()
        self.producers_initial = initial
        self._record_producers("start")
        auto = self.config.producers == "auto"
        self.autoscaler = Autoscaler(self.config.min_producers, min(self.static_budget, self.budget),
                                     self.budget, STARTUP_WINDOWS) if auto else None
        self._start_consumers()
        faults.maybe_inject("controller", "consumers started")
        self.metrics.write("start", devices=self.devices, producers=initial, config=self.config.as_json(),
                           resume_from=self.resume_from)

    def _producer_setup(self) -> ProducerSetup:
        # The indexes pickle as the folder of their packed entry: every producer maps the same read-only files.
        return ProducerSetup(self.ring.spec, self.data.train, self.data.val, self.config.augment, self.config.seed)

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
        config = self.config
        threads = threads_per_consumer(self.devices)
        outer = None if config.outer_optimizer == "none" else OuterSpec(config.outer_optimizer, config.outer_lr,
                                                                         config.outer_momentum)
        for rank, device in enumerate(self.devices):
            setup = ConsumerSetup(
                rank=self.cluster.first_rank + rank, local_rank=rank, world_size=self.cluster.world, device=device,
                store=store, ring=self.ring.spec, model=config.model,
                num_classes=len(self.data.train.classes), optimizer=config.optimizer, lr=config.lr,
                schedule=config.schedule, total_steps=self.plan.steps_per_epoch * config.epochs,
                momentum=config.momentum, weight_decay=config.weight_decay, sync_every=config.sync_every,
                outer=outer, overlap_averaging=config.overlap_averaging,
                average_in_backward=config.average_in_backward, seed=config.seed, num_threads=threads,
                collective_timeout_s=config.collective_timeout_s, check_replicas_every=config.check_replicas_every,
                resume_from=self.resume_from, precision=config.precision, channels_last=config.channels_last,
                compile=config.compile, deterministic=config.deterministic, recipe=self.recipe)
            ready = CONTEXT.Queue()
            self.ready_queues.append(ready)
            outbox = self.mailbox.open()
            self.consumers.append(start(consumer_main, (setup, ready, outbox, self.stop), f"stoker consumer {rank}"))
            outbox.close()

    def _loop(self) -> None:
        window_started = time.monotonic()
        window = WindowTotals()
        while len(self.finished) < self.num_consumers:
            self._follow_interrupts()
            self._dispatch()
            self._deliver(window)
            self._handle_messages(window)
            self._check_processes()
            self._record_commits()
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
                self.scheduler.cut()
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

    def _dispatch(self) -> None:
        while self.pool.can_take():
            issued = self.scheduler.issue_one()
            if issued is None:
                break
            self._assign(issued)

    def _assign(self, issued: Issue, skip: dict[int, str] | None = None) -> None:
        task = Task(next(self.task_ids), issued.work, issued.slot, skip or {})
        self.tasks[task.task_id] = issued
        self.slot_owner[issued.slot] = issued.rank
        if issued.work.kind == "train":
            self.stats.expect(issued.work.epoch, issued.work.sample_ids)
        self.pool.assign(task)

    def _deliver(self, window: WindowTotals) -> None:
        for rank, message in self.scheduler.deliverable():
            if getattr(message, "slot", None) is not None:
                self.delivered[rank] += 1
            self.ready_queues[rank].put(message)
        waiting = self.agreement is not None and self.agreement.waiting
        if not self.finishing and not waiting and self.scheduler.exhausted():
            self._finish()
        window.queue_samples += 1
        window.queue_fill += sum(self.delivered) / max(1, self.num_slots)

    def _finish(self) -> None:
        """Every consumer got its last batch: save where an interrupt stopped us, then write the final model."""
        self.finishing = True
        position = self.scheduler.position
        if self.stopping and position.global_step not in self.scheduler.saves_issued:
            folder = checkpoint.checkpoint_dir(self.run_dir, position.global_step, temporary=True)
            for ready in self.ready_queues:
                ready.put(Save(folder, position.global_step))
            self.pending_saves[position.global_step] = {}
        for ready in self.ready_queues:
            ready.put(Finish(self.run_dir / "model.pt"))

    def _handle_messages(self, window: WindowTotals) -> None:
        for message in self.mailbox.receive(timeout_s=POLL_S):
            self._handle(message, window)

    def _handle(self, message: Any, window: WindowTotals) -> None:
        now = time.monotonic()
        if isinstance(message, SlotFree):
            self.delivered[self.slot_owner[message.slot]] -= 1
            self.scheduler.release(message.slot, self.slot_owner.pop(message.slot))
        elif isinstance(message, TaskDone):
            self._task_done(message)
        elif isinstance(message, StepReport):
            self.stats.record_step(message, now)
            self.ledger.record_step(message)
            window.add(message)
            self.metrics.write("step", **step_fields(message, self.cluster.first_rank))
            if message.digest is not None:
                self._compare_replicas(message)
        elif isinstance(message, ValReport):
            self.val_reports.append(message)
            self.metrics.write("val", epoch=message.epoch, loss=message.loss, accuracy=message.accuracy,
                               count=message.count, top5=message.top5, ema=message.ema)
            log.info("epoch %d: val accuracy %.2f%% loss %.4f", message.epoch + 1, 100 * message.accuracy,
                     message.loss)
        elif isinstance(message, Saved):
            self._saved(message)
        elif isinstance(message, Finished):
            self.finished[message.rank] = message
            self.final_digests[self.cluster.first_rank + message.rank] = message.digest
        elif isinstance(message, ConsumerFailed):
            causes = self.witness.causes(message)
            if not causes and self.cluster.multi:
                causes = ["a consumer on another machine may have stopped first (see that machine's log)"]
            raise StokerRunError("; ".join([*causes, str(message.error)]) + f"\n{message.error.trace}")
        elif isinstance(message, ProducerFailed):
            raise StokerRunError(f"{message.error}\n{message.error.trace}")

    def _compare_replicas(self, report: StepReport) -> None:
        identical = self.stats.record_digest(report)
        if identical is not None:
            self.metrics.write("replica_check", global_step=report.global_step, identical=identical)
            if not identical:
                log.error("replicas differ after the averaging of step %d", report.global_step)

    def _task_done(self, done: TaskDone) -> None:
        task = self.pool.finished(done)
        if task is None:
            return
        issued = self.tasks.pop(done.task_id)
        if done.skipped:
            epoch = issued.work.epoch if issued.work.kind == "train" else None
            self.stats.record_skipped(epoch, done.skipped)
            for item in done.skipped.values():
                log.warning("skipped %s: %s", item.path, item.reason)
                self.metrics.write("skipped", path=item.path, reason=item.reason)
            self._check_bad_fraction()
        self.scheduler.complete(issued)

    def _check_bad_fraction(self) -> None:
        bad = len(self.stats.skipped)
        total = len(self.data.train) + len(self.data.val or ())
        if bad > self.config.max_bad_fraction * total:
            raise StokerRunError(f"{bad} of {total} files are unusable, more than max_bad_fraction="
                                 f"{self.config.max_bad_fraction}; see skipped_files in summary.json")

    def _saved(self, message: Saved) -> None:
        parts = self.pending_saves.setdefault(message.global_step, {})
        parts[message.rank] = message.files
        if len(parts) < self.num_consumers:
            return
        del self.pending_saves[message.global_step]
        self.ledger.checkpointed(message.global_step)
        if not self.cluster.leader:
            return  # the first machine's rank 0 wrote every replica's state
        files = {name: digest for rank_files in parts.values() for name, digest in rank_files.items()}
        steps = self.plan.steps_per_epoch
        position = Position(message.global_step // steps, message.global_step % steps, message.global_step)
        meta = {"position": position.__dict__, "files": files, "num_consumers": self.cluster.world,
                "config": self.config.as_json(), "classes": list(self.data.train.classes)}
        final = checkpoint.checkpoint_dir(self.run_dir, message.global_step)
        temporary = checkpoint.checkpoint_dir(self.run_dir, message.global_step, temporary=True)
        extra = {}
        if not self.cluster.multi:  # several machines: the others' accounting reaches this one only at the end
            extra[ACCOUNTING_FILE] = self.ledger.snapshot(self.stats, message.global_step)
        self.commits.submit(temporary, final, meta, extra, KEEP_CHECKPOINTS)

    def _finish_commits(self) -> None:
        try:
            self._record_commits(wait=True)
        except OSError as error:
            log.error("could not commit the last checkpoint: %s", error)
            self.commit_failure = str(error)
        self.commits.close()

    def _record_commits(self, wait: bool = False) -> None:
        for final in self.commits.committed(wait):
            self.last_checkpoint = final
            self.metrics.write("checkpoint", path=final, step=checkpoint.step_of(final))

    def _check_processes(self) -> None:
        for rank, process in enumerate(self.consumers):
            if not process.is_alive() and rank not in self.finished:
                self._read_last_messages(rank)
                if rank in self.finished:
                    continue
                self.witness.log_reported_failures()
                raise StokerRunError(f"consumer {rank} (pid {process.pid}) {describe_exit(process)}")
        for loss in self.pool.check():
            log.warning("%s; starting a replacement and re-issuing its %d batch(es)", loss.message,
                        len(loss.reissue))
            self.metrics.write("producer_lost", message=loss.message, reissued=len(loss.reissue))
            self.pool.grow()
            for task in loss.reissue:
                issued = self.tasks.get(task.task_id)
                if issued is not None:
                    del self.tasks[task.task_id]
                    self._assign(issued, task.skip)

    def _read_last_messages(self, rank: int) -> None:
        """A consumer that finished sends Saved and Finished and exits at once: they may still be in its pipe."""
        while rank not in self.finished and (messages := self.mailbox.receive(timeout_s=POLL_S)):
            for message in messages:
                self._handle(message, WindowTotals())

    def _close_window(self, window: WindowTotals, elapsed_s: float) -> None:
        """Every SCALE_WINDOW_S: record the pipeline's state and let the autoscaler decide."""
        consumer_time = max(1e-9, elapsed_s * self.num_consumers)
        utilization = min(1.0, self.pool.take_utilization(elapsed_s))  # a task counts in the window it ends in
        self.producer_busy = (self.producer_busy[0] + utilization * elapsed_s, self.producer_busy[1] + elapsed_s)
        queue_fill = window.queue_fill / max(1, window.queue_samples)
        self.last_queue_fill = queue_fill
        compute, wait, averaging = time_shares(window.compute_s, window.wait_s, window.averaging_s, consumer_time)
        self.split = TimeSplit(compute=compute, input_wait=wait, averaging=averaging, producers=len(self.pool.active),
                               producer_budget=self._producer_limit(), producer_utilization=utilization,
                               sync_every=self.config.sync_every, overlapped=self.config.overlap_averaging)
        self.metrics.write("pipeline", samples_per_s=round(window.samples / elapsed_s, 2),
                           queue_fill=round(queue_fill, 4), producers=self.split.producers,
                           producer_utilization=round(utilization, 4), compute=round(self.split.compute, 4),
                           input_wait=round(self.split.input_wait, 4), averaging=round(self.split.averaging, 4))
        if self.autoscaler is None or window.steps == 0 or self.finishing:
            return
        decision = self.autoscaler.decide(Window(
            stall=self.split.input_wait, queue_fill=queue_fill, utilization=utilization,
            producers=self.split.producers, samples=window.samples, steps=window.steps,
            train_s=(window.wait_s + window.compute_s + window.averaging_s) / self.num_consumers))
        self.metrics.write("autoscale", change=decision.change, reason=decision.reason, **decision.measurement)
        if decision.change > 0 and self.pool.grow() is None:
            self.autoscaler.fork_refused()
            self.metrics.write("autoscale", change=0, reason="no free producer row yet (one is retiring): "
                                                              "asking again next window")
            return
        if decision.change < 0:
            self.pool.shrink(newest=decision.retire_newest)
        if decision.change:
            self._record_producers(decision.reason, decision.measurement)

    def run_verdict(self) -> Verdict:
        """The verdict over the run so far, from every consumer's totals: the live view, the log lines, the summary
        and the report all show this one."""
        if not self.stats.consumers[0].steps:
            return Verdict("starting", "no training step finished")
        return diagnose(TimeSplit(
            compute=mean(self.stats.compute_fractions()), input_wait=mean(self.stats.stall_fractions()),
            averaging=mean(self.stats.averaging_fractions()), producers=self.pool.max_alive if self.pool else 0,
            producer_budget=self._producer_limit(), producer_utilization=self._producer_utilization(),
            sync_every=self.config.sync_every, overlapped=self.config.overlap_averaging))

    def _producer_utilization(self) -> float:
        busy, seconds = self.producer_busy
        return busy / seconds if seconds else 0.0

    def _producer_limit(self) -> int:
        """The count the producers are held to now: fixed, the ceiling, or the most that paid."""
        return self.autoscaler.limit if self.autoscaler is not None else self.budget

    def _record_producers(self, reason: str, measurement: dict[str, Any] | None = None) -> None:
        count = len(self.pool.active)
        behind = {"measurement": measurement} if measurement else {}
        self.timeline.append({"t": round(time.monotonic() - self.started, 3), "producers": count, "reason": reason,
                              **behind})
        self.metrics.write("producers", count=count, reason=reason, **behind)

    def _show(self, final: bool = False) -> None:
        if not (final or self.view.due()):
            return
        steps_per_epoch = self.plan.steps_per_epoch
        step = self.start_at.global_step + self.stats.consumers[0].steps
        epoch = min(self.config.epochs - 1, step // steps_per_epoch)
        self.view.update(Snapshot(
            epoch=epoch, epochs=self.config.epochs, epoch_step=step - epoch * steps_per_epoch,
            steps_per_epoch=steps_per_epoch, step=step, total_steps=steps_per_epoch * self.config.epochs,
            samples_per_s=self.stats.throughput() if final else self.stats.rate(time.monotonic()),
            loss=self.stats.train_loss(max(self.stats.epochs, default=0)),
            val_accuracy=self.val_reports[-1].accuracy if self.val_reports else None,
            consumers=tuple(self.stats.shares()),
            queue_fill=self.last_queue_fill, producers=len(self.pool.active), producer_budget=self._producer_limit(),
            producer_utilization=self._producer_utilization(), verdict=self.run_verdict().text))

    # ---- the end ------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Idempotent. Stop event, join with timeout, terminate, then release shared memory."""
        if self.closed:
            return
        self.closed = True
        if hasattr(self, "view"):
            self.view.close()
        self.stop.set()
        if self.pool is not None:
            self.pool.close()
        stop_processes(self.consumers, timeout_s=10.0)
        stop_processes(CONTEXT.active_children(), timeout_s=5.0)  # one a signal caught between start and record
        for channel in self.ready_queues:
            channel.cancel_join_thread()
            channel.close()
        self.mailbox.close()
        if self.ring is not None:
            self.ring.close()
        self._finish_commits()
        checkpoint.discard_incomplete(self.run_dir)
        if self.local_store is not None:
            self.local_store.close()
        self.agreement = self.store = None

    def summary(self, status: str, error: str | None) -> dict[str, Any]:
        last_epoch = max(self.stats.epochs, default=None)
        last_val = self.val_reports[-1] if self.val_reports else None
        digests = self.final_digests
        summary = {
            "status": status,
            **({"error": error} if error else {}),
            "epochs": len(self.stats.completed_epochs),
            "steps": self.stats.consumers[0].steps,
            "num_consumers": self.cluster.world,
            "machines": self.cluster.nodes,
            "devices": self.devices,
            "gpu_memory": [self.finished[rank].memory for rank in sorted(self.finished)],
            "producers_initial": self.producers_initial,
            "producers_final": self.timeline[-1]["producers"] if self.timeline else 0,
            "producers_max": self.pool.max_alive if self.pool else 0,
            "producers_timeline": self.timeline,
            "samples_expected": self.plan.samples_per_epoch,
            "samples_consumed": [a.consumed() for _, a in sorted(self.stats.epochs.items())],
            **self.stats.accounting(),
            "epoch_accounting": self.stats.epoch_accounting(),
            "skipped_files": [{"path": p, "reason": r} for p, r in self.stats.skipped.items()],
            "input_stall_fraction": self.stats.stall_fractions(),
            "averaging_fraction": self.stats.averaging_fractions(),
            "compute_fraction": self.stats.compute_fractions(),
            "verdict": self.run_verdict().as_json(),
            "throughput_samples_per_s": round(self.stats.throughput(), 2),
            "val_accuracy": last_val.accuracy if last_val else None,
            "val_loss": last_val.loss if last_val else None,
            "train_loss": self.stats.train_loss(last_epoch) if last_epoch is not None else None,
            "replicas_identical": bool(digests) and len(digests) == self.cluster.world
                                  and self.stats.replicas_identical(digests),
            "replica_mismatch_steps": self.stats.mismatched_steps(),
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "model": str(self.run_dir / "model.pt") if status == "completed" else None,
            **val_summary(last_val, list(self.data.train.classes)),
            "model_ema": str(self.run_dir / "model_ema.pt") if status == "completed" and self.config.ema else None,
            "classes": list(self.data.train.classes),
            "start_step": self.start_at.global_step,
            "wall_s": round(time.monotonic() - self.started, 3),
        }
        return self.ledger.whole_run(summary, self.stats, self.start_at.global_step)

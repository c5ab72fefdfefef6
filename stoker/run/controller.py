"""The controller: runs the loop of `stoker train` (pump the engine, deliver batches, route the consumers'
messages, close the scaling window, show progress) over what `prestart.prepare` checked and planned, with the
consumers' comings and goings left to `consumer_group.py` and checkpoints to `checkpoints.py`; it writes the run
summary. It never touches pixels or gradients.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from stoker.common import faults
from stoker.common.config import TrainConfig
from stoker.common.positions import Position
from stoker.common.procs import POLL_S, StokerRunError, name_process
from stoker.observe.diagnosis import Verdict, divergence
from stoker.observe.evaluation import val_line
from stoker.observe.metrics import RunStats, step_fields
from stoker.observe.progress import ProgressView, Snapshot
from stoker.observe.summary import Ledger
from stoker.pipeline.driver import EngineDriver, Measure
from stoker.pipeline.messages import Finish, Finished, Save, Saved, SlotFree, StepReport, ValReport
from stoker.pipeline.scheduler import Scheduler, Unfinished
from stoker.run import outcome, prestart
from stoker.run.checkpoints import Checkpoints
from stoker.run.consumer_group import ConsumerGroup
from stoker.run.lifecycle import Interrupted, Lifecycle

log = logging.getLogger(__name__)


class Controller:
    """`Controller(config)` validates everything and starts nothing; `run()` trains and returns the summary."""

    def __init__(self, config: TrainConfig, show_progress: bool = True) -> None:
        faults.maybe_inject("controller", "starting up")
        self.prepared = prepared = prestart.prepare(config)
        self.config = prepared.config  # `resume` set where torchrun started this job again
        self.show_progress = show_progress
        self.devices, self.num_consumers = prepared.devices, prepared.num_consumers
        self.cluster, self.data, self.plan = prepared.cluster, prepared.data, prepared.plan
        self.run_dir, self.run_lock = prepared.run_dir, prepared.run_lock
        self.start_at, self.resume_from = prepared.resumed.start_at, prepared.resumed.folder
        self.image_size, self.val_image_size = config.resolved_image_size, config.resolved_val_image_size
        try:
            self._reset_state()
        except BaseException:
            self.run_lock.close()
            raise

    def _reset_state(self) -> None:
        prepared = self.prepared
        # The ring, the producers and the order of work, started with the run; the consumers' steps judged in
        # lockstep where they average every step.
        self.driver = EngineDriver(prepared.engine, Measure(self.num_consumers, lockstep=self.config.sync_every == 1
                                                            and not self.config.overlap_averaging))
        self.group = ConsumerGroup(prepared, self.driver.mailbox, self.driver.stop, self._read_last_messages)
        self.stats = RunStats(self.num_consumers, self.plan.samples_per_epoch, self.plan.steps_per_epoch,
                              self.cluster.first_rank)
        for item in self.data.refused:
            self.stats.skipped.setdefault(item.path, item.reason)
        self.ledger = Ledger()  # the parts of the run before this one
        if self.resume_from is not None:  # the folder other machines receive is never opened there
            self.ledger.resume(prepared.resumed.accounting, self.run_dir, self.stats)
        self.checkpoints = Checkpoints(self.run_dir, self.config, self.cluster, self.num_consumers,
                                       list(self.data.train.classes), prepared.sample_counts(), self.ledger)
        self.checkpoints.reference_consumers = self.plan.reference.num_consumers
        self.finished: dict[int, Finished] = {}
        self.final_digests: dict[int, str] = {}  # global rank -> the replica's hash at the end, every machine
        self.val_reports: list[ValReport] = []
        self.lifecycle = Lifecycle()  # what a signal means now; `lifecycle.interrupted`: one arrived here
        self.stopping = False  # stopping early: this machine or another one was interrupted
        self.finishing = False
        self.closed = False

    # What the consumer group asks of the run (`consumer_group.RunState`).
    @property
    def trained(self) -> bool:
        return bool(self.stats.steps_done)

    @property
    def closing(self) -> bool:
        return self.stopping or self.finishing

    @property
    def saving(self) -> bool:
        return bool(self.checkpoints.pending)

    # ---- the run -----------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        try:
            with self.lifecycle.handling_signals():
                return self._run()
        finally:
            self.run_lock.close()

    def _run(self) -> dict[str, Any]:
        name_process("stoker controller")
        self.metrics = self.prepared.open_folder()
        self.started = self.group.membership.started = time.monotonic()
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
        status, error = outcome.final_status(status, error, forced, self.checkpoints.failure, self.cluster, self.stats,
                                             self.final_digests)
        summary = self.summary(status, error)
        outcome.conclude(summary, self.metrics, self.run_dir, self.cluster.leader)
        if self.cluster.leader and self.config.report:
            with self.lifecycle.reporting():
                outcome.draw_report(self.run_dir)
        return summary

    def _start(self) -> None:
        # First: children started after it write their warnings above the live panel, not through it.
        self.view = ProgressView(self.plan.steps_per_epoch * self.config.epochs, self.plan.steps_per_epoch,
                                 self.config.log_every_s, self.show_progress)
        config = self.config
        self.scheduler = Scheduler(self.plan, config.epochs, self.start_at, self.prepared.num_slots,
                                   self.data.val is not None, config.checkpoint_every, self.run_dir,
                                   self.cluster.first_rank, self.num_consumers)
        self.group.prepare()  # first: the consumers' zygote imports while the producers start
        self.driver.start(self.stats, self.metrics, self.scheduler)
        self.group.start(self.driver.ring_spec, self.plan.reference, self.metrics)
        faults.maybe_inject("controller", "consumers started")
        self.metrics.write("start", devices=self.devices, producers=self.prepared.engine.counts.initial,
                           config=config.as_json(), resume_from=self.resume_from, global_batch=self.plan.per_step,
                           lr=config.lr * self.plan.lr_scale)

    def _loop(self) -> None:
        self.driver.open_window(time.monotonic())
        while not all(consumer in self.finished for consumer in self.group.members):
            self._follow_interrupts()
            regrouping = self.group.membership.regrouping  # nothing new is built or handed over meanwhile
            if not regrouping:
                self.driver.dispatch()
                self._deliver()
            for message in self.driver.pump(POLL_S, dispatch=not regrouping):  # the producers' go to the engine
                self._handle(message)
            if self.group.tick(time.monotonic(), self):
                self._regroup()
            self.group.check_deadline(self.finished)
            self.checkpoints.record_commits(self.metrics)
            self.driver.tick(time.monotonic(), decide=not self.finishing)  # every SCALE_WINDOW_S
            self._show()

    def _follow_interrupts(self) -> None:
        """An interrupt stops every consumer after the same row of work: on one machine the furthest row started;
        on several, the furthest row any machine started once it heard of the interrupt (`StopAgreement`)."""
        agreement = self.group.agreement  # several machines: where all stop when one is told to
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

    def _deliver(self) -> None:
        for rank, message in self.driver.deliverable():
            self.group.send(rank, message)
            if isinstance(message, Save):
                self.checkpoints.expect(message.position)
            if faults.armed() and getattr(message, "kind", None) == "val":
                faults.maybe_inject("controller", f"val batch {message.step} of epoch {message.epoch} handed over")
        waiting = self.group.agreement is not None and self.group.agreement.waiting
        if not self.finishing and not waiting and self.scheduler.exhausted():
            self._finish()
        self.driver.note_queue()

    def _finish(self) -> None:
        """Every consumer got its last batch: save where an interrupt stopped us, then write the final model."""
        self.finishing = True
        position = self.scheduler.position
        if self.stopping and position.global_step not in self.scheduler.saves_issued:
            folder = self.checkpoints.folder(position.global_step)
            self.group.send_all(Save(folder, position.global_step, position))
            self.checkpoints.expect(position)
        self.group.send_all(Finish(self.run_dir / "model.pt"))

    def _handle(self, message: Any, counted: bool = True) -> None:
        """`counted`: its steps count in the scaling window (not those read while a regroup drains)."""
        now = time.monotonic()
        if isinstance(message, SlotFree):
            if self.group.membership.slot_counts(message.generation):
                self.driver.release(message.slot)
        elif isinstance(message, StepReport):
            if self.group.membership.counts(message):
                self._record_step(message, now, counted)
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
        else:
            self.group.handle(message, self)

    def _record_step(self, message: StepReport, now: float, counted: bool) -> None:
        self.stats.record_step(message, now)
        self.ledger.record_step(message)
        if counted:
            self.driver.note_step(message)
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

    def _regroup(self) -> None:
        """Every survivor left the broken group: go back to the state they all hold, plan the rest of the run
        for them from there, and send each its place in the new group."""
        group, old = self.group, self.scheduler
        agreed, taken_back = group.take_back(self.finished)
        for report in taken_back:
            self.stats.retract(report)
        for global_step in [step for step in self.stats.digests if step > agreed]:
            del self.stats.digests[global_step]  # trained again: its replicas are compared again
        self.ledger.take_back(agreed)
        group.credit_lost_steps(old, agreed, self.stats, self.ledger)
        self.driver.drain(lambda message: self._handle(message, counted=False))
        position = old.position_after(agreed)
        consumers = len(group.members)
        self.plan = self.plan.regrouped(consumers, position.epoch, position.step, position.offset or 0)
        self.checkpoints.regroup(consumers, agreed, self.stats)
        self.scheduler = Scheduler(self.plan, self.config.epochs, position, self.prepared.num_slots,
                                   self.data.val is not None, self.config.checkpoint_every, self.run_dir,
                                   self.cluster.first_rank, consumers, self._unfinished(position))
        if self.stopping:
            self.scheduler.cut(-1)  # interrupted meanwhile: only the checkpoint where the survivors stand
        self.driver.follow(self.scheduler)
        self.stats.members = consumers
        group.regrouped(agreed, taken_back, position.epoch, position.offset)
        self.finishing = False

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
                self._handle(message, counted=False)

    def run_verdict(self) -> Verdict:
        """The verdict over the run so far (`outcome.run_verdict`)."""
        return outcome.run_verdict(self.stats, self.ledger, self.config, self.prepared.overlap_allowed,
                                   self.driver.verdict_fields(), self.group.membership.deaths)

    def _steps_left(self, position: Position) -> int:
        """Global steps from `position` to the end of the run, as the plan stands now."""
        if position.epoch >= self.config.epochs:
            return 0
        rest = self.plan.steps_in(position.epoch) - position.step
        return rest + self.plan.steps_per_epoch * (self.config.epochs - position.epoch - 1)

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
            consumers=tuple(self.stats.shares()), queue_fill=self.driver.last_queue_fill,
            producers=self.driver.num_active, producer_budget=self.driver.producer_limit(),
            producer_utilization=self.driver.producer_utilization(),
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
        self.group.close()
        self.driver.close()
        self.checkpoints.close(self.metrics)
        self.group.close_store()

    def summary(self, status: str, error: str | None) -> dict[str, Any]:
        classes = list(self.data.train.classes)
        return outcome.run_summary(outcome.RunFacts(
            stats=self.stats, ledger=self.ledger, val_reports=self.val_reports, final_digests=self.final_digests,
            gpu_memory=[self.finished[rank].memory for rank in sorted(self.finished)], world=self.cluster.world,
            machines=self.cluster.nodes, devices=self.devices,
            producers=self.driver.producer_fields(),
            samples_expected=self.plan.samples_trained_per_epoch, verdict=self.run_verdict().as_json(),
            checkpoint=self.checkpoints.last, run_dir=self.run_dir, classes=classes, ema=bool(self.config.ema),
            image_size=self.image_size, val_image_size=self.val_image_size, start_step=self.start_at.global_step,
            start_epoch=self.start_at.epoch, started=self.started,
            consumers_lost=tuple(death.as_json() for death in self.group.membership.deaths),
            consumers_rejoined=tuple(self.group.membership.rejoined), consumers_left_out=tuple(self.group.left_out),
            consumers_at_end=None if self.cluster.multi else len(self.group.membership.members)), status, error)

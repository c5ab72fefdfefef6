"""This machine's consumers coming and going: their processes and ready queues, the store their group forms
through, a death (the run fails, or the others go on: `membership.py`), a restart after a back-off, a restarted
consumer joining at the next regroup, the stuck consumer killed, and the regroup's messages. The controller's loop
calls `tick` with the time on every pass and `handle` with each consumer message that is about membership; what a
regroup changes in the plan and the books stays the controller's.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from stoker.common import zygote
from stoker.common.config import ModelSettings, TrainConfig
from stoker.common.procs import CONTEXT, Mailbox, StokerRunError, describe_exit, start, stop_processes
from stoker.observe.metrics import MetricsLog, RunStats
from stoker.observe.summary import Ledger
from stoker.pipeline.messages import ConsumerFailed, StartupPhase, StepReport
from stoker.pipeline.plan import EpochPlan
from stoker.pipeline.ring import RingSpec
from stoker.pipeline.scheduler import Scheduler
from stoker.run import cluster
from stoker.run.failures import FailureWitness
from stoker.run.membership import Membership
from stoker.run.prestart import RunPlan
from stoker.run.setups import consumer_setups
from stoker.run.startup_watch import StartupTimeout, StartupWatch
from stoker.training.consumer import ConsumerSetup, consumer_main
from stoker.training.memory_share import fixed_share_note
from stoker.training.recovery import Joining, Regroup, Stranded
from stoker.training.rendezvous import LOOPBACK, LocalStore, StoreAddress, host_tcp_store, sweep_dead_stores

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = 1.0  # before a dead consumer's first start again; doubled for each next one


class RunState(Protocol):
    """What the group asks of the run, read at the moment it decides (a message read on the way may change it)."""

    finished: dict[int, Any]  # local consumer -> its Finished

    @property
    def trained(self) -> bool:
        """A step was reported: a death before it is a failed start."""

    @property
    def closing(self) -> bool:
        """The run is stopping or finishing: it takes no consumer back."""

    @property
    def saving(self) -> bool:
        """A checkpoint is being written: a joiner waits for its end."""


class ConsumerGroup:
    """The consumers of this machine, by local index (`processes[i]` trains on `devices[i]`); `membership` says
    which of them train now, in rank order. `read_last(i)` hands the controller the messages a finished consumer
    may have left in its pipe."""

    def __init__(self, run: RunPlan, mailbox: Mailbox, stop: Any, read_last: Callable[[int], None]) -> None:
        self.run = run
        self.config: TrainConfig = run.config
        self.devices = devices = run.devices
        self.machines = run.cluster
        elastic = run.elastic
        config = run.config
        self.mailbox, self.stop, self.read_last = mailbox, stop, read_last
        self.processes: list = []
        self.ready_queues: list = []
        self.setups: list[ConsumerSetup] = []
        # CPU consumers are forked from a zygote that imported torch once; a GPU's are spawned (common/zygote.py)
        self.zygote = zygote.CONSUMERS if zygote.consumers_may_fork(devices) else None
        self.lease = zygote.Lease()
        self.store: dist.Store | None = None  # several machines: hosted by the first
        self.local_store: LocalStore | None = None
        self.agreement: cluster.StopAgreement | None = None  # several machines: where all stop when one is told to
        self.witness = FailureWitness(self.processes, mailbox, config.collective_timeout_s)
        self.membership = Membership(devices, CONTEXT.Value("i", 0) if elastic else None, config.min_consumers,
                                     config.sync_every, config.collective_timeout_s, time.monotonic())
        self.failure_causes: dict[int, str] = {}  # consumer -> the error it reported before it died
        self.restarts_used: dict[int, int] = {}  # consumer -> times it was started again
        self.restart_at: dict[int, float] = {}  # consumer -> when it is to be started again
        self.starting_again: dict[int, Any] = {}  # consumer -> its new process, until it says it is ready
        self.joiners: set[int] = set()  # consumers started again and ready, waiting for a moment to join
        self.left_out: list[int] = []  # consumers whose device stays out: they died past --consumer-restarts
        self.startup = StartupWatch(config.collective_timeout_s)  # each consumer's start, to its first batch
        self.metrics: MetricsLog | None = None

    @property
    def members(self) -> list[int]:
        return self.membership.members

    def send(self, rank: int, message: Any) -> None:
        """To the consumer of `rank` in the group that trains now."""
        self.ready_queues[self.membership.members[rank]].put(message)

    def send_all(self, message: Any) -> None:
        for consumer in self.membership.members:
            self.ready_queues[consumer].put(message)

    # ---- the start ----------------------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Before the producers start: the stores dead runs left are swept, and the consumers' zygote (if they
        fork from one) is taken, so that its imports go on while the producers start."""
        sweep_dead_stores()
        if self.zygote is not None:
            self.lease = self.zygote.acquire()

    def start(self, ring: RingSpec, reference: EpochPlan, metrics: MetricsLog) -> None:
        """The store and the consumers, each started with its setup; on several machines, the agreement where
        all stop when one is told to (it shares the consumers' store). `reference`: the plan the run's
        learning-rate schedule was made for."""
        run, self.metrics = self.run, metrics
        store = self._open_store()
        if self.machines.multi:
            self.agreement = cluster.StopAgreement.join(self.machines, self.store, store,
                                                        self.config.collective_timeout_s)
        setups = consumer_setups(self.config, self.devices, self.machines, store, ring, run.data.train.classes,
                                 reference.steps_per_epoch * self.config.epochs, reference.steps_per_epoch,
                                 run.resumed.folder, run.run_dir)
        # A slot holds the largest share a consumer may take: more than --batch-size under --global-batch fixed
        note = fixed_share_note(self.config.batch_size, run.engine.build.batch_size, self.machines.world,
                                self.config.global_batch)
        self.setups = [replace(setup, start_step=run.resumed.start_at.global_step, elastic=run.elastic,
                               checkpoint_consumers=run.resumed.consumers, share_note=note,
                               one_sample=run.plan.one_sample_batches())  # the compile warm-up's size 1 only there
                       for setup in setups]
        for rank, setup in enumerate(self.setups):
            self.ready_queues.append(CONTEXT.Queue())
            self.processes.append(self._start_one(rank, setup))
            self.startup.start(rank)

    def _open_store(self) -> StoreAddress:
        """One machine: a file in a private folder, nothing on the network. Several: the first machine hosts
        the store through which every machine's consumers form their group."""
        machines = self.machines
        if not machines.multi:
            self.local_store = LocalStore()
            return self.local_store.address
        address = None
        if machines.leader:
            self.store, address = host_tcp_store(os.environ.get("MASTER_ADDR", LOOPBACK), machines.world,
                                                 self.config.collective_timeout_s)
        host, port = cluster.from_leader(machines, (address.host, address.port) if address else None)
        return StoreAddress(host=host, port=port)

    def _start_one(self, rank: int, setup: ConsumerSetup) -> Any:
        outbox = self.mailbox.open()
        try:
            return start(consumer_main, (setup, self.ready_queues[rank], outbox, self.stop,
                                         self.membership.generation), f"stoker consumer {rank}",
                         self.zygote.context if self.zygote is not None else CONTEXT)
        except (EOFError, ConnectionError) as error:  # the consumers' zygote died before it could fork
            if self.zygote is None:
                raise
            raise StokerRunError(self.zygote.ended_before_forking(error)) from None
        finally:
            outbox.close()

    # ---- every pass ---------------------------------------------------------------------------------------------

    def handle(self, message: Any, run: RunState) -> bool:
        """A consumer's message about the group; False when it is not one."""
        if isinstance(message, Stranded):
            self.membership.strand(message)
        elif isinstance(message, Joining):
            self._joining(message.rank, run.closing)
        elif isinstance(message, StartupPhase):
            self.startup.reported(message.rank, message.phase)
        elif isinstance(message, ConsumerFailed):
            self._failed(message)
        else:
            return False
        return True

    def _failed(self, message: ConsumerFailed) -> None:
        if self.membership.elastic:  # it ends now; its death is what the survivors regroup after
            self.failure_causes[message.rank] = str(message.error)
            log.error("consumer %d failed: %s\n%s", message.rank, message.error, message.error.trace)
            return
        causes = self.witness.causes(message)
        if not causes and self.machines.multi:
            causes = ["a consumer on another machine may have stopped first (see that machine's log)"]
        raise StokerRunError("; ".join([*causes, str(message.error)]) + f"\n{message.error.trace}")

    def tick(self, now: float, run: RunState) -> bool:
        """Deaths seen, stuck consumers killed, restarts due started and ready joiners admitted; a regroup that
        waits too long fails the run. True when every survivor has left the broken group: regroup now."""
        self._check(run)
        self._check_startup()
        self._kill_stuck()
        if not (self.membership.regrouping or run.closing):
            self._start_again(now)
        if run.closing:
            self._give_up_joiners()
        elif not run.saving:
            self._admit_joiners()
        return self.membership.ready(run.finished)

    def _check_startup(self) -> None:
        try:
            self.startup.check()
        except StartupTimeout as error:
            raise StokerRunError(str(error)) from None

    def check_deadline(self, finished: dict[int, Any]) -> None:
        self.membership.check_deadline(finished)

    def _check(self, run: RunState) -> None:
        finished = run.finished
        for consumer, process in list(self.starting_again.items()):
            if not process.is_alive():  # died while it started: a restart used, and maybe another planned
                del self.starting_again[consumer]
                log.warning("consumer %d (pid %s) %s while it started again", consumer, process.pid,
                            describe_exit(process))
                self._plan_restart(consumer)
        for rank in list(self.membership.members):
            process = self.processes[rank]
            if not process.is_alive() and rank not in finished:
                self.read_last(rank)
                if rank in finished:
                    continue
                cause = self._death(rank, process)
                if self.zygote is not None and not self.zygote.alive():
                    cause += ": the zygote consumers are forked from died, and every consumer with it"
                if not self.membership.elastic or not run.trained:  # before the first step: starting up
                    self.witness.log_reported_failures()
                    raise StokerRunError(cause)
                self._lose(rank, cause)

    # ---- a consumer's death, when the others go on --------------------------------------------------------------

    def _death(self, consumer: int, process: Any) -> str:
        return told_death(consumer, process, self.failure_causes.pop(consumer, None))

    def _lose(self, consumer: int, cause: str) -> None:
        death = self.membership.lose(consumer, cause)  # below --min-consumers: the run fails
        if death is None:  # started again, died before it joined
            log.warning("%s before it joined the others", cause)
        else:
            log.warning("%s; the other %d consumer(s) go on without it", cause, len(self.membership.members))
            self._write("consumer_lost", consumer=consumer, device=death.device, cause=cause,
                        t=round(death.died_s, 3), consumers=len(self.membership.members))
        self._plan_restart(consumer)

    def _kill_stuck(self) -> None:
        for consumer in self.membership.stuck():
            process = self.processes[consumer]
            self.failure_causes[consumer] = (f"stuck: its peers gave up waiting for it after collective_timeout_s="
                                             f"{self.config.collective_timeout_s:g}")
            log.warning("consumer %d (pid %s) is stuck outside the collective its peers left: killing it", consumer,
                        process.pid)
            process.kill()
            process.join(timeout=5.0)

    def _write(self, event: str, **fields: Any) -> None:
        assert self.metrics is not None, "start() gives the metrics log"
        self.metrics.write(event, **fields)

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

    def _start_again(self, now: float) -> None:
        for consumer, due in list(self.restart_at.items()):
            if now < due:
                continue
            del self.restart_at[consumer]
            old = self.ready_queues[consumer]  # the dead consumer's: what it was sent is dropped with it
            old.cancel_join_thread()
            old.close()
            self.ready_queues[consumer] = CONTEXT.Queue()
            setup = replace(self.setups[consumer], joining=True, resume_from=None, elastic=True,
                            model=ModelSettings(model=self.config.model, init=None))
            self.failure_causes.pop(consumer, None)
            self.processes[consumer] = self._start_one(consumer, setup)
            self.starting_again[consumer] = self.processes[consumer]
            log.info("consumer %d started again on %s", consumer, self.devices[consumer])

    def _joining(self, consumer: int, closing: bool) -> None:
        """A consumer started again is ready: it joins at the next regroup, once no checkpoint is being written
        (none while the run ends). A `Joining` said again (its regroup was overtaken) keeps its place."""
        if consumer in self.membership.members:
            self.membership.join(consumer)
            return
        process = self.starting_again.pop(consumer, None)
        if process is None or not process.is_alive():
            return  # from a start that died meanwhile (its death was counted)
        self.joiners.add(consumer)
        if closing:
            self._give_up_joiners()

    def _give_up_joiners(self) -> None:
        """The run ends (its last batches are handed over, or it stops): a consumer ready to rejoin would need a
        regroup its peers, finishing, never take part in. It is stopped (in neither `consumers_rejoined` nor
        `consumers_left_out`, as a restart still starting at the end)."""
        for consumer in sorted(self.joiners):
            log.warning("consumer %d was ready to rejoin as the run ended: not taken back", consumer)
            self.processes[consumer].kill()
            self.processes[consumer].join(timeout=5.0)
        self.joiners = set()

    def _admit_joiners(self) -> None:
        if not self.joiners or self.membership.regrouping:
            return
        for consumer in sorted(self.joiners):
            self.membership.join(consumer)
            self._write("consumer_joining", consumer=consumer, device=self.devices[consumer])
        self.joiners = set()

    # ---- a regroup ----------------------------------------------------------------------------------------------

    def take_back(self, finished: dict[int, Any]) -> tuple[int, list[StepReport]]:
        """Every survivor left the broken group: the step whose state they all hold, and the reports of the steps
        after it (trained again, no longer counted). Consumers that finished meanwhile are out of the new group."""
        self.membership.drop_finished(finished)
        agreed = self.membership.agreed_step()
        return agreed, self.membership.take_back(agreed)

    def credit_lost_steps(self, old: Scheduler, agreed: int, stats: RunStats, ledger: Ledger) -> None:
        """A dead consumer's steps up to the agreed state are in the survivors' weights (its part of every
        averaging up to it arrived) even where its report did not (on a GPU, steps are reported in groups):
        they count, with the samples the plan gave it, less those that were unusable."""
        for death in self.membership.deaths:
            if death.recovered_s is not None:
                continue
            first = max(self.membership.last_reported.get(death.consumer, -1) + 1, old.start.global_step)
            for global_step in range(first, agreed + 1):
                work = old.work_of(global_step, death.rank)
                skipped = stats.epochs[work.epoch].skipped_ids if work.epoch in stats.epochs else set()
                ids = np.array([i for i in work.sample_ids.tolist() if i not in skipped], np.int64)
                report = StepReport(death.consumer, work.epoch, work.step, global_step, len(ids), 0.0, 0.0, 0.0,
                                    0.0, ids, None, epoch_steps=old.plan.steps_in(work.epoch))
                stats.record_step(report, time.monotonic())
                ledger.record_step(report)

    def regrouped(self, agreed: int, taken_back: list[StepReport], epoch: int, offset: int | None) -> None:
        """The new plan is made: send each member its place in the new group, and the source of the state the
        consumers started again take."""
        membership = self.membership
        consumers = len(membership.members)
        fresh = tuple(rank for rank, consumer in enumerate(membership.members) if consumer in membership.fresh)
        source = next(rank for rank in range(consumers) if rank not in fresh)
        for rank, consumer in enumerate(membership.members):
            self.ready_queues[consumer].put(Regroup(membership.current, rank, consumers, agreed, fresh, source))
        steps_back = len({report.global_step for report in taken_back})
        started = membership.regrouping_since or time.monotonic()
        membership.regrouped(agreed, steps_back)
        log.warning("%d consumer(s)%s go on from the state after step %d (%d step(s) trained again)", consumers,
                    f", {len(fresh)} of them started again," if fresh else "", agreed, steps_back)
        self._write("regrouped", consumers=consumers, members=list(membership.members), agreed_step=agreed,
                    recovered_s=round(time.monotonic() - started, 4), steps_taken_back=steps_back,
                    joined=[membership.members[rank] for rank in fresh], epoch=epoch, offset=offset)

    # ---- the end ------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Consumers stopped (and any child a signal caught between its start and its record), the zygote's lease
        given back, the ready queues and the store closed."""
        stop_processes(self.processes, timeout_s=10.0)
        stop_processes(CONTEXT.active_children(), timeout_s=5.0)
        self.lease.release()
        for channel in self.ready_queues:
            channel.cancel_join_thread()
            channel.close()

    def close_store(self) -> None:
        if self.local_store is not None:
            self.local_store.close()
        self.agreement = self.store = None


def told_death(consumer: int, process: Any, reported: str | None) -> str:
    """How a consumer ended: its own error where it reported one (it then exits with code 0, which says nothing
    of why: "exited with code 0" named a consumer that had failed), else how its process ended."""
    how = "failed" if reported is not None and process.exitcode == 0 else describe_exit(process)
    return f"consumer {consumer} (pid {process.pid}) {how}" + (f": {reported.splitlines()[0]}" if reported else "")

"""Consumer process: one model replica on one device, training on the batches the controller hands it, in order.

It copies a slot to its device (uint8: four times fewer bytes than float32, see `feed`), hands the slot back at
once, normalizes on the device, runs forward, backward and the optimizer step, and joins the averaging collective.
On a GPU nothing in a step waits for the device, except that the host stays at most --steps-ahead steps ahead of it (a
blocking event: the host sleeps): the loss is copied to the host behind the step and the step's timings are events,
and both are read every few steps for the steps the device has done, or all at once when the consumer would wait
for input anyway.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from stoker.common import checkpoint, faults
from stoker.common.config import (
    AveragingSettings,
    DeviceSettings,
    ModelSettings,
    OptimizerSettings,
    RecipeSettings,
)
from stoker.common.devices import available_cores
from stoker.common.procs import (
    POLL_S,
    ChildError,
    ParentWatch,
    exit_with_parent,
    log_as_the_controller,
    name_process,
)
from stoker.pipeline.messages import (
    Batch,
    ConsumerFailed,
    Finish,
    Finished,
    Save,
    Saved,
    SlotFree,
    ValEnd,
    ValReport,
)
from stoker.pipeline.ring import RingSpec, SlotRing
from stoker.training import accel, exchange, model_file, recovery, replica_state, startup, warmup, wire
from stoker.training import init as initial_weights
from stoker.training.averager import Averager, OuterSpec
from stoker.training.ema import ModelEma
from stoker.training.groups import optimizer_groups
from stoker.training.memory_share import explaining_out_of_memory
from stoker.training.models import build_model
from stoker.training.recipe import Recipe, RecipeSpec
from stoker.training.recovery import AgreedStates, GroupLost, Joining, Regroup, Stranded, is_group_error
from stoker.training.rendezvous import StoreAddress, bind_to_loopback, group_options
from stoker.training.schedule import LearningRate
from stoker.training.step_reports import StepInFlight, StepReports
from stoker.training.streams import ops_for
from stoker.training.timing import StepClock
from stoker.training.to_device import DeviceLoader
from stoker.training.val_totals import ReplicaTotals

EMA_MODEL_FILE = "model_ema.pt"  # beside model.pt, saved the same way
ABORT_S = 10.0  # an abort of the process group that takes longer is stuck

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConsumerSetup:
    """Where a consumer stands in the job, and the run's settings it trains by, as the sections the controller
    validated."""

    rank: int  # global, over every machine's consumers
    local_rank: int  # on this machine: how the controller knows this consumer
    world_size: int
    device: str
    store: StoreAddress
    ring: RingSpec
    num_classes: int
    total_steps: int
    num_threads: int
    resume_from: Path | None
    seed: int
    model: ModelSettings  # init: None on resume, which continues from its checkpoint
    optimizer: OptimizerSettings
    recipe: RecipeSettings
    averaging: AveragingSettings
    devices: DeviceSettings  # the section: `device` above is this consumer's own
    warmup_steps: int = 0
    model_card: model_file.ModelCard | None = None  # written into model.pt beside the weights (None: plain weights)
    best_model: Path | None = None  # where rank 0 keeps the model of the best validation accuracy so far
    local_consumers: int = 1  # consumers on this machine: they share its cores
    start_step: int = 0  # the global step this part of the run starts at
    elastic: bool = False  # survivors of a peer's death go on (`--on-consumer-failure`): keep the agreed states
    checkpoint_consumers: int = 0  # on resume: the consumers whose states the checkpoint holds (0: world_size)
    # (train, validation): whether the plan can give this run a batch of one sample (the warm-up compiles it only then)
    one_sample: tuple[bool, bool] = (True, True)
    share_note: str = ""  # why a batch may exceed --batch-size (`memory_share`): said with an out-of-memory error
    joining: bool = False  # started again after a death: joins the group at the next regroup, with a peer's state

    @property
    def outer(self) -> OuterSpec | None:
        averaging = self.averaging
        return None if averaging.outer_optimizer == "none" else OuterSpec(
            averaging.outer_optimizer, averaging.outer_lr, averaging.outer_momentum)


class Stopped(Exception):
    """The controller asked us to stop, or it is gone."""


def consumer_main(setup: ConsumerSetup, ready, outbox, stop, generation=None) -> None:
    """Process entry point. `generation`: the controller's count of regroups (a shared integer), None when the
    survivors of a death do not go on."""
    name_process(f"stoker consumer {setup.rank}")
    log_as_the_controller()
    exit_with_parent()
    ring = SlotRing.attach(setup.ring)
    doing, finished = "starting", False
    try:
        startup.begin(outbox, setup.local_rank)
        replica = Replica(setup, ring, outbox, stop, generation)
        startup.end()
        doing = "training"
        replica.serve(ready)
        finished = True
    except Stopped:
        pass
    except BaseException as error:
        outbox.send(ConsumerFailed(setup.local_rank, ChildError.capture(f"consumer {setup.rank}", doing, error)))
    finally:
        close_group(finished)
        ring.close()


def close_group(finished: bool) -> None:
    """After a clean finish, destroy the group (nothing is in flight). On a stop or an error, abort it: since
    torch's PR #141510, `destroy_process_group` flushes pending NCCL work, and with a peer gone or an averaging
    in flight (DelayedAverage, BackwardAverage) it blocks until the controller kills the consumer."""
    if not dist.is_initialized():
        return
    if finished:
        dist.destroy_process_group()
    else:
        abort_group()


def abort_group() -> None:
    """Abort the group without hiding the consumer's own failure: with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 the
    watchdog may have aborted the communicators already, and the abort may raise (logged) or never return (after
    ABORT_S the process ends, its failure already sent: the controller would otherwise have to kill it)."""
    from torch.distributed import distributed_c10d

    failures: list[BaseException] = []

    def abort() -> None:
        try:
            distributed_c10d._abort_process_group()
        except BaseException as error:  # noqa: BLE001 - reported below, in the consumer's thread
            failures.append(error)

    aborting = threading.Thread(target=abort, name="abort process group", daemon=True)
    aborting.start()
    aborting.join(ABORT_S)
    if aborting.is_alive():
        log.warning("aborting the process group did not return within %.0f s: ending the consumer", ABORT_S)
        logging.shutdown()
        os._exit(1)
    elif failures:
        log.warning("aborting the process group failed (the watchdog may have aborted it first): %s", failures[0])


class Replica:
    """One model replica on its device: trains on the batches the controller sends, averages with its peers, saves
    and validates when told."""

    def __init__(self, setup: ConsumerSetup, ring: SlotRing, outbox, stop, generation=None) -> None:
        self.setup = setup
        self.generation = 0  # the group this replica is in (`Regroup`)
        self.shared_generation = generation
        self.ring = ring
        self.outbox = outbox
        self.stop = stop
        self.watch = ParentWatch()
        self.device = _claim_device(setup)
        self._join_first_group(setup, generation)
        self._build_training(setup)
        self._build_feed(setup, ring)
        ema = setup.recipe.ema
        self.ema = ModelEma(build_model(setup.model.model, setup.num_classes).to(self.device), self.model,
                            ema) if ema else None
        self._warm_up(setup)
        self._initial_state(setup)
        self._build_books(setup)

    def _join_first_group(self, setup: ConsumerSetup, generation) -> None:
        """The store, and the process group unless this replica joins at the next regroup (`serve`)."""
        self.base_store = _connect_store(setup)
        if setup.joining:
            self.store, self.host_group = self.base_store, None
            self.generation = generation.value if generation is not None else 0
        else:
            self.store = _join_group(setup, self.base_store)
            self.host_group = exchange.host_group()

    def _build_training(self, setup: ConsumerSetup) -> None:
        """The model, its recipe and schedule, the averager, the (compiled) forward, precision and optimizer."""
        self.model = build_model(setup.model.model, setup.num_classes).to(self.device)
        self.recipe = Recipe(RecipeSpec(setup.num_classes, setup.seed, setup.recipe))
        self.learning_rate = LearningRate(setup.optimizer.lr, setup.optimizer.schedule, setup.total_steps,
                                          setup.warmup_steps)
        averaging = setup.averaging
        in_backward = averages_in_backward(averaging, setup.devices, setup.recipe)
        self.averager = Averager(self.model, averaging.sync_every, setup.world_size,
                                 setup.outer, averaging.overlap_averaging, in_backward)
        # Compiled after the averager re-pointed the parameters into its buckets; the original module keeps the
        # state_dict keys checkpoints use.
        threads = compile_threads(setup.device, setup.num_threads, setup.local_consumers)
        self.forward = accel.compiled(self.model, threads) if setup.devices.compile else self.model
        self.precision = accel.MixedPrecision(setup.devices.precision, self.device, agree=setup.world_size > 1)
        self.optimizer = _make_optimizer(self.model, setup, self.device)

    def _build_feed(self, setup: ConsumerSetup, ring: SlotRing) -> None:
        """The slots' way to the device, the step clock and the reports of steps in flight."""
        ops = ops_for(self.device)
        # The weights stay NCHW in the averager's flat buckets: a channels_last input is enough for convolutions
        # to run channels_last (PyTorch follows the input), converting the small weights, not the activations.
        # As many staging buffers as steps ahead: the buffer a step refills was read by the step `steps_ahead`
        # back, whose end the clock has already waited for, so the feed itself never waits for a copy.
        ahead = setup.devices.steps_ahead
        self.loader = DeviceLoader(ring, self.device, setup.devices.channels_last, ops, num_staging=ahead)
        self.clock = StepClock(ops, ahead)
        self.reports = StepReports(self.outbox, self.clock, self.device, setup.local_rank, ops.asynchronous)

    def _warm_up(self, setup: ConsumerSetup) -> None:
        """Before the first collective: a peer's compile must not time it out (one started again joins later)."""
        if not setup.devices.compile:
            return
        warmup.warm_up(self.model, self.forward, self.precision, self.device, setup.ring.batch_size,
                       setup.ring.image_size, setup.num_classes, setup.devices.channels_last, setup.ring.val_size,
                       setup.one_sample, setup.ring.ramp.sizes if setup.ring.ramp is not None else ())
        if not setup.joining:
            warmup.wait_for_peers(self.store, "compiled", setup.world_size, self._check_alive)

    def _initial_state(self, setup: ConsumerSetup) -> None:
        """A checkpoint's state, or rank 0's initialization on every replica; one started again gets a peer's state
        at the regroup."""
        if setup.joining:
            return
        if setup.resume_from is not None:
            self._restore(setup.resume_from)
            return
        if setup.model.init is not None:
            self._load_init(setup.model.init)
        _broadcast_initial_state(self.averager)
        if self.averager.outer is not None:
            self.averager.outer.reset_anchor()
        if self.ema is not None:
            self.ema = ModelEma(self.ema.model, self.model, setup.recipe.ema)

    def _build_books(self, setup: ConsumerSetup) -> None:
        """Validation totals, the best model (rank 0), and with elastic runs the agreed states."""
        self.first_wait_s: float | None = None
        self.val_totals = ReplicaTotals(setup.num_classes, self.device, with_ema=self.ema is not None)
        self.best = _BestModel(setup.best_model, setup.model_card, setup.resume_from is not None) \
            if setup.rank == 0 and not setup.joining else None  # one started again: at its regroup, as rank 0
        self.agreed = AgreedStates(self._agreed_state) if setup.elastic else None
        if self.agreed is not None:  # (elastic runs are CPU runs: `continues_after_failure`)
            if self.averager.holds_average and not setup.joining:  # resumed between two averagings: none yet
                self.agreed.keep(setup.start_step - 1)  # every replica starts from the same state
            recovery.watch_group(self._check_alive, setup.averaging.collective_timeout_s)

    def serve(self, ready) -> None:
        """Train on what the controller sends until `Finish`. With `--on-consumer-failure continue`, a group that
        breaks (a peer died) is left and joined again as the controller says (`_rejoin`)."""
        broken: Exception | None = None
        if self.setup.joining:
            faults.wait_for_file(faults.JOIN_AFTER_ENV, self._check_stopped)
            broken = self._join_as_new(ready)
        while True:
            try:
                if broken is not None:
                    self._rejoin(ready, broken)  # a peer may die while the new group forms: stranded again
                    broken = None
                self._serve(ready)
                return
            except Exception as error:
                if self.agreed is None or not is_group_error(error):
                    raise
                broken = error

    def _serve(self, ready) -> None:
        while True:
            waited_from = time.perf_counter()
            message = _next_message(ready, self._check_stopped, when_idle=self.report_steps,
                                    while_idle=self._check_group)
            wait_s = time.perf_counter() - waited_from
            if isinstance(message, Batch) and message.kind == "train":
                with explaining_out_of_memory(self.setup.share_note):
                    self.train_step(message, wait_s)
                continue
            self.report_steps()  # the controller hears of every step before anything else happens
            self.clock.pause()
            if isinstance(message, Batch):
                self.val_batch(message)
            elif isinstance(message, ValEnd):
                self.val_end(message)
            elif isinstance(message, Save):
                self.save(message)
            elif isinstance(message, Finish):
                self.finish(message)
                return
            elif isinstance(message, Regroup):
                raise GroupLost(f"regrouped as generation {message.generation}")

    # ---- a peer's death -----------------------------------------------------------------------------------------

    def _rejoin(self, ready, error: Exception) -> None:
        """Leave the broken group, tell the controller which agreed state this replica holds, and go back to the
        one it names, in the group it names. Nothing of the broken group's is kept: batches it sent are dropped
        (the controller takes their slots back), a step in flight is void (the state goes back to before it)."""
        log.warning("consumer %d: the group broke (%s): waiting for the survivors' new group", self.setup.rank,
                    recovery.in_brief(error))
        if dist.is_initialized():  # not when a new group failed to form
            abort_group()
        self.clock.pause()
        self.report_steps()
        assert self.agreed is not None, "only an elastic replica rejoins"
        if not self.agreed.kept:  # resumed between two averagings, and none since: no state all replicas hold
            raise error
        self._strand(f"{type(error).__name__}: {recovery.in_brief(error)}")
        self._join(self._next_regroup(ready))

    def _join_as_new(self, ready) -> Exception | None:
        """A consumer started again joins at the next regroup. A group that breaks before this consumer holds the
        others' state (another joiner or a death came meanwhile) is joined again at the next one, as the newcomer
        it still is; one that breaks after is returned, to be left as any member leaves it."""
        while True:
            self.outbox.send(Joining(self.setup.local_rank))
            try:
                self._join(self._next_regroup(ready))
                return None
            except Exception as error:
                if self.agreed is None or not is_group_error(error):
                    raise
                if self.agreed.kept:
                    return error
                log.warning("consumer %d: the group it was joining broke (%s): joining the next one",
                            self.setup.local_rank, recovery.in_brief(error))
                if dist.is_initialized():
                    abort_group()
                self.setup = replace(self.setup, joining=True)

    def _strand(self, reason: str) -> None:
        """Tell the controller this consumer left its group, holding the agreed states it keeps."""
        assert self.agreed is not None, "only an elastic replica rejoins"
        self.outbox.send(Stranded(self.setup.local_rank, self.generation, self.agreed.newest, reason))

    def _next_regroup(self, ready) -> Regroup:
        """Drop what the old group was sent, up to this consumer's place in the new one. A Regroup that a later
        death or joining overtook is followed by the next one, which waits for this consumer to say again where it
        stands."""
        while True:
            message = _next_message(ready, self._check_stopped, when_idle=lambda: None)
            if not isinstance(message, Regroup) or message.generation <= self.generation:
                continue
            if self.shared_generation is None or message.generation == self.shared_generation.value:
                return message
            if self.setup.joining:
                self.outbox.send(Joining(self.setup.local_rank))
            else:
                self._strand("its regroup was overtaken")

    def _join(self, regroup: Regroup) -> None:
        assert self.agreed is not None, "only an elastic replica rejoins"
        self.generation = regroup.generation
        fresh = regroup.rank in regroup.fresh
        if not fresh:
            replica_state.apply(self, self.agreed.at(regroup.agreed_step))
            self.agreed.kept = [kept for kept in self.agreed.kept if kept[0] <= regroup.agreed_step]
        self.setup = replace(self.setup, rank=regroup.rank, world_size=regroup.world_size, joining=False)
        self.store = self._form_group(regroup.generation)
        self.host_group = exchange.host_group()
        self.averager.regroup(regroup.world_size)
        if regroup.fresh:
            self._hand_over_state(regroup, fresh)
        self.reports.drop()
        self.val_totals.reset()
        if self.setup.rank != 0:
            self.best = None  # rank 0 keeps model_best.pt; one that was rank 0 before may hold an older best
        elif self.best is None:
            self.best = _BestModel(self.setup.best_model, self.setup.model_card, resumed=True)
        log.info("consumer %d is rank %d of %d from the state after step %d", self.setup.local_rank,
                 regroup.rank, regroup.world_size, regroup.agreed_step)

    def _form_group(self, generation: int) -> dist.Store:
        """Form the new group under a fresh prefix once every member arrived (`recovery.all_arrive`): a member that
        dies meanwhile never arrives, the controller moves on without it, and this consumer is stranded again
        (GroupLost) instead of waiting the collective timeout out in init_process_group."""
        faults.maybe_inject("consumer", f"consumer={self.setup.local_rank},regroup={generation};")
        store = dist.PrefixStore(f"stoker-group-{generation}/", self.base_store)
        recovery.all_arrive(store, self.setup.world_size, self._check_alive,
                            self.setup.averaging.collective_timeout_s)
        return _join_group(self.setup, store)

    def _hand_over_state(self, regroup: Regroup, fresh: bool) -> None:
        """A consumer started again gets the agreed state from `regroup.source`: the weights (the same on every
        survivor) and that peer's optimizer, RNG and EMA state, as a resume hands out a checkpoint's."""
        for tensor in [*self.averager.float_buckets, *self.averager.int_tensors]:
            recovery.done(dist.broadcast(tensor, src=regroup.source, async_op=True))
        mine = checkpoint.to_cpu(replica_state.own(self)) if regroup.rank == regroup.source else None
        state = wire.broadcast(mine, regroup.source, torch.device("cpu"))
        if fresh:
            replica_state.apply(self, state)
            assert self.agreed is not None, "only an elastic replica rejoins"
            self.agreed.kept = []
            self.agreed.keep(regroup.agreed_step)

    def _agreed_state(self) -> dict:
        """What every replica holds alike after an averaging, and this replica's own optimizer and RNG state."""
        return {**replica_state.own(self), "buckets": self.averager.float_buckets, "ints": self.averager.int_tensors}

    def _check_stopped(self) -> None:
        if self.stop.is_set() or self.watch.parent_gone():
            raise Stopped

    def train_step(self, batch: Batch, wait_s: float) -> None:
        if self.first_wait_s is None:
            self.first_wait_s, wait_s = wait_s, 0.0  # waiting for the very first batch is start-up, not a stall
        self.clock.begin(wait_s)
        images, labels, ids = self.loader.take(batch.slot, self._release, fed=self.clock.fed, epoch=batch.epoch)
        self.averager.begin_step(batch.global_step, len(ids), batch.step_samples, self.optimizer)
        loss = None
        if len(ids):
            self._set_learning_rate(batch)
            self.model.train()
            self.optimizer.zero_grad(set_to_none=True)
            images, targets = self.recipe.prepare(images, labels, batch.epoch, batch.step, self.setup.rank)
            with self.precision.autocast():
                loss = self.recipe.loss(self.forward(images), targets)
            # A simulated device's time comes before the gradients exist: averaging that starts during backward
            # must not hide behind it.
            faults.simulated_delay(faults.STEP_TIME_ENV)
            clip = self.recipe.spec.settings.clip_grad_norm
            self.precision.backward_and_step(loss, self.optimizer, self._clip if clip else None)
        else:  # fp16: every replica joins the scalers' overflow agreement
            self.precision.skip_step()
        # Copied to the host before the compute event: a step that does not average ends at that event, and the
        # report reads the loss once the step's end has completed, with no sync.
        loss = self.loader.ops.to_host(loss.float()) if loss is not None else None
        self.clock.computed()
        faults.maybe_inject("consumer", f"rank={self.setup.rank},step={batch.global_step};")
        averaged = self.averager.end_step(batch.global_step) is not None
        digest = None
        every = self.setup.averaging.check_replicas_every
        if averaged and self.averager.replicas_agree and every and (batch.global_step + 1) % every == 0:
            digest = self.averager.digest()
        marks = self.clock.end(averaged, after_averaging=self._ema_update(batch.global_step) if averaged else None)
        if averaged and self.agreed is not None and self.averager.replicas_agree:
            self.agreed.keep(batch.global_step)
        self.reports.add(StepInFlight(batch, ids, loss, marks, digest, time.monotonic()), self.generation)

    def _ema_update(self, global_step: int) -> Callable[[], None] | None:
        """The EMA of the averaged model (the same on every replica), for the clock to run after the averaging."""
        ema = self.ema
        if ema is None:
            return None
        return lambda: ema.update(self.model, global_step)

    def report_steps(self, wait: bool = True) -> None:
        """The steps done since the last report (`StepReports.send`)."""
        self.reports.send(self.generation, wait)

    def _release(self, slot: int) -> None:
        self.outbox.send(SlotFree(slot, self.generation))

    def _set_learning_rate(self, batch: Batch) -> None:
        lr = self.learning_rate.at(batch.schedule_step) * batch.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)

    def _clip(self) -> None:
        self.recipe.clip([p for p in self.model.parameters() if p.grad is not None])

    def val_batch(self, batch: Batch) -> None:
        images, labels, _ = self.loader.take(batch.slot, self._release, "val")
        if not len(labels):
            return
        self.model.eval()
        # Summed on the device; read once, at the end of validation.
        with torch.no_grad(), self.precision.autocast():
            self.val_totals.add(self.forward(images), labels, self.ema.model(images) if self.ema is not None else None)

    def val_end(self, message: ValEnd) -> None:
        faults.maybe_inject("consumer", f"rank={self.setup.rank},val={message.epoch};")
        result, ema = self.val_totals.reduce()
        if self.setup.rank == 0 and result is not None:
            ema_figures = None if ema is None else {"loss": ema.loss, "accuracy": ema.accuracy, "top5": ema.top5}
            self.outbox.send(ValReport(message.epoch, result.loss, result.accuracy, result.count, result.top5,
                                       result.confusion, ema_figures))
        if result is not None:
            self._offer_best(message.epoch + 1, result.accuracy)

    def _offer_best(self, epoch: int, accuracy: float) -> None:
        """Rank 0 may write model_best.pt now; the others wait for it here, paced like a checkpoint: a slow disk
        must not time out their next collective."""
        work = self._rank_zero_work(f"best model after epoch {epoch}")
        if self.setup.rank != 0:
            work.wait("written")
            return
        if self.best is not None:
            self.best.offer(self.model, epoch, accuracy)
        work.post("written")

    def save(self, message: Save) -> None:
        """Rank 0 writes the whole checkpoint, every replica's state included: on several machines only the first
        has the run folder's checkpoints, so resuming needs nothing from the others' disks."""
        work = self._rank_zero_work(f"checkpoint at step {message.global_step}")
        faults.maybe_inject("consumer", f"rank={self.setup.rank},save={message.global_step};")
        model_state = self.model.state_dict() if self.setup.rank == 0 else {}
        files = exchange.save(work, message.folder, model_state, checkpoint.to_cpu(replica_state.own(self)),
                              self.setup.rank, self.setup.world_size, group=self.host_group)
        self.outbox.send(Saved(self.setup.local_rank, message.global_step, files, self.averager.holds_average))

    def _restore(self, folder: Path) -> None:
        """Rank 0 reads the checkpoint and hands every replica the averaged model and its own state."""
        startup.phase(startup.RESTORING)
        work = self._rank_zero_work("resume")
        model_state = exchange.load_model(work, folder, self.setup.rank)
        if model_state is not None:
            self.model.load_state_dict(model_state)
        _broadcast_initial_state(self.averager)
        startup.phase(startup.RESTORING)  # the replicas' own states: read from the checkpoint too
        replica_state.apply(self, exchange.hand_out(work, folder, self.setup.rank, self.setup.world_size,
                                            group=self.host_group, saved=self.setup.checkpoint_consumers))

    def _load_init(self, path: Path) -> None:
        """Rank 0 reads the --init file (the broadcast after it gives the weights to every replica); the others wait
        on the store meanwhile, paced like a checkpoint file, not in the broadcast under the collective timeout: a
        large file on a slow disk must not fail the run."""
        work = self._rank_zero_work("--init")
        if self.setup.rank != 0:
            work.wait("loaded")
            return
        initial_weights.apply_init(initial_weights.plan_init(path, self.model), self.model)
        work.post("loaded")

    def _rank_zero_work(self, name: str) -> exchange.RankZeroWork:
        return exchange.RankZeroWork(self.store, name, exchange.allowance_s(self.setup.averaging.collective_timeout_s,
                                                                            self.model), self._check_alive)

    def _check_alive(self) -> None:
        self._check_stopped()
        self._check_group()

    def _check_group(self) -> None:
        if self.shared_generation is not None and self.shared_generation.value != self.generation:
            raise GroupLost(f"the controller is forming group {self.shared_generation.value}")

    def finish(self, message: Finish) -> None:
        self.averager.settle()
        digest = self.averager.digest()
        if self.setup.rank == 0:
            card = self.setup.model_card
            _save_model(message.model_path, self.model, card)
            if self.ema is not None:
                _save_model(message.model_path.with_name(EMA_MODEL_FILE), self.ema.model,
                            replace(card, kind="ema") if card is not None else None)
        self.outbox.send(Finished(self.setup.local_rank, digest, self.first_wait_s or 0.0,
                                  accel.memory_stats(self.device)))


def _save_model(path: Path, model: torch.nn.Module, card: model_file.ModelCard | None) -> None:
    if card is None:
        checkpoint.save_tensors(path, model.state_dict())
    else:
        model_file.save_model(path, model.state_dict(), card)


class _BestModel:
    """model_best.pt: rewritten (atomically) whenever validation beats the best accuracy so far; a resumed run
    starts from the accuracy the file records, so a worse epoch after a resume does not replace it. A new run
    ignores a model_best.pt left in its folder (not one of its own: its first validation replaces it)."""

    def __init__(self, path: Path | None, card: model_file.ModelCard | None, resumed: bool) -> None:
        self.path, self.card = path, card
        self.accuracy = model_file.recorded_accuracy(path) if path is not None and resumed else None

    def offer(self, model: torch.nn.Module, epoch: int, accuracy: float) -> None:
        if self.path is None or self.card is None or (self.accuracy is not None and accuracy <= self.accuracy):
            return
        model_file.save_best(self.path, model.state_dict(), self.card, epoch, accuracy)
        self.accuracy = accuracy


def _next_message(ready, check: Callable[[], None], when_idle, while_idle: Callable[[], None] | None = None):
    """The next message; `check()` raises when the consumer must stop waiting; `when_idle()` runs once if none is
    there within a poll (the consumer would wait anyway, so reading the device costs nothing then), and
    `while_idle()` after every empty poll (a message already there, a `Finish`, is taken first)."""
    idle = False
    while True:
        check()
        try:
            return ready.get(timeout=POLL_S)
        except queue.Empty:
            if while_idle is not None:
                while_idle()
            if not idle:
                when_idle()
                idle = True


def averages_in_backward(averaging: AveragingSettings, devices: DeviceSettings, recipe: RecipeSettings) -> bool:
    """Whether groups of parameters average and step as their gradients complete. Not under fp16 (the gradient
    scaler steps the whole model after unscaling), clipping (it needs every gradient's norm first) or --compile
    (the compiled backward is one autograd node: every group's hook fires at its end, so the per-group steps and
    all_reduces would hide nothing and cost launches; compiled autograd would be needed, and is not used)."""
    return (averaging.average_in_backward and devices.precision != "fp16" and not recipe.clip_grad_norm
            and not devices.compile)


def _make_optimizer(model: torch.nn.Module, setup: ConsumerSetup, device: torch.device) -> torch.optim.Optimizer:
    settings = setup.optimizer
    groups = optimizer_groups(model, settings.weight_decay, settings.no_decay_norm_bias, settings.lr_head_multiplier)
    if settings.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=settings.lr, weight_decay=settings.weight_decay,
                                 **accel.fused_option(torch.optim.AdamW, device))
    return torch.optim.SGD(groups, lr=settings.lr, momentum=settings.momentum,
                           weight_decay=settings.weight_decay, **accel.fused_option(torch.optim.SGD, device))


def compile_threads(device: str, num_threads: int, local_consumers: int) -> int:
    """This consumer's share of the cores: its torch threads on the CPU; on a GPU the cores over this machine's
    consumers (not over the visible GPUs: `--devices cuda:0` on an 8-GPU machine compiles on every core)."""
    if not device.startswith("cuda"):
        return num_threads
    return max(1, available_cores() // max(1, local_consumers))


def _claim_device(setup: ConsumerSetup) -> torch.device:
    """This process's threads, seed and device, and the backends' settings, before anything is built."""
    torch.set_num_threads(setup.num_threads)
    torch.manual_seed(setup.seed)
    device = torch.device(setup.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    accel.configure_backends(setup.devices.deterministic)
    return device


def _connect_store(setup: ConsumerSetup) -> dist.Store:
    startup.phase(startup.STORE)
    if setup.store.local:
        bind_to_loopback()
    return setup.store.connect(setup.world_size, setup.averaging.collective_timeout_s)


def _join_group(setup: ConsumerSetup, store: dist.Store) -> dist.Store:
    startup.phase(startup.GROUP)
    timeout = timedelta(seconds=setup.averaging.collective_timeout_s)
    options = group_options(torch.device(setup.device))
    os.environ.update(options.env)  # read when the backend starts, so before init
    dist.init_process_group(options.backend, store=store, rank=setup.rank, world_size=setup.world_size,
                            timeout=timeout, **options.init_kwargs)
    startup.phase(startup.BUILDING)  # what follows the group's start in the replica's
    return store


def _broadcast_initial_state(averager: Averager) -> None:
    """Every replica starts from rank 0's initialization."""
    startup.phase(startup.INITIAL_STATE)
    for tensor in [*averager.float_buckets, *averager.int_tensors]:
        dist.broadcast(tensor, src=0)

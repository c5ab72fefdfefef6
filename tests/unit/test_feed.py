"""The GPU feed's ordering, checked with a fake device that records every stream, event and copy call (there is
no GPU here): staging buffers are rewritten only after the copy that read them completed, copies run on the side
stream, the compute stream waits for the copy's event, and the slot goes back before any device work."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch

from stoker.pipeline.ring import SlotRing
from stoker.training.streams import CpuOps
from stoker.training.timing import StepClock
from stoker.training.to_device import DeviceLoader, normalize_pixels

IMAGENET_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
IMAGENET_STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


class FakeEvent:
    def __init__(self, name: str) -> None:
        self.name = name
        self.covers: list[tuple[torch.UntypedStorage, bytes]] = []  # (source, its bytes when copied from)
        self.completed = False
        self.stamp = 0.0
        self.before: list[FakeEvent] = []  # what must have completed when this has: earlier work on its stream
        # and the events its stream waited for before it

    def __repr__(self) -> str:
        return self.name


class FakeOps:
    """A device that runs behind the host: an event completes only when the host synchronizes on it (or on a later
    event of its stream, or one that waited for it: streams run in order), or when `catch_up` says the device has
    done everything enqueued. Copies land at once (so values can be checked), but the fake remembers what each copy
    read and complains if the host rewrote a source before learning that the copy had completed."""

    asynchronous = True

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.log: list[tuple] = []
        self.current = "compute"
        self.enqueued: dict[str, list] = {"compute": [], "copy": []}
        self.in_flight: dict[int, list[FakeEvent]] = {}  # source pointer -> events not yet known complete
        self.violations: list[str] = []
        self.clock = {"compute": 0.0, "copy": 0.0}  # device time per stream, advanced by `work`
        self.events = 0
        self.last: dict[str, FakeEvent | None] = {"compute": None, "copy": None}  # the latest event on each stream
        self.waited: dict[str, list[FakeEvent]] = {"compute": [], "copy": []}  # since that event
        self.recorded: list[FakeEvent] = []

    def compute_stream(self) -> str:
        return "compute"

    def copy_stream(self) -> str:
        return "copy"

    @contextmanager
    def on(self, stream: str):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def new_event(self) -> FakeEvent:
        self.events += 1
        return FakeEvent(f"e{self.events}")

    def record(self, event: FakeEvent, stream: str) -> None:
        self.log.append(("record", event, stream))
        event.covers, self.enqueued[stream] = self.enqueued[stream], []
        event.completed = False
        event.stamp = self.clock[stream]
        event.before = [e for e in (self.last[stream], *self.waited[stream]) if e is not None]
        self.last[stream], self.waited[stream] = event, []
        self.recorded.append(event)
        for source, _ in event.covers:
            self.in_flight.setdefault(source.data_ptr(), []).append(event)

    def wait(self, stream: str, event: FakeEvent) -> None:
        self.log.append(("wait", stream, event))
        self.clock[stream] = max(self.clock[stream], event.stamp)
        self.waited[stream].append(event)

    def done(self, event: FakeEvent) -> bool:
        return event.completed

    def synchronize(self, event: FakeEvent) -> None:
        self.log.append(("sync", event))
        self._complete(event)

    def catch_up(self) -> None:
        """The device has done everything enqueued so far (the host learns it by `done`, without a sync)."""
        for event in self.recorded:
            self._complete(event)

    def _complete(self, event: FakeEvent) -> None:
        pending = [event]
        while pending:
            current = pending.pop()
            if current.completed:
                continue
            for source, snapshot in current.covers:
                if bytes(source) != snapshot:
                    self.violations.append(f"a staging buffer was rewritten before {current} (its copy) completed")
            current.completed = True
            pending.extend(current.before)

    def elapsed_s(self, start: FakeEvent, end: FakeEvent) -> float:
        return end.stamp - start.stamp

    def work(self, seconds: float) -> None:
        """Device work enqueued on the current stream: the host call returns at once."""
        self.clock[self.current] += seconds

    def pinned(self, shape, dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    def empty(self, shape, dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    def to_host(self, value: torch.Tensor) -> torch.Tensor:
        self.log.append(("to_host", self.current))
        return value.detach().clone()

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        base = source.untyped_storage().data_ptr()
        pending = [e for e in self.in_flight.get(base, []) if not e.completed]
        if pending:
            self.violations.append(f"a staging buffer was copied from again before {pending} completed")
        self.log.append(("copy", self.current, base, destination.untyped_storage().data_ptr()))
        destination.copy_(source)
        self.enqueued[self.current].append((source.untyped_storage(), bytes(source.untyped_storage())))


@pytest.fixture
def ring():
    ring = SlotRing.create(3, 4, 8, 1)
    rng = np.random.default_rng(0)
    for slot in range(3):
        ring.images[slot] = rng.integers(0, 256, ring.images[slot].shape, dtype=np.uint8)
        ring.labels[slot] = np.arange(4) + 10 * slot
        ring.ids[slot] = np.arange(4) + 100 * slot
        ring.counts[slot] = 4 if slot != 1 else 3  # a short batch too
    yield ring
    ring.close()


def expected_images(ring: SlotRing, slot: int) -> torch.Tensor:
    count = int(ring.counts[slot])
    pixels = torch.from_numpy(ring.images[slot, :count].copy()).permute(0, 3, 1, 2).float() / 255
    return (pixels - IMAGENET_MEAN) / IMAGENET_STD


def take_all(loader: DeviceLoader, ops: FakeOps, slots: list[int]) -> list[torch.Tensor]:
    images = []
    for slot in slots:
        ops.log.append(("take", slot))
        batch, labels, ids = loader.take(slot, lambda s: ops.log.append(("release", s)))
        assert labels.tolist() == list(ring_labels(loader.ring, slot))
        assert ids.tolist() == loader.ring.ids[slot, :len(ids)].tolist()
        images.append(batch)
    return images


def ring_labels(ring: SlotRing, slot: int) -> np.ndarray:
    return ring.labels[slot, :int(ring.counts[slot])]


def test_batches_arrive_normalized_and_complete(ring):
    ops = FakeOps()
    loader = DeviceLoader(ring, torch.device("cpu"), ops=ops)
    slots = [0, 1, 2, 0, 1, 2, 0]
    for slot, images in zip(slots, take_all(loader, ops, slots)):
        torch.testing.assert_close(images, expected_images(ring, slot))


@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format])
def test_normalize_gives_torchvisions_values_in_the_memory_format_asked_for(memory_format):
    """The fast channels_last path (rows of W*C values) against ToTensor + Normalize's definition."""
    pixels = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (3, 7, 5, 3), dtype=np.uint8))
    images = normalize_pixels(pixels, IMAGENET_MEAN * 255, 1 / (IMAGENET_STD * 255), memory_format)
    expected = (pixels.permute(0, 3, 1, 2).float() / 255 - IMAGENET_MEAN) / IMAGENET_STD
    torch.testing.assert_close(images, expected)
    assert images.is_contiguous(memory_format=memory_format)


def test_a_staging_buffer_is_rewritten_only_after_its_copy_completed(ring):
    ops = FakeOps()
    loader = DeviceLoader(ring, torch.device("cpu"), ops=ops)
    take_all(loader, ops, [0, 1, 2, 0, 1, 2, 0])
    assert not ops.violations
    assert len(loader.staging) >= 2
    syncs = [entry for entry in ops.log if entry[0] == "sync"]
    # At most one per reuse (none where an earlier sync already covered the copy: streams run in order), none
    # for a buffer's first use.
    assert 0 < len(syncs) <= 7 - len(loader.staging)


def test_copies_run_on_the_side_stream_and_compute_waits_for_them(ring):
    ops = FakeOps()
    loader = DeviceLoader(ring, torch.device("cpu"), ops=ops)
    take_all(loader, ops, [0, 1, 2, 0])
    log = ops.log
    copies = [i for i, entry in enumerate(log) if entry[0] == "copy"]
    assert copies and all(log[i][1] == "copy" for i in copies)
    for take in _per_take(log):
        kinds = [entry[0] for entry in take]
        release, first_copy = kinds.index("release"), kinds.index("copy")
        assert release < first_copy  # the slot goes back before any device work
        copied = next(e[1] for e in take if e[0] == "record" and e[2] == "copy")
        waited = kinds.index("wait", first_copy)
        assert take[waited][1:] == ("compute", copied)  # the compute stream waits for this copy's event


def test_a_device_buffer_is_overwritten_only_after_the_compute_that_read_it(ring):
    ops = FakeOps()
    loader = DeviceLoader(ring, torch.device("cpu"), ops=ops)
    take_all(loader, ops, [0, 1, 2, 0, 1])
    used_by_buffer: dict[int, FakeEvent] = {}
    for take in _per_take(ops.log):
        destination = next(e[3] for e in take if e[0] == "copy")
        before_copy = take[:[e[0] for e in take].index("copy")]
        if destination in used_by_buffer:
            assert ("wait", "copy", used_by_buffer[destination]) in before_copy
        used_by_buffer[destination] = next(e[1] for e in take if e[0] == "record" and e[2] == "compute")


def _per_take(log: list[tuple]) -> list[list[tuple]]:
    """The log cut into one part per `take`."""
    takes: list[list[tuple]] = []
    for entry in log:
        if entry[0] == "take":
            takes.append([])
        else:
            takes[-1].append(entry)
    return takes


@pytest.mark.parametrize("channels_last", [False, True])
def test_memory_format_is_a_decision(ring, channels_last):
    """A permuted NHWC buffer is channels_last by accident; the model gets what the setting says."""
    for ops in (CpuOps(), FakeOps()):
        loader = DeviceLoader(ring, torch.device("cpu"), channels_last=channels_last, ops=ops)
        images, _, _ = loader.take(0, lambda slot: None)
        assert images.is_contiguous(memory_format=torch.channels_last) == channels_last
        assert images.is_contiguous() != channels_last


def test_step_times_are_device_times_not_host_times():
    """A collective that only enqueues returns at once on the host; the events say how long the device spent."""
    ops = FakeOps()
    clock = StepClock(ops)
    clock.begin(host_wait_s=5.0)  # the host waited, but the device was still busy with earlier steps
    clock.fed()
    ops.work(0.030)  # forward, backward, step
    clock.computed()
    ops.work(0.012)  # the all_reduce
    first = clock.end(averaged=True)
    ops.clock["compute"] += 0.004  # the device idles 4 ms: its input was late
    clock.begin(host_wait_s=0.0)
    ops.clock["compute"] += 0.001  # and 1 ms more for the host-to-device copy
    clock.fed()
    ops.work(0.030)
    clock.computed()
    second = clock.end(averaged=False)
    times = clock.seconds(first)
    assert (times.wait_s, times.compute_s, times.averaging_s) == pytest.approx((0.0, 0.030, 0.012))
    times = clock.seconds(second)
    # The consumer did not wait for this batch: the device idled for the host (its copy, its launches).
    assert (times.wait_s, times.compute_s, times.averaging_s) == pytest.approx((0.0, 0.030, 0.0))
    assert times.host_s == pytest.approx(0.005)


def test_input_wait_on_a_gpu_is_the_part_of_the_idle_gap_spent_waiting_for_the_batch():
    """5 ms of device idle: the consumer was blocked for its batch 3 ms of it, and spent 2 ms in Python and copies;
    only the 3 ms say that more producers would help."""
    ops = FakeOps()
    clock = StepClock(ops)
    clock.begin(host_wait_s=0.0)
    clock.fed()
    ops.work(0.030)
    clock.computed()
    clock.end(averaged=False)
    ops.clock["compute"] += 0.005
    clock.begin(host_wait_s=0.003)
    clock.fed()
    ops.work(0.030)
    clock.computed()
    times = clock.seconds(clock.end(averaged=False))
    assert (times.wait_s, times.host_s, times.compute_s) == pytest.approx((0.003, 0.002, 0.030))
    # Blocked longer than the device idled (it still had queued steps): the wait is the gap, no host share.
    ops.clock["compute"] += 0.001
    clock.begin(host_wait_s=0.050)
    clock.fed()
    ops.work(0.030)
    clock.computed()
    times = clock.seconds(clock.end(averaged=False))
    assert (times.wait_s, times.host_s) == pytest.approx((0.001, 0.0))


def test_on_the_cpu_a_step_is_timed_by_the_host():
    clock = StepClock(CpuOps())
    clock.begin(host_wait_s=0.25)
    clock.fed()
    clock.computed()
    times = clock.seconds(clock.end(averaged=True))
    assert times.wait_s == 0.25 and times.compute_s >= 0 and times.averaging_s >= 0


class _Outbox:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, message) -> None:
        self.sent.append(message)


def _replica_on(ops: FakeOps, ring: SlotRing, sync_every: int = 1, steps_ahead: int = 2):
    """A consumer's training steps on a device that runs behind the host (world of one: no process group)."""
    from types import SimpleNamespace

    from stoker.training.accel import MixedPrecision
    from stoker.training.averager import Averager
    from stoker.training.consumer import Replica
    from stoker.training.recipe import Recipe, RecipeSpec
    from stoker.training.schedule import LearningRate
    from stoker.training.step_reports import StepReports

    replica = Replica.__new__(Replica)
    replica.setup = SimpleNamespace(rank=0, local_rank=0, total_steps=100,
                                    averaging=SimpleNamespace(check_replicas_every=0))
    # A linear model: the fake device's ordering is under test, not the network (labels go up to 23).
    replica.model = replica.forward = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 3, 30))
    replica.averager = Averager(replica.model, sync_every, 1)
    replica.optimizer = torch.optim.SGD(replica.model.parameters(), lr=0.01)
    replica.precision = MixedPrecision("fp32", torch.device("cpu"))
    replica.outbox = _Outbox()
    replica.loader = DeviceLoader(ring, torch.device("cpu"), ops=ops, num_staging=steps_ahead)
    replica.clock = StepClock(ops, steps_ahead)
    replica.reports = StepReports(replica.outbox, replica.clock, torch.device("cpu"), 0, asynchronous=True)
    replica.first_wait_s, replica.device = None, torch.device("cpu")
    replica.generation, replica.agreed = 0, None
    replica.learning_rate, replica.ema = LearningRate(0.01, "constant", 100), None
    replica.recipe = Recipe(RecipeSpec(num_classes=30, seed=0))  # cross-entropy on the labels, nothing else
    return replica


def _train(replica, ops: FakeOps, steps: int) -> list[list[tuple]]:
    """`steps` training steps; the fake's log entries of each."""
    from stoker.pipeline.messages import Batch

    logs = []
    for step in range(steps):
        mark = len(ops.log)
        replica.train_step(Batch("train", 0, step, step, step % 3, 4), wait_s=0.0)
        logs.append(ops.log[mark:])
    return logs


def _reported_steps(replica) -> list[int]:
    from stoker.pipeline.messages import StepReport

    return [m.global_step for m in replica.outbox.sent if isinstance(m, StepReport)]


def test_a_gpu_consumer_reports_only_the_steps_the_device_has_done(ring):
    """A report never drains the device: after the first step (reported at once, the controller times the run
    from it) each report holds the steps whose end event has completed, read without a synchronization; the rest
    wait for a later report or for the moment the consumer is idle anyway."""
    from stoker.training.step_reports import REPORT_EVERY_ASYNC

    ops = FakeOps()
    replica = _replica_on(ops, ring)
    steps = 1 + 2 * REPORT_EVERY_ASYNC
    logs = _train(replica, ops, steps)
    for log in logs[1:]:
        assert sum(entry[0] == "sync" for entry in log) <= 1  # the hold-back only, never one per reported step
    reported = _reported_steps(replica)
    assert reported == list(range(len(reported)))  # in order
    assert steps - REPORT_EVERY_ASYNC <= len(reported) < steps  # all but the last steps still on the device
    ops.catch_up()  # the device finished; the host learns it without a synchronization
    mark = len(ops.log)
    replica.report_steps(wait=False)
    assert _reported_steps(replica) == list(range(steps)) and not any(e[0] == "sync" for e in ops.log[mark:])


@pytest.mark.parametrize("steps_ahead", [2, 3])
def test_a_gpu_consumer_stays_at_most_steps_ahead_of_the_device_and_its_feed_never_waits(ring, steps_ahead):
    """The host sleeps on the end of the step `--steps-ahead` back before it feeds the next one, so a GPU-bound
    consumer does not run 16 steps ahead and then wait on all of them at once; it does use the depth it is given.
    With as many staging buffers, that one wait covers the copy of the buffer the step refills: one sync a step."""
    ops = FakeOps()
    replica = _replica_on(ops, ring, steps_ahead=steps_ahead)
    ends, most_ahead = [], 0
    for log in _train(replica, ops, 12):
        ends.append(next(e[1] for e in reversed(log) if e[0] == "record" and e[2] == "compute"))
        most_ahead = max(most_ahead, sum(not end.completed for end in ends))
        assert sum(entry[0] == "sync" for entry in log) <= 1
    assert most_ahead == steps_ahead
    assert not ops.violations


@pytest.mark.parametrize("sync_every", [1, 2])
def test_a_step_s_loss_reaches_the_host_behind_the_step_not_by_a_synchronization(ring, sync_every):
    """With --sync-every 2 every other step does not average: its end is its compute event, and the loss's copy
    must come before that one too, or the report would read it before it landed."""
    ops = FakeOps()
    replica = _replica_on(ops, ring, sync_every)
    for log in _train(replica, ops, 4):
        kinds = [(e[0], e[1]) for e in log]
        assert ("to_host", "compute") in kinds
        last_record = max(i for i, e in enumerate(log) if e[0] == "record" and e[2] == "compute")
        assert kinds.index(("to_host", "compute")) < last_record  # covered by the step's end event


def test_cuda_events_are_blocking_so_a_host_wait_sleeps(monkeypatch):
    """`cudaEventSynchronize` on an event made without `blocking=True` spins a core; every event the feed and the
    clock wait on comes from `new_event`. (torch.cuda's classes are replaced by recorders: there is no GPU here.)"""
    from stoker.training import streams

    made: list[dict] = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "Event", lambda **flags: made.append(flags) or object())
    ops = streams.CudaOps(torch.device("cuda:0"))
    ops.new_event()
    assert made == [{"enable_timing": True, "blocking": True}]


def test_the_ema_update_is_the_step_s_compute_not_averaging(ring):
    """With one consumer nothing is exchanged, yet the EMA update after each averaging read as 1.1% "averaging":
    it is work on the averaged model, timed as the step's compute."""
    from types import SimpleNamespace

    from stoker.pipeline.messages import StepReport

    ops = FakeOps()
    replica = _replica_on(ops, ring)
    replica.ema = SimpleNamespace(update=lambda model, step: ops.work(0.010))  # 10 ms of the device's time
    _train(replica, ops, 1)
    report = next(m for m in replica.outbox.sent if isinstance(m, StepReport))
    assert report.averaging_s == pytest.approx(0.0) and report.compute_s == pytest.approx(0.010)


def test_a_gpu_step_starts_before_the_input_s_normalization(ring):
    """The step's start event is recorded once the compute stream waits for the copy, before the normalization
    kernels: their device time is the step's compute, not an idle gap charged to input or host."""
    ops = FakeOps()
    replica = _replica_on(ops, ring)
    fed, normalize = replica.clock.fed, replica.loader._normalize
    replica.clock.fed = lambda: (ops.log.append(("fed",)), fed())[1]
    replica.loader._normalize = lambda pixels: (ops.log.append(("normalize",)), normalize(pixels))[1]
    for log in _train(replica, ops, 3):
        kinds = [entry[:2] for entry in log]
        assert kinds.index(("wait", "compute")) < kinds.index(("fed",)) < kinds.index(("normalize",))

"""The producer processes: start, feed, watch, replace, retire.

Each producer has its own part queue with at most `max_in_flight` parts (`MAX_IN_FLIGHT` unless the driver says
otherwise), so the pool always knows which parts a producer holds: when one dies or hangs, exactly those (however
many) are re-issued. A producer killed from outside (SIGKILL, SIGTERM) gets its work re-issued as it was; one
that crashed (a segfault, an abort) or hung on a file gets the file it was decoding skipped and listed, so the
same file cannot take down its replacement. The kernel's OOM killer also sends SIGKILL: a batch whose producers
are killed from outside twice on the same file (the status row names the file each was decoding) gets that file
skipped too, instead of being re-issued until the pool gives up.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass, field, replace
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Literal

from stoker.common import zygote
from stoker.common.procs import CONTEXT, Mailbox, StokerRunError, describe_exit, start, stop_processes
from stoker.common.terminal import printable
from stoker.data.formats.user_dataset import DatasetSource
from stoker.data.pixels.imaging import UNREADABLE
from stoker.pipeline.producer import STATUS_IDLE, Part, PartDone, ProducerSetup, nice_producer, producer_main
from stoker.pipeline.ring import SlotRing

log = logging.getLogger(__name__)

# One being built, one waiting: a producer never idles between parts while its driver reads completions as they come
# (the controller). A driver that reads them only now and then (the Loader, inside next()) asks for more.
MAX_IN_FLIGHT = 2
# Where samples come over a network, a producer holds this many: their reads go out together when it takes them
# (`producer._take_ahead`), so a part waits one round trip while the parts before it decode. With 2, one producer
# reading 25 ms away kept two CPU consumers waiting 12-24% until auto forked a second, 4.4-6.3 s into a run of 5 s
# of training (0.79-0.91 of local disk); with 6 they waited 0.1% (0.90-0.95): docs/benchmarks.md, remote shards.
NETWORK_IN_FLIGHT = 6
StartMethod = Literal["zygote", "spawn"]
RETIRED_REPORTS_GRACE_S = 5.0
# A crash loop (every new producer dies at once) ends the run; losses spread over a long run never do.
MAX_LOSSES_WITHOUT_PROGRESS = 8
_EXTERNAL_SIGNALS = (-signal.SIGKILL, -signal.SIGTERM, -signal.SIGINT)
# Outside kills on one file of one batch before it is skipped: one may be chance (an operator, a memory-hungry
# neighbour the OOM killer spared); the same file again in a rebuilt batch is the file.
OUTSIDE_KILLS_TO_SKIP = 2
# A producer not yet ready this long after its fork (its imports, its user dataset's unpickling) is stuck, not slow:
# the slowest start seen, a dataset unpickled with torch's imports on a loaded 2-core machine, took over 20 s.
STARTUP_TIMEOUT_S = 300.0


def parts_held(source: object) -> int:
    """The parts a producer of `source` may hold: deeper where its samples come over a network."""
    return NETWORK_IN_FLIGHT if getattr(source, "streamed", False) else MAX_IN_FLIGHT


@dataclass
class Handle:
    producer: int
    process: BaseProcess
    parts: Queue[Part | None]
    in_flight: dict[int, Part] = field(default_factory=dict)
    retiring: bool = False
    busy_s: float = 0.0
    read_s: float = 0.0  # of busy_s, reading files
    parts_done: int = 0
    working_since: float | None = None  # time.monotonic() when its first part was done
    ready_since: float | None = None  # when it first waited for a part or began one: before, it was importing
    forked_ns: int = 0  # time.monotonic_ns() of the status row the pool wrote at the fork: the producer's own is later
    exited_ns: int | None = None  # when a retiring producer was first seen exited cleanly


@dataclass(frozen=True)
class LostProducer:
    """A producer that died or hung, what it was doing, and the parts to build again."""

    message: str
    reissue: list[Part]


class ProducerPool:
    def __init__(self, setup: ProducerSetup, ring: SlotRing, mailbox: Mailbox, stop, capacity: int, *,
                 producer_timeout_s: float, max_in_flight: int = MAX_IN_FLIGHT, start_method: StartMethod = "zygote"
                 ) -> None:
        """`start_method`: producers forked from the zygote, or spawned as new interpreters (`stoker bench start`'s
        baseline)."""
        assert max_in_flight >= 1, max_in_flight
        self.start_method = start_method
        self.setup = setup
        self.max_in_flight = max_in_flight  # parts a producer holds at most: all of them re-issued if it is lost
        self.ring = ring
        self.mailbox = mailbox
        self.stop = stop
        self.capacity = capacity  # status rows in the ring: the most producers alive at once
        self.producer_timeout_s = producer_timeout_s
        self.handles: dict[int, Handle] = {}
        self.losses_since_progress = 0
        self.stuck_starts = 0  # producers lost for a start that never ended
        self.any_started = False  # whether one producer of this pool ever was ready
        self.max_alive = 0
        self.zygote_lease = zygote.Lease()  # this pool's hold on the producers' zygote (from its first producer on)
        self.outside_kills: dict[tuple, int] = {}  # (batch key, sample id) -> producers killed from outside on it
        # (kind, sample id) -> why: files that took a producer down, or that it could not decode, stay skipped in
        # later epochs, without another loss, decode or warning
        self.unusable: dict[tuple[str, int], str] = {}

    @property
    def active(self) -> list[Handle]:
        return [h for h in self.handles.values() if not h.retiring]

    def grow(self) -> int | None:
        """Start a producer in a free status row; None when every row is held (a retiring producer keeps its row
        until it has exited and been reaped, while the autoscaler counts only active ones): ask again later."""
        self._reap_retired()
        free = set(range(self.capacity)) - set(self.handles)
        if not free:
            log.info("no producer row free while %d producer(s) retire; not growing now",
                     len(self.handles) - len(self.active))
            return None
        producer = min(free)
        forked_ns = time.monotonic_ns()
        self.ring.status[producer] = (STATUS_IDLE, 0, forked_ns)
        forker = self._zygote()
        if forker is not None and not self.zygote_lease.held:
            self.zygote_lease = forker.acquire()
        context = forker.context if forker is not None else CONTEXT
        parts = context.Queue(self.max_in_flight + 1)
        outbox = self.mailbox.open()
        try:
            process = start(producer_main, (producer, self.setup, parts, outbox, self.stop),
                            f"stoker producer {producer}", context)
        except (EOFError, ConnectionError) as error:  # the zygote died before it could fork
            outbox.close()
            raise StokerRunError((forker or zygote.PRODUCERS).ended_before_forking(error)) from None
        if process.pid is not None:
            nice_producer(process.pid)
        outbox.close()  # the producer holds its end now; ours would keep the pipe from reading as closed
        self.handles[producer] = Handle(producer, process, parts, forked_ns=forked_ns)
        self.max_alive = max(self.max_alive, len(self.active))
        return producer

    def _zygote(self) -> zygote.Zygote | None:
        """The zygote producers are forked from (None: spawned): the one that imports the main script where they
        read a user's dataset."""
        if self.start_method != "zygote":
            return None
        return zygote.for_producers(any(isinstance(s, DatasetSource) for s in (self.setup.train, self.setup.val)))

    def shrink(self, newest: bool = False) -> bool:
        """Retire the least busy producer (or the newest: a fork that did not pay); it finishes what it holds,
        then exits. Nothing is lost."""
        if len(self.active) <= 1:
            return False
        handle = self.active[-1] if newest else min(self.active, key=lambda h: len(h.in_flight))
        handle.retiring = True
        handle.parts.put(None)
        return True

    def idle_share(self) -> float:
        """The share of the active producers holding no part."""
        active = self.active
        return sum(1 for h in active if not h.in_flight) / len(active) if active else 0.0

    def can_take(self) -> bool:
        return any(len(h.in_flight) < self.max_in_flight for h in self.active)

    def assign(self, part: Part) -> None:
        part = self._skip_known_unusable(part)
        handle = min(self.active, key=lambda h: len(h.in_flight))
        handle.in_flight[part.part_id] = part
        handle.parts.put(part)

    def finished(self, done: PartDone) -> Part | None:
        handle = self.handles.get(done.producer)
        if handle is None:
            return None  # a producer declared dead managed to report: its part was already re-issued
        handle.busy_s += done.busy_s
        handle.read_s += done.read_s
        handle.parts_done += 1
        if handle.working_since is None:
            handle.working_since = time.monotonic()
            began = handle.working_since - done.busy_s
            handle.ready_since = began if handle.ready_since is None else min(handle.ready_since, began)
        self.losses_since_progress = 0
        part = handle.in_flight.pop(done.part_id, None)
        if part is not None and self.outside_kills:
            self.outside_kills = {k: n for k, n in self.outside_kills.items() if k[0] != part.part_key}
        return part

    def check(self) -> list[LostProducer]:
        """Reap retired producers; report dead or hung ones with the parts they held."""
        losses = []
        now = time.monotonic_ns()
        self._reap_retired()
        self._note_ready()
        self.any_started = self.any_started or any(h.ready_since is not None for h in self.handles.values())
        for handle in list(self.handles.values()):
            process = handle.process
            if self._retired_with_reports_in_its_pipe(handle, now):
                continue
            if not process.is_alive():
                losses.append(self._lose(handle, describe_exit(process), process.exitcode in _EXTERNAL_SIGNALS))
            elif self._hung(handle, now):
                process.kill()
                process.join(timeout=5)
                losses.append(self._lose(handle, f"hung for over {self.producer_timeout_s:.0f} s", False))
            elif self._stuck_starting(handle, now):
                process.kill()
                process.join(timeout=5)
                losses.append(self._lose_at_start(handle))
        return losses

    def _stuck_starting(self, handle: Handle, now: int) -> bool:
        """Not ready (`_note_ready` ran at the top of `check`: its status row still holds what the pool wrote at the
        fork) this long after the fork."""
        return handle.ready_since is None and (now - handle.forked_ns) / 1e9 > STARTUP_TIMEOUT_S

    def _lose_at_start(self, handle: Handle) -> LostProducer:
        """A stuck start is replaced. A second one before any producer of the pool has started says the next would
        be stuck the same way (an import or a dataset that never loads): the run ends then, not after
        MAX_LOSSES_WITHOUT_PROGRESS waits. One alone may be a producer that started slower than the others."""
        self.stuck_starts += 1
        loss = self._lose(handle, f"was stuck starting for over {STARTUP_TIMEOUT_S:.0f} s (importing, or "
                                  "unpickling its dataset)", False)
        if not self.any_started and self.stuck_starts >= 2:
            raise StokerRunError(f"{loss.message}; {self.stuck_starts} producers stuck starting and none started, "
                                 "giving up (an import or a dataset's __setstate__ that never returns?)")
        return loss

    def _retired_with_reports_in_its_pipe(self, handle: Handle, now: int) -> bool:
        """A retiring producer exits (code 0) right after sending its last results, which the mailbox may not
        have read yet: not a loss, for a grace period; it is reaped once they arrive."""
        if not (handle.retiring and handle.process.exitcode == 0):
            return False
        handle.exited_ns = handle.exited_ns or now
        return (now - handle.exited_ns) / 1e9 < RETIRED_REPORTS_GRACE_S

    def _reap_retired(self) -> None:
        """Free the rows of retired producers that finished their work and exited."""
        for handle in list(self.handles.values()):
            if handle.retiring and not handle.in_flight and not handle.process.is_alive():
                handle.process.join()
                del self.handles[handle.producer]

    def _hung(self, handle: Handle, now: int) -> bool:
        part_id, _, beat = self.ring.status[handle.producer]
        return part_id != STATUS_IDLE and (now - beat) / 1e9 > self.producer_timeout_s

    def _lose(self, handle: Handle, how: str, external: bool) -> LostProducer:
        del self.handles[handle.producer]
        handle.process.join(timeout=1.0)  # reap it now: a dead producer must not linger as a zombie
        handle.parts.cancel_join_thread()
        self.losses_since_progress += 1
        part_id, position, _ = self.ring.status[handle.producer].tolist()
        current = handle.in_flight.get(part_id)
        where = "while idle" if handle.ready_since is not None else "before its first part"
        reissue = list(handle.in_flight.values())
        if current is not None and current.compact:
            where = "while compacting a batch"  # no file to blame: moving rows within a slot
        elif current is not None:
            sample = int(current.batch_plan.sample_ids[position])
            source = self.setup.train if current.batch_plan.kind == "train" else self.setup.val
            assert source is not None, "validation work is scheduled only when there is a validation split"
            path = source.paths[sample]
            where = f"while decoding {printable(path)}"
            reason = self._skip_reason(handle, how, external, current, sample)
            if reason is not None:
                self.unusable[(current.batch_plan.kind, sample)] = reason
                reissue = [replace(t, skip={**t.skip, sample: reason}) if t is current else t for t in reissue]
        message = f"producer {handle.producer} (pid {handle.process.pid}) {how} {where}"
        if self.losses_since_progress > MAX_LOSSES_WITHOUT_PROGRESS:
            raise StokerRunError(f"{message}; {self.losses_since_progress} producers lost in a row without a "
                                 "batch finished in between, giving up")
        return LostProducer(message, reissue)

    def remember_unusable(self, kind: str, skipped: dict[int, str]) -> None:
        """Files a producer could not decode: later parts skip them without reading them again. One it could not
        read is not remembered: a read error (EIO, EMFILE) may pass."""
        self.unusable.update(((kind, sample), reason) for sample, reason in skipped.items()
                             if not reason.startswith(UNREADABLE))

    def _skip_known_unusable(self, part: Part) -> Part:
        if not self.unusable or part.compact:
            return part
        kind = part.batch_plan.kind
        samples = part.batch_plan.sample_ids[part.first:part.end].tolist()
        known = {s: self.unusable[(kind, s)] for s in samples if (kind, s) in self.unusable}
        return replace(part, skip={**known, **part.skip}) if known else part

    def _skip_reason(self, handle: Handle, how: str, external: bool, current: Part, sample: int) -> str | None:
        """Why to skip the file a lost producer was decoding, or None to build its batch again unchanged."""
        who = f"producer {handle.producer} (pid {handle.process.pid}) {how}"
        if not external:
            return f"{who} on this file"
        key = (current.part_key, sample)
        self.outside_kills[key] = kills = self.outside_kills.get(key, 0) + 1
        if kills < OUTSIDE_KILLS_TO_SKIP:
            return None
        del self.outside_kills[key]
        return f"{who} on this file, {kills} producers in a row (out of memory? the OOM killer sends SIGKILL)"

    def starting(self) -> int:
        """Active producers still importing, or on their first part. One that is ready and was given no part is
        idle, not starting: the ring may have fewer parts in flight than producers (`parts_per_batch`)."""
        return sum(1 for h in self.active if h.ready_since is None or (h.in_flight and h.working_since is None))

    def all_working_since(self) -> float | None:
        """When the last of the active producers given work finished its first part (None: one has not yet)."""
        times = [h.working_since for h in self._given_work()]
        return None if not times or None in times else max(t for t in times if t is not None)

    def _given_work(self) -> list[Handle]:
        return [h for h in self.active if h.working_since is not None or h.in_flight]

    def take_utilization(self, elapsed_s: float) -> tuple[float, float, float]:
        """Since the last call (which starts a new window): the producers' busy share, their busy seconds and the
        seconds of it they spent reading files. A producer counts from when it was ready: 16 forked at once spend
        seconds importing, and counted idle they made the verdict say "producers idle: they lack work" of producers
        busy 96% of the time once started."""
        self._note_ready()
        window_start = time.monotonic() - elapsed_s
        busy = sum(h.busy_s for h in self.handles.values())
        read = sum(h.read_s for h in self.handles.values())
        ready_s = sum(elapsed_s - min(elapsed_s, max(0.0, h.ready_since - window_start))
                      for h in self.handles.values() if h.ready_since is not None)
        for handle in self.handles.values():
            handle.busy_s = handle.read_s = 0.0
        return (busy / ready_s if ready_s > 0 else 0.0), busy, read

    def _note_ready(self) -> None:
        """A producer past its imports writes its status row while it waits for a part: one that no part reached
        (every slot's parts already held by others) is ready, and idle, all the same."""
        for handle in self.handles.values():
            if handle.ready_since is None:
                beat_ns = int(self.ring.status[handle.producer][2])
                if beat_ns > handle.forked_ns:
                    handle.ready_since = beat_ns / 1e9

    def close(self, timeout_s: float = 5.0) -> None:
        """Idempotent: tell every producer to stop, join, terminate stragglers, release the queues."""
        handles, self.handles = list(self.handles.values()), {}
        for handle in handles:
            handle.parts.cancel_join_thread()
        stop_processes([h.process for h in handles], timeout_s, kill_loses_nothing=True)
        for handle in handles:
            handle.parts.close()
        self.zygote_lease.release()

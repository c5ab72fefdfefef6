"""The producers' figures over a run: how busy they were, what kept them busy, how long they idled for a free
slot, how their count moved and how fast auto answered. The engine feeds them; the verdict, the live view and
the summary read them. Nothing here routes work."""

from __future__ import annotations

import time
from typing import Any, Protocol

from stoker.pipeline.autoscaler import Window, plain_need
from stoker.pipeline.producer import FeedCost

FEED_STAGES = ("read", "draw", "decode", "resize", "augment")


class EventLog(Protocol):
    """Where events go (`observe.metrics.MetricsLog` is one)."""

    def write(self, event: str, **fields: Any) -> None: ...


class ProducerGauges:
    def __init__(self, budget: int, events: EventLog) -> None:
        self.budget = budget
        self.events = events
        self.started = time.monotonic()
        self.producers_initial = 0
        self.timeline: list[dict[str, Any]] = []
        self.producer_busy = (0.0, 0.0)  # (busy producer-seconds per producer, seconds): utilization over the run
        self.producer_reading = (0.0, 0.0)  # (producer-seconds reading files, busy producer-seconds) over the run
        self.window_read_share = 0.0
        # Producer-seconds per producer spent idle while a batch waited for a free slot (from training on): the
        # verdict's evidence that the slots, not the producers, are the limit.
        self.slot_bound_s = 0.0
        self._slot_bound: tuple[float, float] | None = None  # (since, the share of producers idle then)
        self.last_window = (0.0, 0.0, 0.0, 0.0)  # the latest window's (busy, seconds, reading, busy producer-s)
        self.training = False  # a window with training steps has been seen: run totals count from then on
        # How fast auto answers: when a window first showed a plain need, and when the first fork came.
        self.plain_need_s: float | None = None
        self.first_fork_s: float | None = None
        self.feed_cost = FeedCost()  # the producers' CPU by stage over the training images they made

    def since_start(self, when: float) -> float:
        return round(when - self.started, 3)

    # ---- fed by the engine ----------------------------------------------------------------------------------------

    def take_window(self, elapsed_s: float, utilization: float, busy_s: float, read_s: float) -> float:
        """The pool's figures for the window that ends now; the share of busy time spent reading files is kept for
        the window's measurement and the verdict. Returns the utilization, at most 1."""
        utilization = min(1.0, utilization)
        self.last_window = (utilization * elapsed_s, elapsed_s, read_s, busy_s)
        self.window_read_share = min(1.0, read_s / busy_s) if busy_s > 0 else 0.0
        if self.training:
            self._count_window()
        return utilization

    def training_began(self) -> None:
        """A window in which consumers trained: run totals count from it on (before it, producers idle on a full
        ring while consumers start, and the verdict sets the totals beside the consumers' wait after their first
        batch)."""
        if not self.training:
            self.training = True
            self._count_window()

    def _count_window(self) -> None:
        busy, seconds, read_s, busy_s = self.last_window
        self.last_window = (0.0, 0.0, 0.0, 0.0)
        self.producer_busy = (self.producer_busy[0] + busy, self.producer_busy[1] + seconds)
        self.producer_reading = (self.producer_reading[0] + read_s, self.producer_reading[1] + busy_s)

    def note_slot_bound(self, idle_share: float) -> None:
        """The share of producers idle for a free slot, from now until the next dispatch: under the controller a
        finished part or a taken batch, each followed by one, changes it; the Loader dispatches in `next()`, so
        between its calls the state is the one seen when the user's step began (an underestimate: producers that
        finish meanwhile idle uncounted)."""
        now = time.monotonic()
        if self._slot_bound is not None and self.training:
            since, share = self._slot_bound
            self.slot_bound_s += (now - since) * share
        self._slot_bound = (now, idle_share) if idle_share > 0 else None

    def note_decision(self, window: Window, change: int, ended_s: float) -> None:
        if self.plain_need_s is None and plain_need(window):
            self.plain_need_s = self.since_start(ended_s)
        if self.first_fork_s is None and change > 0:
            self.first_fork_s = self.since_start(ended_s)

    def record_producers(self, reason: str, count: int, measurement: dict[str, Any] | None = None) -> None:
        behind = {"measurement": measurement} if measurement else {}
        self.timeline.append({"t": self.since_start(time.monotonic()), "producers": count, "reason": reason,
                              **behind})
        self.events.write("producers", count=count, reason=reason, **behind)

    # ---- read by the verdict, the live view and the summary -------------------------------------------------------

    def feed_ms_per_image(self) -> dict[str, float] | None:
        """CPU milliseconds per training image, by stage, `other` (bookkeeping, the clocks, other threads) and
        `total` (the producers' CPU time as the OS counts it); None before a training image was made."""
        cost = self.feed_cost
        if not cost.images:
            return None
        stages = {stage: getattr(cost, stage) for stage in FEED_STAGES}
        per_image = {**stages, "other": max(0.0, cost.total - sum(stages.values())), "total": cost.total}
        return {name: round(seconds * 1000 / cost.images, 4) for name, seconds in per_image.items()}

    def producer_utilization(self) -> float:
        busy, seconds = self.producer_busy
        return busy / seconds if seconds else 0.0

    def producer_read_share(self) -> float:
        """Of the producers' busy time over the run, the share spent reading files (storage, not the CPU)."""
        read, busy = self.producer_reading
        return min(1.0, read / busy) if busy else 0.0

    def producer_slot_bound(self) -> float:
        """The share of the producers' time (from training on) spent idle while a batch waited for a free slot."""
        seconds = self.producer_busy[1]
        return min(1.0, self.slot_bound_s / seconds) if seconds else 0.0

    def verdict_fields(self, limit: int) -> dict[str, Any]:
        """The count of now against the limit of now (`limit`), how busy they were and what kept them busy."""
        return {"producers": self.timeline[-1]["producers"] if self.timeline else 0,
                "producer_budget": limit, "producer_utilization": self.producer_utilization(),
                "producer_ceiling": self.budget, "producer_read_share": self.producer_read_share(),
                "producer_slot_bound": self.producer_slot_bound(),
                "feed_ms_per_image": (self.feed_ms_per_image() or {}).get("total")}

    def summary_fields(self, max_alive: int) -> dict[str, Any]:
        """The summary's producer counts, and how fast auto answered a plain need: seconds into the run of the
        first window that showed one and of the first fork."""
        return {"producers_initial": self.producers_initial,
                "producers_final": self.timeline[-1]["producers"] if self.timeline else 0,
                "producers_max": max_alive, "producers_timeline": self.timeline,
                "autoscale_plain_need_s": self.plain_need_s, "autoscale_first_fork_s": self.first_fork_s,
                "feed_cpu_ms_per_image": self.feed_ms_per_image()}

    @staticmethod
    def no_fields() -> dict[str, Any]:
        """`summary_fields` of a run that stopped before the engine started."""
        return {"producers_initial": 0, "producers_final": 0, "producers_max": 0, "producers_timeline": [],
                "autoscale_plain_need_s": None, "autoscale_first_fork_s": None, "feed_cpu_ms_per_image": None}

"""When to fork another producer and when to retire one: measured, not assumed.

Every window the controller reports how long consumers waited for input, their training rate (samples per second
of the time they spent in training steps, so a validation pass or a checkpoint does not read as a slowdown), how
full the ready queues were and how busy producers were. The policy forks while consumers wait and the last fork
raised the rate; a fork that did not pay is retired (the newest producer) and the count it reached becomes the
limit for a while, after which it tries again (a workload can change). Producers may outnumber the cores the
consumers leave free: a consumer that waits for input does not use its core. Nothing a fork does goes untested:
if it slowed busy consumers (CPU consumers competing for cores, a GPU consumer's feeding thread), the rate falls
and it is retired; a consumer that does not wait never gets another producer. Queues that stay full while
producers idle retire one too.

The policy holds no clock and touches no process: windows in, decisions out, so recorded measurements replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

STALL_HIGH = 0.05  # consumers waiting more than this share of their time want another producer
STALL_LOW = 0.01
QUEUE_FULL = 0.75
IDLE_UTILIZATION = 0.5
MIN_GAIN = 0.02  # a fork pays when the rate rises by this much at least (the noise of a few windows) ...
SHARE_OF_PROPORTIONAL = 0.25  # ... and by a quarter of what one more producer adds if the rate were proportional,
SHARE_OF_WAIT = 0.5  # or by half of what ending the consumers' wait could add, whichever is smaller
SETTLE_WINDOWS = 1  # after a change: the new producer starts, the queues refill
STARTUP_WINDOWS = 2  # the ring is full when training starts: its first seconds measure the ring, not the producers
MEASURE_WINDOWS = 2  # windows at one count that make its rate ...
MEASURE_STEPS = 8  # ... with at least this many training steps in them (slow steps: more windows)
KEEP_WINDOWS = 10  # the rate at a count is measured over its latest windows, at most these
RETRY_WINDOWS = 10  # how long an unpaid count stays the limit; doubles after every fork that fails again
GPU_FEED_CORES = 0.5  # a GPU consumer's feeding thread and NCCL's progress thread: part of a core, never zero
OVERSUBSCRIBE = 3  # auto's default ceiling, in producers per core: reached only fork by measured fork


def static_budget(devices: list[str], cores: int) -> int:
    """The producers that fit the cores consumers leave free: a CPU consumer takes a core, a GPU consumer
    `GPU_FEED_CORES` for feeding its device. Never fewer than 1."""
    cpu_consumers = sum(1 for d in devices if not d.startswith("cuda"))
    gpu_consumers = len(devices) - cpu_consumers
    return max(1, cores - cpu_consumers - math.ceil(GPU_FEED_CORES * gpu_consumers))


def default_ceiling(budget: int, cores: int) -> int:
    """The most producers auto may run unless --max-producers says otherwise."""
    return max(budget, OVERSUBSCRIBE * cores)


@dataclass(frozen=True)
class Window:
    stall: float  # input wait / consumer wall time over the window, mean over consumers
    queue_fill: float  # ready batches / ready slots, mean over the window
    utilization: float  # producer busy time / (window x producers)
    producers: int
    samples: int = 0  # training samples consumed in the window, all consumers
    steps: int = 0  # training steps reported in the window, all consumers
    train_s: float = 0.0  # seconds the consumers spent in training steps (wait included), mean over consumers

    @property
    def rate(self) -> float:
        return self.samples / self.train_s if self.train_s > 0 else 0.0


@dataclass(frozen=True)
class Decision:
    change: int  # +1, -1 or 0
    reason: str
    retire_newest: bool = False  # -1 of a fork that did not pay: the newest goes, not the least busy
    measurement: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Trial:
    producers: int  # the count before the fork
    rate_before: float
    stall_before: float


def _rate(windows: list[Window]) -> float:
    train_s = sum(w.train_s for w in windows)
    return sum(w.samples for w in windows) / train_s if train_s > 0 else 0.0


def required_gain(producers_before: int, stall_before: float) -> float:
    """Relative rise a fork from `producers_before` must bring: smaller as the count grows (one more of many adds
    little even when it pays) and as the wait left shrinks (ending a wait of s raises the rate by s / (1 - s) at
    most), never below MIN_GAIN."""
    stall = min(max(stall_before, 0.0), 0.95)
    return max(MIN_GAIN, min(SHARE_OF_PROPORTIONAL / max(1, producers_before), SHARE_OF_WAIT * stall / (1 - stall)))


class Autoscaler:
    def __init__(self, minimum: int, budget: int, ceiling: int | None = None, startup_windows: int = 0) -> None:
        self.minimum = minimum
        self.budget = budget  # what fits the free cores: shown, not a limit
        self.ceiling = max(budget, ceiling or budget)
        self.limit = self.ceiling  # lowered to a count whose fork did not pay, until `_hold` runs out
        self._hold = 0
        self._retry_windows = RETRY_WINDOWS
        self._settling = startup_windows
        self._settling_reason = "start-up: the batches the ring held before training began are being drained"
        self._measured: list[Window] = []  # windows at the current count, after settling
        self._trial: _Trial | None = None
        self._calm_windows = 0

    def decide(self, window: Window) -> Decision:
        self._count_down_hold()
        summary = (f"stall {window.stall:.1%}, {window.rate:.1f} samples/s, queue {window.queue_fill:.0%} full, "
                   f"producers {window.utilization:.0%} busy")
        measurement = {"stall": round(window.stall, 4), "samples_per_s": round(window.rate, 2),
                       "queue_fill": round(window.queue_fill, 4), "utilization": round(window.utilization, 4),
                       "producers": window.producers, "limit": self.limit}
        if self._settling > 0:
            self._settling -= 1
            return Decision(0, f"{self._settling_reason}; {summary}", measurement=measurement)
        self._measured = [*self._measured, window][-KEEP_WINDOWS:]
        measured = (len(self._measured) >= MEASURE_WINDOWS
                    and sum(w.steps for w in self._measured) >= MEASURE_STEPS)
        rate = _rate(self._measured)
        measurement["rate_at_count"] = round(rate, 2)
        if self._trial is not None:
            if not measured:
                return Decision(0, f"measuring the fork to {window.producers}; {summary}", measurement=measurement)
            verdict = self._judge_trial(window, rate, measurement)
            if verdict is not None:
                return verdict
        if window.stall > STALL_HIGH:
            return self._maybe_fork(window, rate, measured, summary, measurement)
        calm = window.stall < STALL_LOW and window.queue_fill > QUEUE_FULL and window.utilization < IDLE_UTILIZATION
        self._calm_windows = self._calm_windows + 1 if calm else 0
        if self._calm_windows >= 2 and window.producers > self.minimum:
            return self._change(-1, f"queues full, producers idle: {summary}", measurement)
        return Decision(0, summary, measurement=measurement)

    def _judge_trial(self, window: Window, rate: float, measurement: dict[str, Any]) -> Decision | None:
        """A fork has been measured: keep it if the rate rose enough, else retire the newest and hold the count."""
        trial, self._trial = self._trial, None
        assert trial is not None, "judged only while a fork is on trial"
        gain = rate / trial.rate_before - 1 if trial.rate_before > 0 else math.inf
        needed = required_gain(trial.producers, trial.stall_before)
        measurement.update(rate_before=round(trial.rate_before, 2), gain=round(gain, 4), gain_needed=round(needed, 4))
        if gain >= needed:
            return None  # it paid: carry on, maybe fork again at once
        self.limit = trial.producers
        self._hold = self._retry_windows
        self._retry_windows *= 2
        reason = (f"the fork to {window.producers} did not pay: {trial.rate_before:.1f} -> {rate:.1f} samples/s "
                  f"({gain:+.1%}, needed {needed:+.1%}); back to {trial.producers} for {self._hold} windows")
        return self._change(-1, reason, measurement, retire_newest=True)

    def _maybe_fork(self, window: Window, rate: float, measured: bool, summary: str,
                    measurement: dict[str, Any]) -> Decision:
        if window.producers >= self.limit:
            held = "the most that paid" if self.limit < self.ceiling else "the ceiling"
            return Decision(0, f"at {held} ({self.limit} producers); {summary}", measurement=measurement)
        if not measured:
            return Decision(0, f"measuring {window.producers} producers; {summary}", measurement=measurement)
        past = " (past the free cores: consumers wait, so they leave theirs idle)" \
            if window.producers >= self.budget else ""
        stall = sum(w.stall for w in self._measured) / len(self._measured)
        self._trial = _Trial(window.producers, rate, stall)
        return self._change(+1, f"consumers wait: {summary}; forking{past}", measurement)

    def fork_refused(self) -> None:
        """The pool could not fork now (a retiring producer still holds its row until it exits): there is no
        trial to judge and nothing to settle; the next window asks again."""
        self._trial = None
        self._settling = 0

    def _count_down_hold(self) -> None:
        if self._hold > 0:
            self._hold -= 1
            if self._hold == 0:
                self.limit = self.ceiling

    def _change(self, change: int, reason: str, measurement: dict[str, Any], retire_newest: bool = False) -> Decision:
        self._settling, self._settling_reason = SETTLE_WINDOWS, "settling after a change"
        self._measured = []
        self._calm_windows = 0
        return Decision(change, reason, retire_newest, measurement)

"""When to fork another producer and when to retire one: measured, not assumed.

A consumer that waits for input does not use its core, so the core count cannot say how many producers pay. Each
1-second window the controller reports the consumers' wait and training rate, the queues' fill and how busy the
producers were; the policy forks while consumers wait, keeps a fork only when it raised the rate, and retires what did
not pay or sits idle. It holds no clock and touches no process: windows in, decisions out, so recorded measurements
replay in unit tests. The rules and their figures: docs/producers.md, "Producer autoscaling"."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any

STALL_HIGH = 0.05  # consumers waiting more than this share of their time want another producer
STALL_LOW = 0.01
QUEUE_FULL = 0.75
IDLE_UTILIZATION = 0.5
PLAIN_STALL = 0.4  # consumers waiting much of a window (the first one starts on the ring's batches) ...
PLAIN_BUSY = 0.9  # ... while every producer is busy: the need is plain, fork at once, by more than one
READ_BOUND = 0.5  # producers reading files more than this share of their busy time wait on storage (the verdict's
# SLOW_READS): forked past the free cores before the first step, they need no judgement there
JUMP_MAX = 16  # a plain need multiplies the count by at most this (a jump that does not pay is retired whole):
# the need's estimate decides (a 99% wait with one producer reading at 25 ms wanted 16 at once), not steps of x4
MIN_GAIN = 0.02  # a fork pays when the rate rises by this much at least (the noise of a few windows) ...
NOISE_SIGMAS = 3.0  # ... or, for one fork, by this many standard errors of the two rates' difference (3, not
# a normal 2: a t quantile over a handful of steps is larger)
NOISE_MIN_STEPS = 5  # fewer training steps have no noise estimate
LOCKSTEP_S = 0.02  # steps of several consumers ending this close together are one step of the group
SHARE_OF_PROPORTIONAL = 0.25  # ... and by a quarter of what one more producer adds if the rate were proportional,
SHARE_OF_WAIT = 0.5  # or by half of what ending the consumers' wait could add, whichever is smaller
PACED_WAIT = 0.1  # the first step of training that waited this share of its time for its batch ends the ring's
# start-up batches: the steps before it were served at once, at the ring's pace, not the producers'
SETTLE_S = 0.5  # after a change: steps that end within this ran on batches built before it
STARTUP_WINDOWS = 2  # the ring is full when training starts: its first seconds measure the ring, not the producers
MEASURE_WINDOWS = 2  # windows at one count that make its rate ...
MEASURE_STEPS = 8  # ... with at least this many training steps in them (slow steps: more windows)
JUMP_MEASURE_STEPS = 2  # a jump of several producers is measured on fewer, in one window: it must bring a lot
MAX_STARTING_WINDOWS = 5  # forked producers not working after this many windows are measured as they are
KEEP_S = 10.0  # the rate at a count is measured over the steps that ended in its latest seconds, at most these
RETRY_WINDOWS = 10  # how long an unpaid count stays the limit; doubles after every fork that fails again
GPU_FEED_CORES = 0.5  # a GPU consumer's feeding thread and NCCL's progress thread: part of a core, never zero
OVERSUBSCRIBE = 8  # auto's default ceiling, in producers per core, where the ring is sized from the ceiling (a
# Loader's slots): producers that wait on storage use little of a core (16 on 2 cores paid 3.5x over 4 with reads
# waiting 25 ms) ...
CEILING_MAX = 128  # ... and never more than this many: every producer is a process (about 30 MB of its own memory)
# and a status row in the ring; 8 per core would be 512 on a 64-core host
MEMORY_SHARE = 0.5  # producers may take at most this share of the memory available (at the start, and at each fork)


def static_budget(devices: list[str], cores: int) -> int:
    """The producers that fit the cores consumers leave free: a CPU consumer takes a core, a GPU consumer
    `GPU_FEED_CORES` for feeding its device. Never fewer than 1."""
    cpu_consumers = sum(1 for d in devices if not d.startswith("cuda"))
    gpu_consumers = len(devices) - cpu_consumers
    return max(1, cores - cpu_consumers - math.ceil(GPU_FEED_CORES * gpu_consumers))


def start_count(minimum: int, cores: int) -> int:
    """Where auto starts when the user did not say: a producer for every core of the machine, since no consumer
    computes before the first step (at least `minimum`). Started at 1 where the cores held 2, short input-bound runs
    trained their first seconds at half the rate while the ring stayed full before the first step and gave no reason
    to fork. Decoding producers past the free cores go back to them unless a step waits (`_judge_past_free`)."""
    return max(minimum, cores)


def default_ceiling(budget: int, cores: int, ring_parts: int | None = None, memory: int | None = None,
                    producer_memory: int = 1) -> int:
    """The most producers auto may run unless --max-producers says otherwise: as many as the ring holds parts in
    flight for (`ring_parts`; one more would have nothing to build: with reads waiting 25 ms, 32 producers trained
    1.63x 16 and 64 no faster than 32 on a ring of 32 parts), within MEMORY_SHARE of the `memory` available at
    `producer_memory` each, and CEILING_MAX. Where the ring is sized from the ceiling instead (a Loader's slots,
    `ring_parts` None), OVERSUBSCRIBE per core bounds it. Never below `budget`: what the free cores run."""
    most = min(CEILING_MAX, OVERSUBSCRIBE * cores if ring_parts is None else ring_parts)
    if memory is not None:
        most = min(most, int(MEMORY_SHARE * memory) // max(1, producer_memory))
    return max(budget, most)


def time_shares(compute_s: float, wait_s: float, averaging_s: float, wall_s: float,
                host_s: float = 0.0) -> tuple[float, float, float]:
    """Device compute, input wait and averaging as shares of a consumer's wall time: the one definition behind
    the live view, the log lines, summary.json, the report and the verdict. The parts are timed on the consumer and
    the wall time on the controller, which hears of each step a message later; where the parts add up to more than
    the wall time they are shares of their sum instead, so no share passes 1 and together they never do. On a GPU
    the device's idle time for the host (`host_s`) is a part too: its share is `host_share`."""
    whole = _whole(compute_s, wait_s, averaging_s, wall_s, host_s)
    if whole <= 0:
        return 0.0, 0.0, 0.0
    return compute_s / whole, wait_s / whole, averaging_s / whole


def host_share(compute_s: float, wait_s: float, averaging_s: float, wall_s: float, host_s: float) -> float:
    """The share of a consumer's wall time its device idled for the host (Python, copies), not for input: the
    fourth part beside `time_shares`' three, of the same whole."""
    whole = _whole(compute_s, wait_s, averaging_s, wall_s, host_s)
    return host_s / whole if whole > 0 else 0.0


def _whole(compute_s: float, wait_s: float, averaging_s: float, wall_s: float, host_s: float) -> float:
    return max(wall_s, compute_s + wait_s + averaging_s + host_s)


@dataclass(frozen=True)
class StepStamp:
    """A training step as the policy judges it: when it ended, not when its report arrived (a GPU consumer reports
    steps in groups; a step that ran before a change must not count for the count after it)."""

    ended_s: float  # time.monotonic() in the consumer when the step ended: one clock for the machine's processes
    samples: int
    train_s: float  # its time in the training step, input wait included
    wait_s: float = 0.0  # of train_s, waiting for its batch
    consumer: int = -1  # which consumer stepped (-1: not known, as in a replay: grouped by time alone)


@dataclass(frozen=True)
class Window:
    stall: float  # input wait / consumer wall time over the window, mean over consumers (`input_stall` judges)
    queue_fill: float  # ready batches / ready slots, mean over the window
    utilization: float  # producer busy time / (window x producers)
    producers: int
    samples: int = 0  # training samples consumed in the window, all consumers
    steps: int = 0  # training steps reported in the window, all consumers
    train_s: float = 0.0  # seconds the consumers spent in training steps (wait included), mean over consumers
    ended_s: float | None = None  # when the window closed, on the stamps' clock; None: a replay, 1 s a window
    stamps: tuple[StepStamp, ...] = ()  # the steps reported in the window; none: its totals count as one stamp
    starting: int = 0  # producers forked and not yet done with their first part
    working_since: float | None = None  # when the last producer started working (the count's real start)
    read_share: float = 0.0  # of the producers' busy time, the share spent reading files (off the CPU)
    lockstep: bool = True  # the consumers average every step, so one's wait for input holds the others
    taken: bool = True  # a consumer has taken a batch (False: every consumer is still starting)

    @property
    def rate(self) -> float:
        return self.samples / self.train_s if self.train_s > 0 else 0.0

    @functools.cached_property
    def input_stall(self) -> float:
        """The stall judged in lockstep from the window's steps (`lockstep_stall`); without steps, or with consumers
        that step on their own between averages (`--sync-every` over 1, overlapped averaging), `stall`."""
        judged = self.lockstep and any(s.train_s > 0 for s in self.stamps)
        return lockstep_stall(list(self.stamps)) if judged else self.stall


@dataclass(frozen=True)
class Decision:
    change: int  # producers to fork (> 0), to retire (< 0), or 0
    reason: str
    retire_newest: bool = False  # the retirement of a fork that did not pay: the newest go, not the least busy
    measurement: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Trial:
    producers: int  # the count before the fork
    added: int
    rate_before: float  # at start-up: the rate of the window that showed the plain need
    stall_before: float
    error_before: float = math.inf  # relative standard error of rate_before (inf: too few steps to say)


def _rate(steps: list[StepStamp]) -> float:
    train_s = sum(s.train_s for s in steps)
    return sum(s.samples for s in steps) / train_s if train_s > 0 else 0.0


def relative_error(steps: list[StepStamp]) -> float:
    """The standard error of `_rate(steps)` relative to it, from how much the steps' own rates vary (a ratio
    estimate: each step's samples against its time). Consumers averaging together step in lockstep: their steps
    that end together are one observation, not several. inf below NOISE_MIN_STEPS, where there is nothing to say."""
    groups = _lockstep_groups(steps)
    n = len(groups)
    rate = _rate(steps)
    time_s = sum(t for _, t in groups)
    if n < NOISE_MIN_STEPS or rate <= 0 or time_s <= 0:
        return math.inf
    spread = sum((samples - rate * t) ** 2 for samples, t in groups) / (n - 1)
    return math.sqrt(spread / n) / (time_s / n) / rate


def _lockstep_groups(steps: list[StepStamp]) -> list[tuple[int, float]]:
    """(samples, seconds) of each group of steps that ended within LOCKSTEP_S of the group's first."""
    return [(sum(s.samples for s in group), sum(s.train_s for s in group)) for group in _in_lockstep(steps)]


def _in_lockstep(steps: list[StepStamp]) -> list[list[StepStamp]]:
    """The steps grouped by ending within LOCKSTEP_S of their group's first: one step of each consumer that
    averages with the others (a consumer's next step, however short, begins a group of its own)."""
    groups: list[list[StepStamp]] = []
    for step in sorted(steps, key=lambda s: s.ended_s):
        if groups and step.ended_s - groups[-1][0].ended_s <= LOCKSTEP_S and \
                (step.consumer < 0 or all(other.consumer != step.consumer for other in groups[-1])):
            groups[-1].append(step)
        else:
            groups.append([step])
    return groups


def lockstep_stall(steps: list[StepStamp]) -> float:
    """The share of the steps' time the group waited for input. Consumers that average step together: a step takes
    its slowest member's time, and the member that waited longest for its batch held the others in the averaging
    meanwhile (their wait there is input wait too). The mean over consumers counted that as averaging: with 2
    consumers, remote shards at 25 ms showed a stall of 44% where the wait was most of the step."""
    groups = _in_lockstep(steps)
    time_s = sum(max(s.train_s for s in group) for group in groups)
    return sum(max(s.wait_s for s in group) for group in groups) / time_s if time_s > 0 else 0.0


def required_gain(producers_before: int, stall_before: float, added: int = 1) -> float:
    """Relative rise a fork of `added` producers from `producers_before` must bring: smaller as the count grows
    (one more of many adds little even when it pays) and as the wait left shrinks (ending a wait of s raises the
    rate by s / (1 - s) at most), never below MIN_GAIN."""
    stall = min(max(stall_before, 0.0), 0.95)
    proportional = SHARE_OF_PROPORTIONAL * added / max(1, producers_before)
    return max(MIN_GAIN, min(proportional, SHARE_OF_WAIT * stall / (1 - stall)))


def plain_need(window: Window) -> bool:
    """Consumers waited most of the window while every producer was busy: more producers, no doubt about it."""
    return window.input_stall >= PLAIN_STALL and window.utilization >= PLAIN_BUSY and window.starting == 0


class Autoscaler:
    def __init__(self, minimum: int, budget: int, ceiling: int | None = None, startup_windows: int = 0,
                 cores: int | None = None, started: int | None = None) -> None:
        """`cores`: the machine's (None: not known, as in a replay: no fork is refused for filling them);
        `started`: the count auto started at by default (`start_count`), judged like a fork before the first
        step where it is past the free cores."""
        self.minimum = minimum
        self.budget = budget  # the cores the consumers leave free: not a limit on the count, but on a jump's CPU work
        self.cores = max(budget, cores or budget)  # the machine's: before the first step no consumer computes
        self._machine_known = cores is not None
        self.ceiling = max(budget, ceiling or budget)
        self.limit = self.ceiling  # lowered to a count whose fork did not pay, until `_hold` runs out
        self._hold = 0
        self._retry_windows = RETRY_WINDOWS
        self._startup = startup_windows
        self._clock = 0.0  # the latest window's end
        self._count_from = -math.inf  # steps that ended before this ran at an earlier count
        self._steps: list[StepStamp] = []  # steps at the current count, after settling
        self._stalls: list[float] = []  # the windows' stalls at the current count, after settling
        self._step_count = 0  # training steps at the current count, after settling
        self._trial: _Trial | None = None
        self._calm_windows = 0
        self._starting_windows = 0
        self._ring_served = True  # training has not yet had a step that waited for its batch
        # before the first step, forked (or started) past the free cores from this count
        self._past_free: int | None = budget if started is not None and started > budget else None

    def decide(self, window: Window) -> Decision:
        trained = window.steps > 0 and window.train_s > 0  # its rate is measured: every step it reported counts
        seen_rate = window.rate
        window = self._without_ring_steps(window)
        previous, self._clock = self._clock, window.ended_s if window.ended_s is not None else self._clock + 1.0
        self._count_down_hold()
        summary, measurement = self._described(window, seen_rate if trained else None)
        if window.starting and self._starting_windows < MAX_STARTING_WINDOWS:
            self._starting_windows += 1
            self._restart_count(self._clock)  # what ran so far ran without them
            return Decision(0, f"{window.starting} new producer(s) starting; {summary}", measurement=measurement)
        self._starting_windows = 0
        if window.working_since is not None and window.working_since + SETTLE_S > self._count_from > -math.inf:
            # Starting processes (imports) takes the cores' time: the count began when the last one worked.
            self._restart_count(window.working_since + SETTLE_S)
        if not window.taken and not trained:
            return self._before_training(window, summary, measurement)
        if self._past_free is not None and trained:
            verdict = self._judge_past_free(window, measurement)
            if verdict is not None:
                return verdict
        if self._startup > 0:
            return self._during_startup(window, summary, measurement)
        self._add_steps(window, previous)
        rate = _rate(self._steps)
        if self._steps:  # no step counted at this count yet (settling, or the ring's batches): nothing measured
            measurement["rate_at_count"] = round(rate, 2)
        if self._trial is not None:
            if not self._measured(self._trial.added > 1):
                return Decision(0, f"measuring the fork to {window.producers}; {summary}", measurement=measurement)
            verdict = self._judge_trial(window, rate, measurement)
            if verdict is not None:
                return verdict
        if window.input_stall > STALL_HIGH:
            return self._maybe_fork(window, rate, summary, measurement)
        calm = (window.input_stall < STALL_LOW and window.queue_fill > QUEUE_FULL
                and window.utilization < IDLE_UTILIZATION)
        self._calm_windows = self._calm_windows + 1 if calm else 0
        if self._calm_windows >= 2 and window.producers > self.minimum:
            return self._change(-1, f"queues full, producers idle: {summary}", measurement)
        return Decision(0, summary, measurement=measurement)

    def _described(self, window: Window, seen_rate: float | None) -> tuple[str, dict[str, Any]]:
        """The window in words and as the `autoscale` event's measurement; `seen_rate`: its samples per second
        (None: no training step measured in it)."""
        rate_text = f"{seen_rate:.1f} samples/s" if seen_rate is not None else "no training step"
        summary = (f"stall {window.input_stall:.1%}, {rate_text}, queue {window.queue_fill:.0%} full, "
                   f"producers {window.utilization:.0%} busy")
        measurement = {"stall": round(window.input_stall, 4),
                       **({"samples_per_s": round(seen_rate, 2)} if seen_rate is not None else {}),
                       "queue_fill": round(window.queue_fill, 4), "utilization": round(window.utilization, 4),
                       "read_share": round(window.read_share, 4), "producers": window.producers,
                       "limit": self.limit}
        return summary, measurement

    def _during_startup(self, window: Window, summary: str, measurement: dict[str, Any]) -> Decision:
        """The first windows of training drain the batches the ring held before it began: no count is judged
        on them, unless the consumers plainly wait."""
        self._startup -= 1
        rate = self._window_rate(window)
        if plain_need(window) and window.producers < self.limit and self._trial is None and rate > 0:
            # Even with the ring's batches drained, consumers waited most of the window: fork now. That wait
            # says the ring is empty, so start-up ends here and the windows after measure the fork like any
            # other: a second jump waits for this one's verdict, which then names the jump that did not pay.
            # (A window without steps has no rate to judge the fork against: the next one forks.)
            self._startup = 0
            measurement["rate_at_count"] = round(rate, 2)
            return self._fork(window, rate, window.input_stall, f"consumers wait from the start: {summary}",
                              measurement, self._counted(window))
        return Decision(0, "start-up: the batches the ring held before training began are being drained; "
                           f"{summary}", measurement=measurement)

    def _before_training(self, window: Window, summary: str, measurement: dict[str, Any]) -> Decision:
        """No batch taken yet: consumers are starting (importing torch, building the model) while producers fill
        the ring. Busy producers with the ring not full fork at once to what the machine's cores hold
        (`_cores_hold`; no consumer computes yet): with reads waiting 25 ms, one producer had made 60 samples/s of a
        ring that 32 fill at 980 by the first step, and every fork decided from steps came a second or more into
        training (2000x1500 photos over 12 short epochs: 0.91 of the best fixed count, 0.98 forked before). No
        trial (there is no rate yet): decoding producers past the free cores are judged when training starts
        (`_judge_past_free`); producers waiting on reads hold little of a core (READ_BOUND), and those the run does
        not need are retired by the calm rule."""
        p = window.producers
        target = min(self.limit, self._cores_hold(window, p, self.cores))
        if window.utilization < IDLE_UTILIZATION or window.queue_fill >= QUEUE_FULL or target <= p:
            return Decision(0, f"before training: {summary}", measurement=measurement)
        free = max(p, min(target, self._cores_hold(window, p)))
        if target > free and window.read_share < READ_BOUND:
            self._past_free = free if self._past_free is None else self._past_free
        measurement["target"] = target
        return self._change(target - p, f"before the first step, producers busy and the ring not full: {summary}; "
                                        f"forking to {target}, what the cores hold", measurement)

    def _judge_past_free(self, window: Window, measurement: dict[str, Any]) -> Decision | None:
        """A fork before the first step that went past the free cores (decoding producers) was not tested: kept once
        a step waits for its batch (consumers that wait leave their cores idle, as for any fork past them), retired
        back to the free cores' count once the ring's start-up windows have passed with no step waiting and the
        ring full (the consumers compute on those cores). A ring not full is still being drained: on a loaded
        machine its batches served a slow consumer for more than the start-up windows, and 3 producers went back to
        1 seconds before the steps began to wait."""
        waited = not self._ring_served or (not window.stamps and window.input_stall >= STALL_HIGH)  # (a replay)
        if waited or window.read_share >= READ_BOUND:  # producers waiting on reads hold little of a core
            self._past_free = None
            return None
        if self._startup > 0 or window.queue_fill < QUEUE_FULL:
            return None
        back, self._past_free = self._past_free, None
        assert back is not None, "judged only after a fork past the free cores"
        if window.producers <= back:
            return None
        return self._change(back - window.producers, "the fork before the first step went past the free cores and "
                            f"no step has waited for its batch since: back to {back}", measurement, retire_newest=True)

    def fills_the_machine(self, window: Window) -> bool:
        """The producers' CPU work (their busy share less reads) takes every core of the machine: one more decoding
        producer only shares the cores with them and the consumers. On 2 cores with a CPU consumer, a third producer
        decoding 2000x1500 JPEGs was tried and retired as unpaid in every recorded run (-2.2% to -7.4%), each trial
        seconds at the slower count and tried again 10, 20, 40 windows later: in a short run, a share of the run.
        A machine not known (a replay) is never full."""
        return self._machine_known and self._cores_hold(window, window.producers + 1, self.cores) <= window.producers

    def _cores_hold(self, window: Window, otherwise: int, cores: int | None = None) -> int:
        """The producers `cores` (by default the budget: those the consumers leave free) can run, each using the
        window's busy share less its reads of a core; `otherwise` where the producers used no core."""
        cores_each = window.utilization * (1 - window.read_share)
        free = self.budget if cores is None else cores
        return math.floor(free / cores_each) if cores_each > 0 else otherwise

    def _add_steps(self, window: Window, window_started: float) -> None:
        """The window's steps that ran at the current count; a window without stamps counts as one step-group
        stamped at its start (a replay: the window after a change settles)."""
        stamps = window.stamps or ((StepStamp(window_started, window.samples, window.train_s),)
                                   if window.steps else ())
        counted = [s for s in stamps if s.ended_s >= self._count_from]
        steps = window.steps if not window.stamps else len(counted)
        if counted:
            self._stalls = [*self._stalls, window.input_stall][-int(KEEP_S):]
        self._steps = [s for s in [*self._steps, *counted] if s.ended_s >= self._clock - KEEP_S - 1.0]
        self._step_count += steps

    def _window_rate(self, window: Window) -> float:
        """The rate of the window's steps that ran at the current count (none stamped: its totals); the ring's
        start-up steps are already out (`_without_ring_steps`)."""
        return _rate(self._counted(window)) if window.stamps else window.rate

    def _without_ring_steps(self, window: Window) -> Window:
        """The window less the steps served at once from the batches the ring built before training began (every
        step until the first that waited for its batch): they ran at the ring's pace, and counted, they made a
        start-up jump that quadrupled the rate look unpaid (measured: 195 samples/s "before" for one producer's
        37). Only that leading run goes: later steps that did not wait are the producers' work like any other."""
        if not self._ring_served or not window.stamps:
            return window
        first = next((i for i, s in enumerate(window.stamps) if s.wait_s >= PACED_WAIT * s.train_s), None)
        kept = window.stamps[first:] if first is not None else ()
        self._ring_served = first is None
        return replace(window, stamps=kept, steps=len(kept), samples=sum(s.samples for s in kept),
                       train_s=sum(s.train_s for s in kept))

    def _counted(self, window: Window) -> list[StepStamp]:
        return [s for s in window.stamps if s.ended_s >= self._count_from]

    def _counted_stall(self, window: Window) -> float:
        """The share of their time the window's counted steps waited, judged in lockstep (`lockstep_stall`; no
        stamps: the window's own stall, which also counts the ring's start-up steps)."""
        counted = self._counted(window)
        return lockstep_stall(counted) if window.lockstep and any(s.train_s > 0 for s in counted) else window.stall

    def _measured(self, jump: bool) -> bool:
        windows, steps = (1, JUMP_MEASURE_STEPS) if jump else (MEASURE_WINDOWS, MEASURE_STEPS)
        return len(self._stalls) >= windows and self._step_count >= steps

    def _judge_trial(self, window: Window, rate: float, measurement: dict[str, Any]) -> Decision | None:
        """A fork has been measured: keep it if the rate rose enough, else retire what it added and hold the
        count."""
        trial, self._trial = self._trial, None
        assert trial is not None, "judged only while a fork is on trial"
        gain = rate / trial.rate_before - 1 if trial.rate_before > 0 else math.inf
        # A jump must bring what one more producer would have had to, not a quarter of proportional growth: x16 to
        # a rate x4.3 (reads waiting 25 ms) is no fork to retire to one producer; producers it over-shot idle, and
        # the calm rule retires them.
        needed = required_gain(trial.producers, trial.stall_before)
        # A gain below what one fork had to bring is still real when the noise of both rates says so (a +15%
        # measured at +/-3% was once retired for not reaching +20%): then it is kept. Not for a jump: a jump of
        # many kept for a small sure gain would leave them all running.
        noise = math.hypot(trial.error_before, relative_error(self._steps)) * (1 + max(gain, 0.0))
        measurement.update(rate_before=round(trial.rate_before, 2), gain=round(gain, 4), gain_needed=round(needed, 4))
        if math.isfinite(noise):
            measurement["gain_noise"] = round(noise, 4)
        if gain >= needed or (trial.added == 1 and gain >= max(MIN_GAIN, NOISE_SIGMAS * noise)):
            return None  # it paid: carry on, maybe fork again at once
        self.limit = trial.producers
        self._hold = self._retry_windows
        self._retry_windows *= 2
        reason = (f"the fork to {window.producers} did not pay: {trial.rate_before:.1f} -> {rate:.1f} samples/s "
                  f"({gain:+.1%}, needed {needed:+.1%}); back to {trial.producers} for {self._hold} windows")
        return self._change(trial.producers - window.producers, reason, measurement, retire_newest=True)

    def _maybe_fork(self, window: Window, rate: float, summary: str, measurement: dict[str, Any]) -> Decision:
        if window.producers >= self.limit:
            held = "the most that paid" if self.limit < self.ceiling else "the ceiling"
            return Decision(0, f"at {held} ({self.limit} producers); {summary}", measurement=measurement)
        if plain_need(window):
            # Consumers waited most of the window with every producer busy: no measurement is needed to see that
            # more producers are wanted (a count restarted by a refused fork, or the first window after start-up,
            # once waited 2 windows and 8 steps here). Unmeasured, the fork is judged against this window's rate.
            measured = self._measured(jump=True)
            base, stall = ((rate, self._mean_stall()) if measured
                           else (self._window_rate(window), window.input_stall))
            if base > 0:
                measurement["rate_at_count"] = round(base, 2)
                return self._fork(window, base, stall, f"consumers wait: {summary}", measurement,
                                  self._steps if measured else self._counted(window))
        if not self._measured(jump=False):
            return Decision(0, f"measuring {window.producers} producers; {summary}", measurement=measurement)
        return self._fork(window, rate, self._mean_stall(), f"consumers wait: {summary}", measurement, self._steps)

    def _mean_stall(self) -> float:
        return sum(self._stalls) / len(self._stalls) if self._stalls else 0.0

    def jump_target(self, window: Window) -> int:
        """On a plain need: the count whose input would end the wait if input grew with the count, at most
        JUMP_MAX times this one, and no more than the cores the consumers leave free can run (a producer that waits
        for reads uses little of one; a busy consumer's core is not the producers' to fill); else one more."""
        p = window.producers
        if not plain_need(window):
            return p + 1
        ends_wait = math.ceil(p / max(0.05, 1 - self._counted_stall(window)))
        return max(p + 1, min(self.limit, JUMP_MAX * p, ends_wait, self._cores_hold(window, ends_wait)))

    def _fork(self, window: Window, rate: float, stall: float, why: str, measurement: dict[str, Any],
              base: list[StepStamp]) -> Decision:
        """Fork to the jump's target, on trial against `rate`, the rate of the steps `base`; none where the
        producers' own work already fills the machine's cores (`fills_the_machine`)."""
        if self.fills_the_machine(window):
            return Decision(0, f"{why}; but the {window.producers} producers' own work fills the machine's "
                               f"{self.cores} cores: one more would only share them", measurement=measurement)
        target = self.jump_target(window)
        past = " (past the free cores: consumers wait, so they leave theirs idle)" if target > self.budget else ""
        self._trial = _Trial(window.producers, target - window.producers, rate, stall, relative_error(base))
        measurement["target"] = target
        return self._change(target - window.producers, f"{why}; forking to {target}{past}", measurement)

    def forked(self, started: int, now: float | None = None) -> None:
        """The pool started `started` of the producers a fork asked for, by `now` (starting processes takes time,
        and the steps of that time are not the new count's). Fewer than asked: a retiring producer still holds
        its row until it exits; none, and there is no trial to judge and nothing to settle: the next window asks
        again."""
        if started == 0:
            self._trial = None
            self._count_from = -math.inf
            return
        if now is not None:
            self._count_from = max(self._count_from, now + SETTLE_S)
        if self._trial is not None and started < self._trial.added:
            self._trial = replace(self._trial, added=started)

    def fork_refused(self) -> None:
        self.forked(0)

    def _count_down_hold(self) -> None:
        if self._hold > 0:
            self._hold -= 1
            if self._hold == 0:
                self.limit = self.ceiling

    def _restart_count(self, since: float) -> None:
        """Count from `since` on: the steps already counted that ended after it stay."""
        self._count_from = since
        self._steps = [s for s in self._steps if s.ended_s >= since]
        self._stalls = self._stalls[-1:] if self._steps else []
        self._step_count = len(self._steps)

    def _change(self, change: int, reason: str, measurement: dict[str, Any], retire_newest: bool = False) -> Decision:
        self._restart_count(self._clock + SETTLE_S)
        self._calm_windows = 0
        return Decision(change, reason, retire_newest, measurement)

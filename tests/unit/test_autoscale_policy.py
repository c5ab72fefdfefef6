"""The autoscaling policy on recorded window measurements: grow past the cores the consumers leave free while
they wait and forks pay, retire a fork that did not pay, never add competition for a consumer that is busy."""

from __future__ import annotations

from dataclasses import replace

from stoker.common.config import FeedSettings
from stoker.pipeline.autoscaler import (
    NOISE_SIGMAS,
    RETRY_WINDOWS,
    Autoscaler,
    StepStamp,
    Window,
    default_ceiling,
    relative_error,
    required_gain,
    static_budget,
)
from stoker.pipeline.engine import HostShare, ProducerCounts


def window(producers: int, stall: float, samples_per_s: float, queue_fill: float = 0.1,
           utilization: float = 0.97) -> Window:
    """One second of a run as the controller measures it (one consumer)."""
    return Window(stall=stall, queue_fill=queue_fill, utilization=utilization, producers=producers,
                  samples=round(samples_per_s), steps=5, train_s=1.0)


def feed(scaler: Autoscaler, windows: list[Window]) -> list[int]:
    return [scaler.decide(w).change for w in windows]


# Recorded on the 2-core machine: 2000x1500 JPEGs, a model with almost no compute, one CPU consumer, batch 32
# (the workload): one producer feeds 175-179 samples/s while the consumer waits 80-86% of the time,
# two feed 320 while it still waits, three no more than two.
ONE = [window(1, 0.86, 175.0), window(1, 0.80, 179.0)]
TWO = [window(2, 0.55, 318.0), window(2, 0.52, 322.0)]
THREE = [window(3, 0.50, 321.0), window(3, 0.54, 316.0)]


def test_grows_past_the_cores_the_consumers_leave_free_while_they_wait_and_forks_pay():
    # The consumer waits a third of the time: one window is not a measurement, two are.
    scaler = Autoscaler(minimum=1, budget=1, ceiling=6)  # 2 cores, one of them for the CPU consumer
    assert feed(scaler, [window(1, 0.33, 240.0), window(1, 0.33, 244.0)]) == [0, 1]
    # It waits 86% of the time with the producer 97% busy: the need is plain, fork at once.
    scaler = Autoscaler(minimum=1, budget=1, ceiling=6)
    fork = scaler.decide(ONE[0])
    assert fork.change == 1 and "past the free cores" in fork.reason
    assert fork.measurement["rate_at_count"] == 175.0
    assert feed(scaler, [window(2, 0.9, 40.0)]) == [0]  # the new producer is starting: not judged
    assert feed(scaler, TWO) == [0, 1]  # 177 -> 320 paid, consumers still wait: fork again


def test_a_fork_that_did_not_pay_is_retired_newest_first_and_tried_again_later():
    scaler = Autoscaler(minimum=1, budget=1, ceiling=6)
    assert feed(scaler, [ONE[0], window(2, 0.9, 40.0), *TWO, window(3, 0.9, 100.0)]) == [1, 0, 0, 1, 0]
    retire = scaler.decide(THREE[0])
    assert retire.change == 0  # one window at three is not a measurement
    retire = scaler.decide(THREE[1])
    assert retire.change == -1 and retire.retire_newest
    assert retire.measurement["rate_before"] == 320.0 and retire.measurement["gain"] < 0
    assert "did not pay" in retire.reason
    waiting = [window(2, 0.52, 320.0)] * (RETRY_WINDOWS - 2)
    assert set(feed(scaler, waiting)) == {0}  # consumers still wait, but two is the most that paid
    assert scaler.limit == 2
    assert feed(scaler, [window(2, 0.52, 320.0)] * 2) == [0, 1]  # the hold ran out: measure again


def test_a_fork_the_pool_refused_is_not_judged_and_is_asked_again():
    # At the count limit a retiring producer keeps its row until it exits: the pool cannot fork yet. No producer
    # started, so no measurement may retire one (a real producer) or hold the count down as if it had not paid.
    scaler = Autoscaler(minimum=1, budget=1, ceiling=6)
    assert scaler.decide(ONE[0]).change == 1
    scaler.fork_refused()
    assert feed(scaler, ONE[1:]) == [1]  # still one producer and plainly waiting: asked again at once
    scaler.fork_refused()
    for measured in ONE * 4:  # the retiring producer is slow to exit: every fork is refused
        decision = scaler.decide(measured)
        assert decision.change >= 0, decision.reason
        if decision.change:
            scaler.fork_refused()
    assert scaler.limit == 6


def test_recorded_fork_that_slowed_the_consumers_is_retired():
    # Recorded here under load from other processes: the second producer made things worse.
    scaler = Autoscaler(minimum=1, budget=1, ceiling=6)
    feed(scaler, [window(1, 0.37, 182.0), window(1, 0.37, 182.0), window(2, 0.75, 54.9)])
    assert feed(scaler, [window(2, 0.75, 77.4), window(2, 0.75, 54.9)]) == [0, -1]


def test_never_adds_a_producer_for_a_busy_consumer():
    # A compute-heavy CPU consumer: it hardly waits, its core is busy, so a producer would only compete with it.
    scaler = Autoscaler(minimum=1, budget=1, ceiling=6)
    busy = [window(1, stall, 812.0, queue_fill=0.4, utilization=0.6) for stall in (0.0, 0.02, 0.04, 0.01)] * 5
    assert set(feed(scaler, busy)) == {0}
    # It waits a little (an epoch boundary), a producer is forked, and the consumer, now competing for its
    # cores, trains slower: the fork is retired even though the consumer waits less.
    assert feed(scaler, [window(1, 0.08, 790.0), window(2, 0.05, 600.0)]) == [1, 0]  # forked, settling
    assert feed(scaler, [window(2, 0.0, 720.0), window(2, 0.0, 716.0)]) == [0, -1]
    assert scaler.limit == 1


def test_over_provisioned_idle_producers_are_retired_but_never_below_the_minimum():
    scaler = Autoscaler(minimum=1, budget=3, ceiling=3)
    calm = window(3, 0.0, 80.0, queue_fill=1.0, utilization=0.1)
    assert feed(scaler, [calm, calm]) == [0, -1]  # two calm windows in a row
    assert feed(scaler, [window(1, 0.0, 80.0, queue_fill=1.0, utilization=0.1)] * 4) == [0, 0, 0, 0]


def test_the_static_budget_keeps_part_of_a_core_for_every_gpu_consumer():
    assert static_budget(["cpu"], cores=2) == 1
    assert static_budget(["cpu", "cpu"], cores=2) == 1  # never fewer than one
    assert static_budget(["cuda:0"], cores=2) == 1  # its feeding thread and NCCL: half a core, rounded up
    assert static_budget([f"cuda:{i}" for i in range(8)], cores=32) == 28
    assert static_budget([f"cuda:{i}" for i in range(8)], cores=8) == 4


def test_a_fork_must_bring_less_as_the_count_grows_and_as_the_wait_left_shrinks():
    assert required_gain(1, stall_before=0.8) == 0.25  # a quarter of doubling
    assert required_gain(4, stall_before=0.8) == 0.0625
    assert abs(required_gain(3, stall_before=0.06) - 0.5 * 0.06 / 0.94) < 1e-12  # half of ending a 6% wait
    assert required_gain(50, stall_before=0.5) == 0.02  # never below the noise of a few windows


def test_the_ring_drained_at_start_up_is_not_taken_for_the_producers_rate():
    # Recorded shape: training starts on a full ring, so the first seconds run at the ring's pace, not the
    # producers'; a fork judged against that rate never looks as if it paid (seen: 193 "before" against 121).
    drained = [window(1, 0.30, 400.0), window(1, 0.35, 300.0)]  # waiting, but not plainly
    scaler = Autoscaler(minimum=1, budget=1, ceiling=6, startup_windows=2)
    assert feed(scaler, drained) == [0, 0]
    fork = scaler.decide(ONE[0])  # the first window past start-up, and the need is plain
    assert fork.change == 1 and fork.measurement["rate_at_count"] == 175.0
    assert feed(scaler, [window(2, 0.9, 40.0), *TWO]) == [0, 0, 1]  # so 175 -> 320 pays


def stamped(producers: int, ended_s: float, steps: list[tuple[float, float]], stall: float = 0.9,
            utilization: float = 0.97, read_share: float = 0.0) -> Window:
    """A window closed at `ended_s` whose reports carry each step's own end time: (ended_s, seconds) of steps of
    32 samples (one consumer)."""
    stamps = tuple(StepStamp(end, 32, seconds, stall * seconds) for end, seconds in steps)
    return Window(stall=stall, queue_fill=0.05, utilization=utilization, producers=producers,
                  samples=32 * len(steps), steps=len(steps), train_s=sum(s for _, s in steps), ended_s=ended_s,
                  stamps=stamps, read_share=read_share)


def test_a_trial_is_judged_on_the_steps_that_ended_after_the_change_not_on_when_they_were_reported():
    # Steps of 0.25 s at 2 producers (128 samples/s); the fork to 3 at t=11 makes them 1/6 s (192 samples/s, a
    # gain of 0.25 / (1/6) - 1 = +50%). Reports come in groups (a GPU consumer's), so the windows after the fork
    # also carry steps that ran before it: counted by arrival they drag the fork's rate down.
    def before(t: float) -> list[tuple[float, float]]:
        return [(t - 0.75, 0.25), (t - 0.5, 0.25), (t - 0.25, 0.25), (t, 0.25)]

    def after(t: float, n: int = 6) -> list[tuple[float, float]]:
        return [(t - i / 6, 1 / 6) for i in range(n)]

    late = [(10.5, 0.25), (10.75, 0.25), (11.0, 0.25)]  # ran at 2 producers, reported after the fork
    recorded = [stamped(2, 10.0, before(10.0), stall=0.3), stamped(2, 11.0, before(11.0), stall=0.3),
                stamped(3, 12.0, after(12.0, 3), stall=0.1), stamped(3, 13.0, late + after(13.0), stall=0.1),
                stamped(3, 14.0, late + after(14.0), stall=0.1), stamped(3, 15.0, after(15.0), stall=0.1)]
    scaler = Autoscaler(minimum=1, budget=1, ceiling=6)
    decisions = [scaler.decide(w) for w in recorded]
    assert [d.change for d in decisions[:2]] == [0, 1]
    judged = [d for d in decisions[2:] if "gain" in d.measurement]
    assert judged and judged[0].change >= 0 and abs(judged[0].measurement["gain"] - 0.5) < 0.01, judged
    # The same windows without the stamps, counted as they arrived: a smaller gain than the fork brought.
    unstamped = [Window(stall=w.stall, queue_fill=w.queue_fill, utilization=w.utilization, producers=w.producers,
                        samples=w.samples, steps=w.steps, train_s=w.train_s) for w in recorded]
    scaler = Autoscaler(minimum=1, budget=1, ceiling=6)
    gains = [d.measurement["gain"] for d in map(scaler.decide, unstamped) if "gain" in d.measurement]
    assert gains and gains[0] < 0.4, gains


def test_a_plain_need_at_start_up_forks_at_once_and_jumps_as_far_as_the_cores_allow():
    # Consumers wait most of the first window with every producer busy. Producers that wait on reads 95% of their
    # busy time (STOKER_READ_LATENCY_MS=25 on 500x375 JPEGs) leave the cores free: jump x4; producers decoding
    # 2000x1500 JPEGs (reads 1%) fill a core each: on 2 cores, one more.
    reading = Autoscaler(minimum=1, budget=1, ceiling=16, startup_windows=2)
    fork = reading.decide(stamped(1, 1.0, [(0.2, 0.01), (0.9, 0.7)], stall=0.7, read_share=0.95))
    assert fork.change == 3 and fork.measurement["target"] == 4
    decoding = Autoscaler(minimum=1, budget=1, ceiling=16, startup_windows=2)
    fork = decoding.decide(stamped(1, 1.0, [(0.2, 0.01), (0.9, 0.7)], stall=0.7, read_share=0.01))
    assert fork.change == 1
    # Not plain (consumers wait a little): no fork before a measurement.
    calm = Autoscaler(minimum=1, budget=1, ceiling=16, startup_windows=2)
    assert calm.decide(stamped(1, 1.0, [(0.5, 0.1), (0.9, 0.1)], stall=0.2, read_share=0.95)).change == 0


def test_a_start_up_jump_is_judged_against_the_producers_pace_not_the_rings():
    # Recorded (the latency workload, one producer): training starts on 3 batches the ring held, served at
    # once, then each step waits 0.85 s for the one producer. The window read 195 samples/s; the producer's pace
    # was 37. The jump to 4 brought 150: judged against 195, it was retired (-23%) and the run stayed at 1. The
    # window's stall (55%) also counts the ring's steps: the producer's steps waited 99% of their time, so the jump
    # goes to the ceiling (16: ending a 99% wait needs 100 times the input), not to the 3 that would end a 55% wait.
    # 16 bringing 160 (x4.3, not x16) is kept: it brought far more than one more producer had to.
    ring = [StepStamp(3.01, 32, 0.006), StepStamp(3.02, 32, 0.002), StepStamp(3.03, 32, 0.002, 0.0001)]
    paced = [StepStamp(4.0, 32, 0.86, 0.85)]
    first = Window(stall=0.55, queue_fill=0.1, utilization=1.0, producers=1, samples=128, steps=4, train_s=0.99,
                   ended_s=4.3, stamps=(*ring, *paced), read_share=0.95)
    scaler = Autoscaler(minimum=1, budget=1, ceiling=16, startup_windows=2)
    fork = scaler.decide(first)
    assert fork.change == 15 and abs(fork.measurement["rate_at_count"] - 32 / 0.86) < 0.01, fork.measurement
    scaler.forked(15, now=4.35)
    kept = scaler.decide(stamped(16, 5.3, [(4.7, 0.2), (4.9, 0.2), (5.1, 0.2), (5.3, 0.2)], stall=0.5,
                                 read_share=0.95))
    assert kept.change >= 0 and abs(kept.measurement["gain"] - (160 / (32 / 0.86) - 1)) < 0.01, kept.reason


def test_steps_that_did_not_wait_count_once_the_ring_is_drained():
    # Batches that arrive in pairs: one step waits 0.25 s, the next none (the review's replay). 2 producers feed
    # 160 samples/s; only the ring's leading steps may be dropped, or the rate before a jump reads 107 and a jump
    # that brings nothing (160 -> 160) looks paid.
    def pairs(t: float) -> Window:
        steps = [StepStamp(t - 0.8 + 0.4 * i + d, 32, train, wait) for i in range(2)
                 for d, train, wait in ((0.3, 0.3, 0.25), (0.4, 0.1, 0.0))]
        return Window(stall=0.62, queue_fill=0.05, utilization=0.97, producers=2, samples=128, steps=4, train_s=0.8,
                      ended_s=t, stamps=tuple(steps), read_share=0.95)

    scaler = Autoscaler(minimum=1, budget=1, ceiling=16, startup_windows=2)
    fork = scaler.decide(pairs(4.0))
    assert fork.change > 0 and abs(fork.measurement["rate_at_count"] - 160.0) < 0.01, fork.measurement
    scaler.forked(fork.change, now=4.05)
    same = replace(pairs(5.5), producers=2 + fork.change)
    verdict = scaler.decide(same)
    assert verdict.change == -fork.change and verdict.retire_newest, verdict.reason


def test_a_jump_that_did_not_pay_is_retired_whole_in_one_decision():
    scaler = Autoscaler(minimum=1, budget=1, ceiling=16)
    # Plain: one window of two steps measures 4 producers (a jump must bring a lot: the noise of a few steps is
    # small beside it); 4 -> 10: busy 97% of the time, 10% of it on their own CPU work, the free core holds 10.
    fork = scaler.decide(stamped(4, 2.0, [(1.5, 0.25), (2.0, 0.25)], stall=0.8, read_share=0.9))
    assert fork.change == 6
    scaler.forked(6, now=2.2)
    same = [stamped(10, t, [(t - 0.5, 0.25), (t, 0.25)], stall=0.8, read_share=0.9) for t in (3.0, 4.0)]
    decisions = [scaler.decide(w) for w in same]
    assert decisions[-1].change == -6 and decisions[-1].retire_newest, decisions
    assert scaler.limit == 4


def test_the_count_is_measured_from_when_its_new_producers_work():
    # Forked producers import for seconds on a loaded machine; the steps until the last of them works ran at the
    # old count's rate, and must not make the fork look unpaid.
    scaler = Autoscaler(minimum=1, budget=1, ceiling=16)
    assert scaler.decide(stamped(4, 2.0, [(1.5, 0.25), (2.0, 0.25)], stall=0.8, read_share=0.9)).change == 6
    scaler.forked(6, now=2.1)
    slow_start = Window(stall=0.8, queue_fill=0.05, utilization=0.3, producers=10, samples=64, steps=2, train_s=0.5,
                        ended_s=3.0, stamps=(StepStamp(2.8, 32, 0.25), StepStamp(3.0, 32, 0.25)), starting=9)
    assert scaler.decide(slow_start).change == 0 and "starting" in scaler.decide(slow_start).reason
    working = replace(slow_start, ended_s=6.0, starting=0, working_since=5.0, utilization=0.95,
                      stamps=(StepStamp(4.5, 32, 0.25), StepStamp(5.2, 32, 0.25)))
    assert scaler.decide(working).change == 0  # only the step after 5.0 + settling counts: not yet measured
    fast = [StepStamp(6.0 + 0.06 * i, 32, 0.06) for i in range(1, 9)]
    kept = scaler.decide(replace(working, ended_s=7.0, stall=0.1, stamps=tuple(fast)))
    assert kept.change >= 0 and kept.measurement["gain"] > 1, kept


def read_bound(producers: int, samples_per_s: float) -> Window:
    """A window of consumers waiting on producers that spend 95% of their busy time reading (the review's)."""
    return replace(window(producers, 0.7, samples_per_s), read_share=0.95)


def test_a_start_up_jump_that_slowed_training_is_retired_whole():
    # The review's replay: storage whose bandwidth is saturated; forking from 1 halves the rate (100 -> 50).
    # Before the fix the start-up fork was never judged and a second start-up jump followed: +3, +10, +2, -2,
    # and 14 producers held "at the most that paid" at half the speed of one.
    scaler = Autoscaler(minimum=1, budget=1, ceiling=16, startup_windows=2)
    fork = scaler.decide(read_bound(1, 100.0))
    assert fork.change == 3  # 1 -> ceil(1 / (1 - 0.7)) = 4
    second, verdict = scaler.decide(read_bound(4, 50.0)), scaler.decide(read_bound(4, 50.0))
    assert second.change == 0, second.reason  # the second start-up window waits for the first jump's verdict
    assert verdict.change == -3 and verdict.retire_newest and "did not pay" in verdict.reason, verdict.reason
    assert verdict.measurement["rate_before"] == 100.0 and verdict.measurement["gain"] == -0.5
    assert scaler.limit == 1
    held = feed(scaler, [read_bound(1, 100.0)] * (RETRY_WINDOWS - 1))
    assert set(held) == {0}  # one is the most that paid while the hold lasts


def test_a_start_up_jump_that_paid_is_kept_and_the_next_is_judged_against_its_rate():
    scaler = Autoscaler(minimum=1, budget=1, ceiling=16, startup_windows=2)
    assert scaler.decide(read_bound(1, 100.0)).change == 3
    settle, paid = scaler.decide(read_bound(4, 250.0)), scaler.decide(read_bound(4, 300.0))
    assert settle.change == 0
    # 100 -> 300 paid (needed: a quarter of what 3 more add if proportional, capped by half of ending a 70%
    # wait); consumers still wait plainly: jump again, to ceil(4 / 0.3) = 14.
    assert paid.measurement["gain"] == 2.0 and paid.change == 10, paid.reason
    assert feed(scaler, [read_bound(14, 320.0)]) == [0]
    unpaid = scaler.decide(read_bound(14, 310.0))  # +3%: it needed a quarter of 10 / 4 (62.5%)
    assert unpaid.change == -10 and unpaid.measurement["rate_before"] == 300.0, unpaid.reason
    assert scaler.limit == 4


def test_a_jump_fills_only_the_cores_the_consumers_leave_free():
    # 2 cores, one CPU consumer: one core is free. Producers busy all the time, a quarter of it their own CPU
    # work (reads the rest), so the free core holds 4 of them: from 2, the jump stops at 4, not at the 8 that
    # both cores (the consumer's too) would hold, nor at the x4 cap (8) or what ends an 80% wait (10).
    counts = ProducerCounts.from_sections(FeedSettings(), HostShare(2, static_budget(["cpu"], cores=2), None))
    scaler = counts.autoscaler()
    assert scaler is not None
    need = replace(window(2, 0.8, 100.0, utilization=1.0), read_share=0.75)
    assert scaler.jump_target(need) == 4


def test_the_default_ceiling_on_a_64_core_host():
    # 8 GPUs leave 60 cores free; 8 producers per core would be 512 processes, the cap keeps it at 128.
    gpus = [f"cuda:{i}" for i in range(8)]
    counts = ProducerCounts.from_sections(FeedSettings(), HostShare(64, static_budget(gpus, cores=64), None))
    assert counts.budget == 128
    small = ProducerCounts.from_sections(FeedSettings(), HostShare(2, static_budget(["cpu"], cores=2), None))
    assert small.budget == 16  # 8 per core on the 2-core machine, as measured there


def test_a_start_up_window_without_steps_forks_nothing_it_could_not_judge():
    # A GPU consumer reports its steps in groups: a window may carry none, and a fork from it would have no rate
    # before it to be judged against.
    scaler = Autoscaler(minimum=1, budget=1, ceiling=16, startup_windows=2)
    assert scaler.decide(replace(read_bound(1, 0.0), steps=0, train_s=0.0)).change == 0
    assert scaler.decide(read_bound(1, 100.0)).change == 3


def test_a_rate_not_measured_is_absent_from_the_record_never_zero():
    # The run: two consumers training about 1,900 samples/s without waiting for input. No step waited,
    # so the policy counted none as its producers' (the ring's start-up batches end at the first step that waits)
    # and every autoscale record said "samples_per_s": 0.0, "rate_at_count": 0.0 and "0.0 samples/s".
    scaler = Autoscaler(minimum=1, budget=1, ceiling=6, startup_windows=2)
    for second in range(1, 8):
        stamps = tuple(StepStamp(second - 1 + (i + 1) / 10, 64, 0.0336) for i in range(10))
        decision = scaler.decide(Window(stall=0.0, queue_fill=0.5, utilization=0.3, producers=2, samples=640,
                                        steps=10, train_s=0.336, ended_s=float(second), stamps=stamps))
        assert decision.change == 0
        assert decision.measurement["samples_per_s"] == 1904.76  # 640 samples in 0.336 s of training steps
        assert decision.measurement.get("rate_at_count", 1.0) > 0, decision.measurement
        assert "0.0 samples/s" not in decision.reason and "1904.8 samples/s" in decision.reason, decision.reason
    idle = scaler.decide(Window(stall=0.0, queue_fill=0.9, utilization=0.0, producers=2, ended_s=8.0))
    assert "samples_per_s" not in idle.measurement and "rate_at_count" not in idle.measurement
    assert "no training step" in idle.reason and "0.0 samples/s" not in idle.reason, idle.reason


def _steady(producers: int, start: float, seconds: list[float], stall: float) -> list[Window]:
    """One-second windows of steps of 32 samples taking `seconds` each, in turn, from `start` on."""
    windows, t, steps = [], start, []
    for duration in seconds:
        t += duration
        steps.append((t, duration))
        if t >= start + len(windows) + 1:
            windows.append(stamped(producers, t, steps, stall=stall, utilization=0.8))
            steps = []
    return windows


def test_a_gain_below_the_rule_is_kept_when_its_own_noise_says_it_is_real():
    # The new user's run: a fork from 1 to 2 measured +15% where the rule asked +20.4% (a 29% wait left), and was
    # retired. Steady steps (+/-1%) make +15% many standard errors: kept. The same means from steps that swing by
    # a factor of two are within the noise: retired, as before.
    def trial(jitter: float) -> dict:
        scaler = Autoscaler(minimum=1, budget=1, ceiling=6)
        one = [0.32 * (1 + jitter * (-1) ** i) for i in range(24)]  # 100 samples/s
        for window_before in _steady(1, 0.0, one, stall=0.29):
            if scaler.decide(window_before).change == 1:
                break
        else:
            raise AssertionError("no fork while the consumer waited 29%")
        now = window_before.ended_s
        scaler.forked(1, now=now)
        two = [0.32 / 1.15 * (1 + jitter * (-1) ** i) for i in range(40)]  # 115 samples/s
        verdicts = [scaler.decide(w) for w in _steady(2, now + 0.6, two, stall=0.2)]
        verdict = next(d for d in verdicts if "gain" in d.measurement)
        return {**verdict.measurement, "retired": verdict.change < 0}

    steady = trial(0.01)
    assert abs(steady["gain"] - 0.15) < 0.02 and steady["gain"] < steady["gain_needed"]
    assert not steady["retired"] and steady["gain"] >= NOISE_SIGMAS * steady["gain_noise"]
    swinging = trial(0.5)
    assert swinging["retired"] and swinging["gain"] < NOISE_SIGMAS * swinging["gain_noise"]


def test_consumers_stepping_together_are_one_observation_of_the_noise():
    # Two consumers averaging every step end each step together: the same steps seen twice are no more certain.
    one = [StepStamp(0.3 * i, 32, 0.3 * (1 + 0.1 * (-1) ** i), consumer=0) for i in range(1, 13)]
    two = [*one, *(replace(s, ended_s=s.ended_s + 0.005, consumer=1) for s in one)]
    assert abs(relative_error(two) - relative_error(one)) < 1e-9
    assert relative_error(one[:4]) == float("inf")  # too few steps to say


def test_the_input_wait_is_judged_in_lockstep_by_the_consumer_that_waited():
    """Two consumers averaging every step: consumer 0 waits 10 ms for its batch and computes 20; consumer 1 has
    its batch, computes 20 and waits 10 in the averaging for consumer 0. Without the wait a step would take 20 ms
    of 30: the input held up a third of the time (the mean over consumers said a sixth)."""
    from stoker.pipeline.autoscaler import lockstep_stall

    steps = [StepStamp(0.030 * k + 0.030, 8, 0.030, wait, consumer) for k in range(10)
             for consumer, wait in ((0, 0.010), (1, 0.0))]
    assert abs(lockstep_stall(steps) - 1 / 3) < 1e-9
    # One consumer with steps shorter than the lockstep tolerance: each step is its own group, 20% waited.
    alone = [StepStamp(0.005 * k, 8, 0.005, 0.001, 0) for k in range(20)]
    assert abs(lockstep_stall(alone) - 0.2) < 1e-9


def before_training(producers: int, read_share: float, queue_fill: float = 0.05) -> Window:
    """A window before any consumer took a batch: no steps, the ring filling (the issue's reads waiting 25 ms)."""
    return Window(stall=0.0, queue_fill=queue_fill, utilization=0.99, producers=producers, read_share=read_share,
                  taken=False)


def test_before_training_producers_waiting_on_reads_fork_to_what_the_machine_holds_in_one_step():
    # Recorded: one producer 99% busy, 96.4% of it reading; a ring of 32 parts (the ceiling). 2 cores hold
    # 2 / (0.99 x 0.036) = 56, so the ring's 32, at once: the first step came a second later.
    scaler = Autoscaler(minimum=1, budget=1, ceiling=32, startup_windows=2, cores=2)
    assert scaler.decide(before_training(1, 0.964)).change == 31
    # Decoding on the CPU: the machine's 2 cores hold 2 producers busy 94%, 1 past the free core.
    decoding = Autoscaler(minimum=1, budget=1, ceiling=32, startup_windows=2, cores=2)
    assert decoding.decide(before_training(1, 0.05)).change == 1
    # A full ring wants nothing more.
    full = Autoscaler(minimum=1, budget=1, ceiling=32, startup_windows=2, cores=2)
    assert full.decide(before_training(1, 0.964, queue_fill=0.9)).change == 0


def test_the_default_ceiling_is_the_parts_the_ring_holds_within_memory():
    # 4 slots of batch 32 hold 32 parts in flight: the 33rd producer would have nothing to build (measured: 64
    # producers no faster than 32). Memory bounds it too: half of 1 GiB holds 8 producers of 64 MiB.
    assert default_ceiling(budget=1, cores=2, ring_parts=32) == 32
    assert default_ceiling(budget=1, cores=2, ring_parts=512) == 128
    assert default_ceiling(budget=1, cores=2, ring_parts=32, memory=2**30, producer_memory=64 * 2**20) == 8
    assert default_ceiling(budget=12, cores=2, ring_parts=4) == 12  # never below what the free cores run
    assert default_ceiling(budget=1, cores=2) == 16  # a Loader's ring is sized from it: 8 per core


def test_decoding_producers_forked_past_the_free_cores_before_training_go_back_unless_a_step_waits():
    # 2 cores, a CPU consumer: the fork to 2 before the first step took the consumer's core. Consumers that then
    # never wait for a batch (the ring keeps up, queue full) are computing on it: back to 1 once the ring's
    # start-up windows pass. Consumers that wait leave it idle: the fork stays.
    computing = Autoscaler(minimum=1, budget=1, ceiling=32, startup_windows=2, cores=2)
    assert computing.decide(before_training(1, 0.05)).change == 1
    busy = replace(window(2, 0.0, 100.0, queue_fill=0.9), read_share=0.05)
    assert feed(computing, [busy, busy, busy]) == [0, 0, -1]
    waiting = Autoscaler(minimum=1, budget=1, ceiling=32, startup_windows=2, cores=2)
    assert waiting.decide(before_training(1, 0.05)).change == 1
    assert all(change >= 0 for change in feed(waiting, [replace(window(2, 0.7, 100.0), read_share=0.05)] * 4))
    # Producers waiting on reads hold little of a core: no judgement, whatever the consumers do.
    reading = Autoscaler(minimum=1, budget=1, ceiling=32, startup_windows=2, cores=2)
    assert reading.decide(before_training(1, 0.964)).change == 31
    assert feed(reading, [replace(window(32, 0.0, 100.0, queue_fill=0.5), read_share=0.96)] * 3) == [0, 0, 0]


def _counts(producers, min_producers, initial_producers, max_producers, *, fits, cores):
    """The counts an engine starts with from these settings, on a machine of `cores` whose free ones hold `fits`."""
    feed = FeedSettings(producers=producers, min_producers=min_producers, initial_producers=initial_producers,
                        max_producers=max_producers)
    return ProducerCounts.from_sections(feed, HostShare(cores, fits, None))


def test_auto_starts_with_a_producer_for_every_core_unless_told_where():
    # 2 cores, a CPU consumer: the free core holds 1, but no consumer computes before the first step. Started at 1,
    # the one producer filled the ring before the first window closed (no reason to fork), and a short run's
    # first seconds of training went at its pace: 0.82 of 2 fixed producers over 2 epochs of 2,000 photos.
    free = static_budget(["cpu"], cores=2)
    assert free == 1 and _counts("auto", 1, None, None, fits=free, cores=2).initial == 2
    assert _counts("auto", 1, 1, None, fits=1, cores=2).initial == 1  # as the user said
    assert _counts("auto", 1, None, 1, fits=1, cores=2).initial == 1  # within --max-producers
    assert _counts("auto", 3, None, None, fits=1, cores=2).initial == 3  # --min-producers
    assert _counts(2, 1, None, None, fits=1, cores=16).initial == 2  # a fixed count is fixed


def test_a_start_past_the_free_cores_is_judged_like_a_fork_before_the_first_step():
    # Started at 2 on 2 cores with a CPU consumer: decoding producers whose consumer never waits for a batch (it
    # computes on the second core) go back to 1 once the ring's start-up windows pass; a consumer that waits
    # leaves its core idle, and producers waiting on reads hold little of one: both keep 2.
    started = _counts("auto", 1, None, None, fits=1, cores=2)
    computing = started.autoscaler()
    assert computing is not None
    busy = replace(window(2, 0.0, 100.0, queue_fill=0.9), read_share=0.05)
    retire = [computing.decide(w) for w in [busy] * 3]
    assert [d.change for d in retire] == [0, 0, -1] and "back to 1" in retire[-1].reason, retire[-1].reason
    waiting = started.autoscaler()
    assert waiting is not None
    assert all(c >= 0 for c in feed(waiting, [replace(window(2, 0.7, 100.0), read_share=0.05)] * 4))
    reading = started.autoscaler()
    assert reading is not None
    assert feed(reading, [replace(busy, read_share=0.96)] * 3) == [0, 0, 0]
    # Where the user set the start, it is theirs: no judgement before the first step's.
    told = _counts("auto", 1, 2, None, fits=1, cores=2).autoscaler()
    assert told is not None and feed(told, [busy] * 3) == [0, 0, 0]


def test_decoding_producers_that_fill_the_machine_are_not_forked_past_it():
    # Recorded (TWO): 2 producers 97% busy decoding on 2 cores while the consumer waits half its time. A third
    # was tried and retired in every recorded run (-2.2% to -7.4%), again 10, 20, 40 windows later: seconds at the
    # slower count, a share of a short run. Where the machine's cores are known it is not tried.
    full = Autoscaler(minimum=1, budget=1, ceiling=6, startup_windows=2, cores=2)
    decisions = [full.decide(w) for w in TWO * 3]
    assert [d.change for d in decisions] == [0] * 6
    assert "fills the machine's 2 cores" in decisions[-1].reason, decisions[-1].reason
    # From one producer the second is tried: the consumer's core is idle while it waits.
    assert Autoscaler(minimum=1, budget=1, ceiling=6, cores=2).decide(ONE[0]).change == 1
    # Producers reading most of their busy time, or busy 60% of it, leave room on the cores: forked.
    reading = Autoscaler(minimum=1, budget=1, ceiling=6, cores=2)
    assert reading.decide(replace(TWO[0], read_share=0.9)).change > 0
    idle_share = Autoscaler(minimum=1, budget=1, ceiling=6, cores=2)
    assert feed(idle_share, [replace(w, utilization=0.6) for w in TWO]) == [0, 1]


def test_producers_past_the_free_cores_stay_while_the_ring_is_drained():
    # Recorded on the loaded machine: 3 producers forked before the first step, a slow consumer served from the
    # ring's batches for more than the start-up windows (queue 63%, then 26%), no step had waited yet, and they
    # went back to 1; the steps then waited and 1 -> 2 came 7 s later. A ring not full is not a consumer computing.
    forked = Autoscaler(minimum=1, budget=1, ceiling=32, startup_windows=2, cores=2)
    assert forked.decide(before_training(1, 0.05)).change == 1
    draining = [replace(window(2, 0.0, 100.0, queue_fill=fill), read_share=0.05) for fill in (0.63, 0.26, 0.1)]
    assert feed(forked, draining) == [0, 0, 0]
    assert feed(forked, [replace(window(2, 0.7, 100.0), read_share=0.05)] * 3) == [0, 0, 0]  # then they wait

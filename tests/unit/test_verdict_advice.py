"""The verdict's producer advice agrees with its own figures ("producers at budget (4/3, busy 82%):
give them more cores (--max-producers)" where 3 was a limit the autoscaler set after an unpaid fork, the ceiling
was 6 and the live line said 3/3)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np

from stoker.observe.diagnosis import LOADER_ARGUMENTS, TimeSplit, diagnose
from stoker.pipeline.autoscaler import Autoscaler
from stoker.pipeline.gauges import ProducerGauges
from stoker.pipeline.messages import StepReport


def _input_bound(producers: int, budget: int, ceiling: int | None) -> str:
    return diagnose(TimeSplit(compute=0.5, input_wait=0.4, averaging=0.0, producers=producers, producer_budget=budget,
                              producer_utilization=0.82, sync_every=1, producer_ceiling=ceiling)).text


def test_a_limit_below_the_ceiling_does_not_ask_for_a_higher_ceiling():
    text = _input_bound(producers=3, budget=3, ceiling=6)
    assert "--max-producers" not in text and "held at 3" in text and "ceiling is 6" in text


def test_at_the_ceiling_a_higher_ceiling_is_the_advice():
    assert "--max-producers" in _input_bound(producers=6, budget=6, ceiling=6)


def test_the_run_verdict_counts_the_producers_of_now_against_the_limit_of_now(textures, tmp_path):
    from stoker.common.config import make_config
    from stoker.pipeline.engine import Engine
    from stoker.run.controller import Controller

    train, val = textures
    controller = Controller(make_config({"data": train, "val": val, "devices": "cpu:1", "image_size": 16,
                                         "max_producers": 6, "out": tmp_path / "run"}))  # starts nothing
    # The engine's state after such a run, without its processes: the controller reads it from there.
    engine = Engine.__new__(Engine)
    engine.budget, engine.pool, engine.num_slots, engine.assembler = 6, None, 4, SimpleNamespace(parts=8)
    engine.cores = 2
    engine.autoscaler = Autoscaler(minimum=1, budget=1, ceiling=6)
    engine.autoscaler.limit = 3  # the fork to 4 did not pay, and 4 retired
    engine.gauges = gauges = ProducerGauges(6, events=None)
    gauges.timeline = [{"producers": n} for n in (1, 2, 3, 4, 3)]
    gauges.producer_busy = (8.2, 10.0)
    gauges.producer_reading = (0.1, 8.2)  # decoding, not reading, kept them busy
    controller.driver._engine = engine
    for step, now in enumerate((1.0, 2.0, 3.0)):  # half of every step spent waiting for input
        controller.stats.record_step(StepReport(0, 0, step, step, 2, 1.0, 0.5, 0.5, 0.0, np.arange(2), None), now)
    text = controller.run_verdict().text
    assert "input-bound" in text and "held at 3" in text and "--max-producers" not in text, text


def _verdict(**figures) -> str:
    fields = dict(compute=0.5, averaging=0.0, sync_every=1)
    return diagnose(TimeSplit(**{**fields, **figures})).text


def test_producers_idle_but_not_for_want_of_a_slot_are_not_told_to_raise_the_slots():
    # The latency workload under auto (measured): the producers forked to 16 spent their first seconds
    # importing, so counted from their fork they were busy 69%, and the verdict said "raise --slots-per-consumer"
    # though no batch waited for a slot while a consumer waited. Once started they waited on reads (96% of their
    # busy time).
    text = _verdict(input_wait=0.94, producers=16, producer_budget=16, producer_utilization=0.69,
                    producer_read_share=0.96, producer_slot_bound=0.0)
    assert "--slots-per-consumer" not in text and "reading is slow" in text and "not for want of a slot" in text, text
    slots = _verdict(input_wait=0.94, producers=16, producer_budget=16, producer_utilization=0.5,
                     producer_read_share=0.96, producer_slot_bound=0.4)
    assert "--slots-per-consumer" in slots and "40% of their time while a batch waited for a slot" in slots, slots


def test_idle_producers_are_not_told_to_get_more_cores():
    # A run's figures (the latency workload with 16 producers at 4 slots): consumers waited 16% of the
    # time while the 16 producers were busy 19%: cores were not what they lacked.
    text = _verdict(compute=0.84, input_wait=0.16, producers=16, producer_budget=16, producer_utilization=0.19)
    assert "input-bound" in text and "more cores" not in text and "idle 81%" in text, text


def test_a_cache_warm_folder_is_not_called_slow_storage():
    # A local folder read a second time (in the page cache) while auto measured a fork: 2 of a ceiling of 6
    # producers, busy 61% (the new one still starting), consumers waiting 30%.
    text = _verdict(compute=0.7, input_wait=0.30, producers=2, producer_budget=6, producer_utilization=0.61,
                    producer_ceiling=6)
    assert "reading the files is slow" not in text and "local disk" not in text, text


def test_producers_that_wait_on_reads_are_told_so():
    # STOKER_READ_LATENCY_MS=25 on 500x375 JPEGs, 4 producers: busy 97%, of it 95% in reads.
    text = _verdict(input_wait=0.7, producers=4, producer_budget=4, producer_utilization=0.97, producer_ceiling=4,
                    producer_read_share=0.95)
    assert "95% of it reading files" in text and "storage" in text and "more cores" not in text, text
    decoding = _verdict(input_wait=0.7, producers=4, producer_budget=4, producer_utilization=0.97,
                        producer_ceiling=4, producer_read_share=0.01)
    assert "more cores" in decoding and "storage" not in decoding, decoding


def test_the_loader_gives_the_trainers_verdict_on_the_same_engine_in_its_own_words():
    # stoker.Loader.summary() printed "reading the files is slow" while its producers idled: it had a copy of the
    # trainer's producer figures that left the ceiling and the reads out. Both now read the engine's.
    from stoker.observe.metrics import RunStats
    from stoker.pipeline.driver import EngineDriver
    from stoker.pipeline.engine import Engine
    from stoker.use.loader import Loader

    engine = Engine.__new__(Engine)
    engine.budget, engine.pool, engine.num_slots, engine.assembler = 6, None, 4, SimpleNamespace(parts=8)
    engine.cores = 2
    engine.autoscaler = Autoscaler(minimum=1, budget=1, ceiling=6)
    engine.gauges = gauges = ProducerGauges(6, events=None)
    gauges.producers_initial = 1
    gauges.timeline = [{"producers": n} for n in (1, 2)]
    gauges.producer_busy, gauges.producer_reading = (4.0, 10.0), (0.01, 4.0)  # idle 60%, reads 0.25%
    gauges.slot_bound_s = 6.0  # ... while batches waited for a free slot
    driver = EngineDriver.__new__(EngineDriver)  # the engine's face, without its processes
    driver._engine = engine
    loader = Loader.__new__(Loader)
    loader.stats, loader._engine, loader.info, loader.repeated_samples = RunStats(1, 100, 0), driver, None, 0
    loader.image_size = 32
    for step, now in enumerate((1.0, 2.0, 3.0)):
        loader.stats.record_step(StepReport(0, 0, step, step, 2, 0.0, 0.5, 0.5, 0.0, np.arange(2), None), now)
    text = loader.summary()["verdict"]["text"]
    stats = loader.stats
    expected = diagnose(TimeSplit(compute=stats.compute_fractions()[0], input_wait=stats.stall_fractions()[0],
                                  averaging=0.0, sync_every=1, producers=2,
                                  producer_budget=6, producer_utilization=0.4, producer_ceiling=6,
                                  producer_read_share=0.0025, producer_slot_bound=0.6, initial=1, cores=2,
                                  image_size=32),
                        LOADER_ARGUMENTS).text
    assert text == expected and "reading the files is slow" not in text, text
    assert "--" not in text, text  # a Loader's user has arguments, not the trainer's flags
    trainers = diagnose(TimeSplit(compute=stats.compute_fractions()[0], input_wait=stats.stall_fractions()[0],
                                  averaging=0.0, sync_every=1, producers=2, producer_budget=6,
                                  producer_utilization=0.4, producer_ceiling=6, producer_read_share=0.0025,
                                  producer_slot_bound=0.6))
    assert loader.summary()["verdict"]["kind"] == trainers.kind == "input-bound"


def test_a_fixed_count_is_told_to_raise_the_count_not_the_ceiling():
    # A fixed --producers 2 run, busy decoding, was told "give them more cores (--max-producers)": a ceiling
    # for auto, which a fixed count does not have.
    text = _verdict(input_wait=0.4, producers=2, producer_budget=2, producer_utilization=0.95, producer_ceiling=2,
                    producer_read_share=0.01, auto=False)
    assert "--producers above 2" in text and "--max-producers" not in text and "auto" not in text, text


def test_a_loader_on_auto_is_not_advised_auto():
    # A Loader on producers='auto' whose producers waited on reads, below auto's limit, was told
    # "producers='auto' adds them".
    text = diagnose(TimeSplit(compute=0.3, input_wait=0.7, averaging=0.0, sync_every=1, producers=2,
                              producer_budget=6, producer_utilization=0.97, producer_ceiling=6,
                              producer_read_share=0.9), LOADER_ARGUMENTS).text
    assert "producers='auto'" not in text and "producers=6" in text and "2 of 6" in text, text


def test_idle_producers_with_free_slots_are_given_the_setting_that_builds_ahead():
    # "consumers wait 21% ... neither slots nor storage held them back, so more producers or cores would idle
    # too": the sentence named no setting that would change the wait.
    text = _verdict(input_wait=0.21, producers=2, producer_budget=2, producer_utilization=0.5, producer_ceiling=2,
                    producer_read_share=0.01, producer_slot_bound=0.05, auto=False)
    assert "raise --slots-per-consumer" in text and "idle 50%" in text, text


SETTINGS = ("--producers", "--max-producers", "--initial-producers", "--slots-per-consumer", "--image-size",
            "--sync-every", "--overlap-averaging", "--compile", "--lr")


def _splits():
    """Input-bound runs of every kind: auto or fixed, below, at or held under the ceiling, producers busy or
    idle, reading or decoding, idle for a slot or not."""
    for auto in (True, False):
        for producers, budget, ceiling in ((2, 2, 2), (2, 6, 6), (3, 3, 6)):
            if not auto and budget != producers:
                continue
            for utilization in (0.95, 0.5):
                for read_share in (0.01, 0.9):
                    for slot_bound in (0.0, 0.4):
                        yield TimeSplit(compute=0.5, input_wait=0.4, averaging=0.0, sync_every=1,
                                        producers=producers, producer_budget=budget,
                                        producer_utilization=utilization, producer_ceiling=ceiling,
                                        producer_read_share=read_share, producer_slot_bound=slot_bound, auto=auto)


def test_every_input_verdict_names_a_setting_the_run_does_not_already_use_and_only_its_own_figures():
    for split in _splits():
        text = diagnose(split).text
        named = [flag for flag in SETTINGS if f"{flag} " in text or f"{flag}," in text or text.endswith(flag)]
        assert named or "give the run more cores" in text, text
        assert "--producers auto" not in text, text  # auto is advised to no one: a run on auto uses it already
        if not split.auto:
            assert "--max-producers" not in text and "--initial-producers" not in text, text
        figures = {round(100 * share) for share in (split.input_wait, split.producer_utilization,
                                                    1 - split.producer_utilization, split.producer_read_share,
                                                    split.producer_slot_bound)}
        shown = {int(p) for p in re.findall(r"(\d+)%", text)}
        assert shown <= figures, (text, shown - figures)
        loader = diagnose(split, LOADER_ARGUMENTS).text
        assert "producers='auto'" not in loader and "--" not in loader, loader


def test_after_a_resume_the_verdict_tells_the_whole_run_s_shares(textures, tmp_path):
    # The table printed the whole run's shares after --resume and the verdict beside it the last part's alone.
    from stoker.common.config import make_config
    from stoker.pipeline.engine import Engine
    from stoker.run.controller import Controller

    train, val = textures
    controller = Controller(make_config({"data": train, "val": val, "devices": "cpu:1", "image_size": 16,
                                         "producers": 2, "out": tmp_path / "run"}))  # starts nothing
    engine = Engine.__new__(Engine)
    engine.budget, engine.pool, engine.autoscaler = 2, None, None
    engine.num_slots, engine.assembler, engine.cores = 4, SimpleNamespace(parts=8), 2
    engine.gauges = gauges = ProducerGauges(2, events=None)
    gauges.timeline, gauges.producer_busy = [{"producers": 2}], (9.5, 10.0)
    controller.driver._engine = engine
    # The part before: 6 s of steps, no wait. This part: 3 steps of 0.5 s computing and 0.5 s waiting (the first
    # step's wait is start-up): 1.0 s of wait in 2.5 s, so 1.0 of the whole 8.5 s: 12%, not this part's 40%.
    controller.ledger.segments = [{"samples_trained": 12, "train_s": 6.0, "consumer_s": [[6.0, 0.0, 0.0, 0.0, 6.0]],
                                   "producers_initial": 2, "producers_max": 2}]
    for step, now in enumerate((1.0, 2.0, 3.0)):
        controller.stats.record_step(StepReport(0, 0, step, step, 2, 1.0, 0.5, 0.5, 0.0, np.arange(2), None), now)
    text = controller.run_verdict().text
    assert "consumers wait 12% of the time" in text, text


def test_with_every_part_of_the_ring_taken_more_slots_not_more_producers():
    # Measured (reads waiting 25 ms, 4 slots of batch 32: 32 parts in flight): 64 producers trained no faster than
    # 32, whose verdict had asked for more producers.
    reading = dict(compute=0.2, input_wait=0.76, averaging=0.0, producer_budget=32, producer_utilization=0.83,
                   sync_every=1, producer_read_share=0.96, producer_room=32)
    fixed = diagnose(TimeSplit(producers=32, auto=False, **reading)).text
    assert "--producers" not in fixed and "raise --slots-per-consumer" in fixed and "32 parts" in fixed
    auto = diagnose(TimeSplit(producers=32, producer_ceiling=32, **reading)).text
    assert "--max-producers" not in auto and "raise --slots-per-consumer" in auto
    below = diagnose(TimeSplit(producers=16, auto=False, **reading)).text
    assert "raise --producers above 16" in below


def test_a_host_bound_run_already_compiled_is_not_told_to_compile():
    host_bound = dict(compute=0.5, input_wait=0.05, averaging=0.0, producers=2, producer_budget=2,
                      producer_utilization=0.5, sync_every=1, host=0.4)
    assert "try --compile" in diagnose(TimeSplit(**host_bound)).text
    compiled = diagnose(TimeSplit(compiled=True, **host_bound)).text
    assert compiled.startswith("host-bound") and "try --compile" not in compiled and "--compile is on" in compiled


# ---- every verdict, against the settings of the run it judges ------------------------------------------------------

ADVICE = (re.compile(r"raise (--[a-z-]+) above (\d+)"), re.compile(r"raise (--[a-z-]+)(?![a-z-])(?! above)()"),
          re.compile(r"(--(?:producers|initial-producers|sync-every|overlap-averaging)) (\d+|true)"),
          re.compile(r"try (--compile)()"), re.compile(r"lower (--image-size)()"))


def _advised(text: str, config) -> dict[str, object]:
    """The settings a verdict tells its run to change, with the values it names ("raise --x above 3": 4; "raise
    --x": one more than now; "lower --x": half of now)."""
    changes: dict[str, object] = {}
    for pattern in ADVICE:
        for flag, value in pattern.findall(text):
            name = flag[2:].replace("-", "_")
            now = getattr(config, name)
            if pattern is ADVICE[0]:
                changes[name] = int(value) + 1
            elif name == "compile" or value == "true":
                changes[name] = True
            elif value:
                changes[name] = int(value)
            else:
                changes[name] = now // 2 if flag == "--image-size" else now + 1
    return changes


def _runs():
    """Runs that end in every verdict: host-, sync- and input-bound; auto or fixed, below, at or held under the
    ceiling (the most a run may have, 512, included); producers busy or idle, reading or decoding, at one a core or
    not; the slots at their most or not; started at the limit; compiled, overlapped, or not allowed to overlap."""
    from stoker.common.procs import MAX_PRODUCERS

    inputs = [dict(producers=p, producer_budget=b, producer_ceiling=c, auto=auto, initial=i)
              for auto in (True, False)
              for p, b, c, i in ((2, 2, 2, 1), (2, 6, 6, 1), (2, 6, 6, 6), (3, 3, 6, 1),
                                 (MAX_PRODUCERS, MAX_PRODUCERS, MAX_PRODUCERS, 1))
              if auto or (p == b == c and i == 1)]
    for counts in inputs:
        for shares in (dict(input_wait=0.4, averaging=0.0), dict(input_wait=0.02, averaging=0.3),
                       dict(input_wait=0.02, averaging=0.0, host=0.3)):
            for utilization, read_share, slot_bound in ((0.95, 0.01, 0.0), (0.95, 0.9, 0.0), (0.5, 0.01, 0.4),
                                                        (0.5, 0.01, 0.0)):
                for slots, cores, room, size in ((4, 2, 1024, 32), (64, 8, 1024, 8), (4, 2, 2, 32)):
                    for compiled, overlapped, overlap_allowed in ((False, False, True), (True, True, True),
                                                                  (False, False, False)):
                        yield TimeSplit(compute=0.5, sync_every=1, producer_utilization=utilization,
                                        producer_read_share=read_share, producer_slot_bound=slot_bound, slots=slots,
                                        cores=cores, producer_room=room, image_size=size, compiled=compiled,
                                        overlapped=overlapped, overlap_allowed=overlap_allowed, **shares, **counts)


def _config_of(split: TimeSplit, data):
    from stoker.common.config import make_config

    train, val = data
    counts = ({"producers": "auto", "max_producers": split.producer_ceiling, "initial_producers": split.initial}
              if split.auto else {"producers": split.producers})
    return make_config({"data": train, "val": val, "image_size": split.image_size, "batch_size": 8,
                        "devices": "cpu:2",
                        "slots_per_consumer": split.slots, "sync_every": split.sync_every, "compile": split.compiled,
                        "overlap_averaging": split.overlapped,
                        "outer_optimizer": "none" if split.overlap_allowed else "sgd", **counts})


def test_no_verdict_advises_what_the_run_already_does_or_a_setting_it_cannot_take(textures):
    """Each setting a verdict names is applied to the run's own settings: it must change them, and the settings
    must accept it (a bound, or another setting, refuses what the run cannot have)."""
    from stoker.common.config import takes

    seen = set()
    for split in _runs():
        config = _config_of(split, textures)
        assert takes(config, overlap_averaging=True) == (split.overlap_allowed or split.overlapped)
        verdict = diagnose(split)
        seen.add(verdict.kind)
        for name, value in _advised(verdict.text, config).items():
            assert getattr(config, name) != value, (verdict.text, name, "the run does this already")
            assert takes(config, **{name: value}), (verdict.text, name, value, "the run cannot take it")
            decoding = split.producer_utilization >= 0.8 and (split.producer_read_share or 0) < 0.5
            if name in ("producers", "max_producers") and decoding:  # more, on cores each busy with one already
                assert split.producers < (split.cores or 0), (verdict.text, "no core left for another producer")
    assert seen == {"input-bound", "sync-bound", "host-bound"}


def test_an_input_bound_verdict_gives_the_cores_per_device_the_feed_needs():
    """The figure a node is sized by: 1.15 ms of CPU an image is 9.1 cores per device at 7,900 images/s."""
    split = TimeSplit(compute=0.5, input_wait=0.4, averaging=0.0, producers=4, producer_budget=4,
                      producer_utilization=0.97, sync_every=1, auto=False, cores=4, feed_ms_per_image=1.15)
    assert "1.15 ms of CPU per image: 9.1 cores per device at 7,900 images/s" in diagnose(split).text


def test_the_feed_cost_per_image_is_the_stages_of_training_parts_and_the_rest():
    from stoker.observe.diagnosis import feed_cores
    from stoker.pipeline.producer import FeedCost

    gauges = ProducerGauges(2, SimpleNamespace(write=lambda *a, **k: None))
    assert gauges.feed_ms_per_image() is None
    gauges.feed_cost += FeedCost(100, read=0.01, draw=0.0, decode=0.06, resize=0.02, augment=0.0, total=0.1)
    gauges.feed_cost += FeedCost(100, read=0.01, draw=0.0, decode=0.06, resize=0.02, augment=0.0, total=0.1)
    figures = gauges.feed_ms_per_image()
    assert figures == {"read": 0.1, "draw": 0.0, "decode": 0.6, "resize": 0.2, "augment": 0.0, "other": 0.1,
                       "total": 1.0}
    assert feed_cores(figures, samples_per_s=2000, devices=2) == {
        "at_run_rate": 1.0, "at_reference_rate": 7.9, "reference_rate": 7900}

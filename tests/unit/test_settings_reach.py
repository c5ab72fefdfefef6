"""tools/settings_reach.py: what it counts as a setting handed over, and how it reads the hand-offs it recorded."""

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reach():
    spec = importlib.util.spec_from_file_location("settings_reach", ROOT / "tools" / "settings_reach.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_relays_are_files_a_setting_arrives_in_and_is_handed_on_from_and_a_climb_goes_to_a_higher_layer(reach):
    rows = [["cli.py", "run/controller.py", "Controller.__init__", "call", "producer_timeout_s,seed"],
            ["run/controller.py", "pipeline/engine.py", "EngineSpec.from_sections", "call", "producer_timeout_s"],
            ["pipeline/engine.py", "pipeline/pool.py", "ProducerPool.__init__", "call", "producer_timeout_s"],
            ["<outside>", "training/consumer.py", "consumer_main", "call", "precision"],
            ["training/consumer.py", "training/accel.py", "MixedPrecision.__init__", "call", "precision"],
            ["training/consumer.py", "training/consumer.py", "Replica.__init__", "call", "precision"],
            ["run/controller.py", "observe/progress.py", "ProgressView.update", "call", "epochs"],
            ["observe/progress.py", "run/controller.py", "ProgressView.update", "return", "epochs"],
            ["pipeline/pool.py", "run/setups.py", "back_up", "call", "lr"]]
    found = reach.report(rows)
    # cli.py hands on but receives nothing; pool.py and accel.py receive and keep; a call within a file is no hand-off;
    # progress.py is given epochs and gives it back: a relay of epochs; pool.py receives lr from nowhere, hands it on
    assert found["relays"] == ["observe/progress.py (1)", "pipeline/engine.py (1)", "run/controller.py (2)",
                               "training/consumer.py (1)"]  # the controller hands on producer_timeout_s and epochs
    assert found["climbs"] == ["observe/progress.py -> run/controller.py: ProgressView.update",
                               "pipeline/pool.py -> run/setups.py: back_up"]
    assert found["reached"] == ["observe/progress.py", "pipeline/engine.py", "pipeline/pool.py", "run/controller.py",
                                "run/setups.py", "training/accel.py", "training/consumer.py"]
    assert found["furthest"][:2] == ["epochs (2): observe/progress.py, run/controller.py",
                                     "producer_timeout_s (2): pipeline/engine.py, run/controller.py"]


def test_a_relay_is_counted_per_setting_not_for_any_two_settings_crossing_one_file(reach):
    rows = [["run/controller.py", "pipeline/engine.py", "f", "call", "seed"],
            ["pipeline/engine.py", "pipeline/pool.py", "g", "call", "producers"]]
    assert reach.report(rows)["relays"] == []


def test_the_tool_ranks_the_folders_as_the_layout_test_orders_them(reach):
    from tests.unit.test_layout import LAYERS, TOP

    assert [reach.LAYER[folder] for folder in LAYERS] == list(range(len(LAYERS)))
    assert {reach.LAYER[folder] for folder in TOP} == {len(LAYERS)} and len(reach.LAYER) == len(LAYERS) + len(TOP)


def test_run_and_use_are_siblings_not_a_climb(reach):
    rows = [["run/controller.py", "use/loader.py", "f", "call", "seed"],
            ["use/loader.py", "run/setups.py", "g", "call", "seed"]]
    assert reach.report(rows)["climbs"] == []


def test_a_call_within_a_file_is_no_hand_off(reach):
    rows = [["run/controller.py", "run/controller.py", "f", "call", "seed"],
            ["run/controller.py", "run/controller.py", "g", "return", "seed"]]
    assert reach.report(rows) == {"relays": [], "climbs": [], "reached": [], "furthest": []}


def test_outside_stoker_s_code_is_neither_a_relay_nor_reached_nor_a_climb(reach):
    rows = [["<outside>", "training/consumer.py", "consumer_main", "call", "seed"],  # a process's entry
            ["training/consumer.py", "<outside>", "consumer_main", "return", "seed"],  # back to the bootstrap
            ["common/procs.py", "<outside>", "start", "return", "seed"]]
    assert reach.report(rows) == {"relays": [], "climbs": [], "reached": ["training/consumer.py"], "furthest": []}


def test_a_loose_value_counts_under_the_setting_s_name_and_kind_only(reach):
    values = {"producer_timeout_s": 20.0, "ema": 0.0, "out": "/runs/a", "producers": "auto", "compile": False}
    assert reach._loose_setting("producer_timeout_s", 20, values)
    assert reach._loose_setting("out", Path("/runs/a"), values)
    assert reach._loose_setting("producers", "auto", values)
    assert not reach._loose_setting("ema", False, values)  # a bool is not the number 0
    assert not reach._loose_setting("compile", 0, values)
    assert not reach._loose_setting("timeout_s", 20.0, values)  # another name: not followed
    assert not reach._loose_setting("producer_timeout_s", 21.0, values)


def test_a_setting_is_found_in_a_dataclass_two_levels_down_not_three(reach):
    @dataclass
    class Build:
        producer_timeout_s: float

    @dataclass
    class Spec:
        build: Build

    @dataclass
    class Outer:
        spec: Spec

    run = reach.RunValues({"producer_timeout_s": 20.0})
    assert reach._settings_in(Spec(Build(20.0)), (), run) == {"producer_timeout_s"}
    assert reach._settings_in(Outer(Spec(Build(20.0))), (), run) == set()
    assert reach._settings_in(Spec(Build(5.0)), (), run) == set()


def test_a_setting_is_found_in_the_items_of_a_tuple_or_a_list_not_a_dict(reach):
    @dataclass
    class Setup:
        seed: int

    run = reach.RunValues({"seed": 4241, "lr": 0.05371, "batch_size": 64})
    assert reach._settings_in((print, (Setup(4241), "x")), (), run) == {"seed"}  # `start(main, (setup, ...))`
    assert reach._settings_in([Setup(4241), Setup(4241)], (), run) == {"seed"}  # `consumer_setups`' list
    assert reach._settings_in((print, (0.05371,)), (), run) == {"lr"}  # a telling value, nameless in a tuple
    assert reach._settings_in({"batch_size": 64, "rate": 0.05371}, (), run) == set()  # a record, not a way
    assert reach._settings_in(["a"] * 16 + [Setup(4241)], (), run) == set()  # only the first 16 items
    assert reach._settings_in([[[Setup(4241)]]], (), run) == set()  # two containers deep, not three
    itself: list = [0.5]
    itself.append(itself)
    assert reach._settings_in(itself, (), run) == set()  # a list holding itself ends


def test_a_section_holds_every_one_of_its_fields(reach):
    @dataclass(frozen=True)
    class FeedSettings:
        producers: str = "auto"
        producer_timeout_s: float = 20.0

    assert reach._settings_in(FeedSettings(), (FeedSettings,), reach.RunValues({})) == {"producers",
                                                                                      "producer_timeout_s"}


def test_a_telling_value_is_followed_under_another_name_and_a_commonplace_one_is_not(reach):
    run = reach.RunValues({"producer_timeout_s": 21.5, "collective_timeout_s": 21.5, "lr": 0.0537, "out": "/runs/a",
                           "batch_size": 64, "half": 0.5, "whole": 60.0, "precision": "fp32", "warmup_epochs": 0.0})
    assert run.setting_named("hang_timeout_s", 0.0537) == "lr"
    assert run.setting_named("run_dir", Path("/runs/a")) == "out"
    assert run.setting_named("timeout_s", 21.5) is None  # two settings hold it: whose is unknown
    assert run.setting_named("rows", 64) is None  # a counter passes through every integer
    assert run.setting_named("p", 0.5) is None and run.setting_named("seconds", 60.0) is None
    assert run.setting_named("dtype", "fp32") is None  # a short string: too likely by chance
    assert run.setting_named("batch_size", 64) == "batch_size"  # under its own name, any value is followed


def test_arguments_include_those_given_through_star_args_and_star_star_kwargs(reach):
    def call(first, *rest, **named):
        return reach._arguments(sys._getframe())

    assert call(1, 2, 3, lr=0.1) == [("first", 1), ("rest", 2), ("rest", 3), ("lr", 0.1)]


def _traced(reach, tmp_path, source, values, calls, path="pipeline/fake.py"):
    namespace: dict = {}
    exec(compile(source, reach.PACKAGE + path, "exec"), namespace)
    hook, before = reach._make_hook(str(tmp_path), reach.RunValues(values)), sys.getprofile()
    sys.setprofile(hook)
    try:
        calls(namespace)
    finally:
        sys.setprofile(before)
    return [line.split("\t") for path in tmp_path.glob("*.tsv") for line in path.read_text().splitlines()]


def test_the_hook_records_a_call_into_stoker_s_code_that_receives_a_setting(reach, tmp_path):
    def calls(namespace):
        namespace["build"](20.0, "a")
        namespace["build"](3.0, "b")  # not the run's value: nothing more
        namespace["build"](20.0, "c")  # the same call with the same settings: recorded once

    lines = _traced(reach, tmp_path, "def build(producer_timeout_s, name):\n    return name\n",
                    {"producer_timeout_s": 20.0}, calls)
    assert lines == [["<outside>", "pipeline/fake.py", "build", "call", "producer_timeout_s"]]


def test_the_hook_records_a_settings_object_handed_back_not_a_value_worked_out_or_a_method_s_own_object(
        reach, tmp_path):
    source = ("from dataclasses import dataclass\n"
              "@dataclass\nclass Spec:\n    lr: float\n    def scaled(self):\n        return self.lr\n"
              "def make():\n    return Spec(0.0537)\n")

    def calls(namespace):
        namespace["make"]().scaled()

    lines = _traced(reach, tmp_path, source, {"lr": 0.0537}, calls)
    assert ["pipeline/fake.py", "<outside>", "make", "return", "lr"] in lines
    assert not [line for line in lines if line[2] == "Spec.scaled"]  # given `self`, returning a float: neither counts


def test_the_caller_of_a_call_made_through_python_code_outside_stoker_is_the_stoker_code_that_made_it(
        reach, tmp_path):
    source = ("import functools\nfrom dataclasses import dataclass\n"
              "@dataclass\nclass Spec:\n    lr: float\n"
              "class Plan:\n    @functools.cached_property\n    def spec(self):\n        return Spec(0.05371)\n"
              "def read():\n    return Plan().spec\n")
    lines = _traced(reach, tmp_path, source, {"lr": 0.05371}, lambda namespace: namespace["read"](),
                    path="pipeline/plan.py")
    # cached_property's __get__ (Python code of functools) stands between the property and `read`
    assert ["pipeline/plan.py", "pipeline/plan.py", "Plan.spec", "return", "lr"] in lines
    assert not [line for line in lines if "<outside>" in line[:2] and line[2] == "Plan.spec"]


def test_a_call_seen_again_is_recorded_again_only_with_settings_not_yet_seen(reach, tmp_path):
    def calls(namespace):
        for value in (0.05371, 0.05371, 21.37137, 0.05371):
            namespace["build"](value)

    lines = _traced(reach, tmp_path, "def build(value):\n    return None\n",
                    {"lr": 0.05371, "producer_timeout_s": 21.37137}, calls)
    assert [line[4] for line in lines] == ["lr", "producer_timeout_s"]


def test_a_generator_s_arguments_are_not_handed_over_by_whoever_resumes_it(reach, tmp_path):
    source = "def rows(lr):\n    yield 1\n    yield 2\n"

    def calls(namespace):
        list(namespace["rows"](0.05371))

    assert _traced(reach, tmp_path, source, {"lr": 0.05371}, calls) == []


def test_the_settings_own_module_hands_nothing_over(reach, tmp_path):
    source = "def section(lr):\n    return lr\n"
    lines = _traced(reach, tmp_path, source, {"lr": 0.05371}, lambda namespace: namespace["section"](0.05371),
                    path="common/config.py")
    assert lines == []

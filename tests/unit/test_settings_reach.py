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


def test_relays_are_files_that_receive_a_setting_and_hand_it_on_and_a_climb_goes_to_a_higher_layer(reach):
    rows = [["cli.py", "run/controller.py", "Controller.__init__", "config", "TrainConfig"],
            ["run/controller.py", "pipeline/engine.py", "EngineSpec.from_sections", "feed", "FeedSettings"],
            ["pipeline/engine.py", "pipeline/pool.py", "ProducerPool.__init__", "producer_timeout_s", "loose"],
            ["<outside>", "training/consumer.py", "consumer_main", "setup", "ConsumerSetup.ring"],
            ["training/consumer.py", "training/accel.py", "MixedPrecision.__init__", "precision", "loose"],
            ["training/consumer.py", "training/consumer.py", "Replica.__init__", "setup", "ConsumerSetup.ring"],
            ["pipeline/engine.py", "observe/progress.py", "ProgressView.update", "epochs", "loose"]]
    found = reach.report(rows)
    # cli.py hands on but receives nothing; pool.py and accel.py receive and keep; a call within a file is no hand-off
    assert found["relays"] == ["pipeline/engine.py", "run/controller.py", "training/consumer.py"]
    assert found["climbs"] == ["pipeline/engine.py -> observe/progress.py"]
    assert found["reached"] == ["observe/progress.py", "pipeline/engine.py", "pipeline/pool.py", "run/controller.py",
                                "training/accel.py", "training/consumer.py"]


def test_the_tool_ranks_the_folders_as_the_layout_test_orders_them(reach):
    from tests.unit.test_layout import LAYERS, TOP

    assert [reach.LAYER[folder] for folder in LAYERS] == list(range(len(LAYERS)))
    assert {reach.LAYER[folder] for folder in TOP} == {len(LAYERS)} and len(reach.LAYER) == len(LAYERS) + len(TOP)


def test_run_and_use_are_siblings_not_a_climb(reach):
    rows = [["run/controller.py", "use/loader.py", "f", "seed", "loose"],
            ["use/loader.py", "run/setups.py", "g", "seed", "loose"]]
    assert reach.report(rows)["climbs"] == []


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

    values = {"producer_timeout_s": 20.0}
    assert reach._setting_in(Spec(Build(20.0)), (), values) == "Spec.build.Build.producer_timeout_s"
    assert reach._setting_in(Outer(Spec(Build(20.0))), (), values) is None
    assert reach._setting_in(Spec(Build(5.0)), (), values) is None


def test_arguments_include_those_given_through_star_args_and_star_star_kwargs(reach):
    def call(first, *rest, **named):
        return reach._arguments(sys._getframe())

    assert call(1, 2, 3, lr=0.1) == [("first", 1), ("rest", 2), ("rest", 3), ("lr", 0.1)]


def test_the_hook_records_a_call_into_stoker_s_code_that_receives_a_setting(reach, tmp_path):
    source = "def build(producer_timeout_s, name):\n    return name\n"
    namespace: dict = {}
    exec(compile(source, reach.PACKAGE + "pipeline/fake.py", "exec"), namespace)
    hook, before = reach._make_hook(str(tmp_path), {"producer_timeout_s": 20.0}), sys.getprofile()
    sys.setprofile(hook)
    try:
        namespace["build"](20.0, "a")
        namespace["build"](3.0, "b")  # not the run's value: nothing more
    finally:
        sys.setprofile(before)
    lines = [line.split("\t") for path in tmp_path.glob("*.tsv") for line in path.read_text().splitlines()]
    assert lines == [["<outside>", "pipeline/fake.py", "build", "producer_timeout_s", "loose"]]

"""Bad settings fail before any process starts, naming the setting, the value and what is allowed."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from stoker.cli import config_from_args
from stoker.common import procs
from stoker.common.config import AveragingSettings, ConfigError, load_toml, make_config
from stoker.common.procs import check_memory_for_producers
from tests.conftest import run_cli, stoker_processes


@pytest.mark.parametrize("settings,named", [
    ({"producers": 0}, "producers"),
    ({"batch_size": "lots"}, "batch_size"),
    ({"epochs": -1}, "epochs"),
    ({"devices": "tpu:3"}, "devices"),
    ({"augment": "mixup"}, "augment"),
    ({"val_fraction": 1.5}, "val_fraction"),
    ({"data": "/no/such/folder"}, "data"),
    ({"min_producers": 4, "max_producers": 2}, "max_producers"),
    ({"colour": "blue"}, "colour"),
    ({"overlap_averaging": True, "outer_optimizer": "nesterov"}, "overlap_averaging=true cannot be combined"),
    ({"precision": "fp8"}, "precision"),
    ({"channels_last": "maybe"}, "channels_last"),
    ({"producers": 100000}, "producers"),
    ({"max_producers": 100000}, "max_producers"),
    ({"epochs": True}, "epochs"),
    ({"lr": True}, "lr"),
    ({"producers": 8, "max_producers": 4}, "producers=8 is above max_producers=4"),
    ({"producers": True}, "producers"),
    ({"seed": 10**23}, "seed"),
    ({"lr": float("inf")}, "lr"),
    ({"lr": float("nan")}, "lr"),
    ({"cache_size": "lots", "cache_dir": "/tmp"}, "cache_size"),
    ({"cache_size": "50GB"}, "bounds --cache-dir, which is not given"),
])
def test_bad_setting_is_named(settings, named):
    with pytest.raises(ConfigError, match=named):
        make_config(settings)


def test_the_largest_seed_torch_takes_is_taken():
    assert make_config({"seed": 2**64 - 1}).seed == 2**64 - 1


def test_config_is_frozen():
    config = make_config({})
    with pytest.raises(dataclasses.FrozenInstanceError, match="epochs"):
        config.epochs = 3


def test_toml_syntax_error_names_the_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("epochs = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(path)


def test_a_bad_value_from_a_toml_file_names_the_file_and_a_binary_file_is_not_text(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('epochs = "three"\n')
    with pytest.raises(ConfigError, match=r"epochs='three' \(from .*run.toml\)"):
        config_from_args(argparse.Namespace(config=str(path)))
    path.write_bytes(b"\xff\xfe epochs = 3")
    with pytest.raises(ConfigError, match="not a text file"):
        load_toml(path)


def test_toml_values_are_validated_like_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nbatch-size = 32\nsync-every = 4\n')
    config = make_config(load_toml(path))
    assert (config.batch_size, config.sync_every) == (32, 4)


@pytest.mark.parametrize("args,message", [
    (["--producers", "0"], "producers"),
    (["--devices", "cuda:0"], "no CUDA device"),
    (["--batch-size", "100000"], "batch_size"),
    (["--producers", "100000"], "from 1 to 512"),  # once forked until the OOM killer came
    (["--bogus", "1"], "unrecognized arguments"),
])
def test_cli_user_error_exits_2_before_any_process(args, message, textures):
    train, val = textures
    result = run_cli("train", "--data", str(train), "--val", str(val), *args, check=False)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not stoker_processes()


def test_batch_larger_than_dataset_is_refused(textures):
    train, val = textures
    result = run_cli("train", "--data", str(train), "--val", str(val), "--batch-size", "500", check=False)
    assert result.returncode == 2 and "larger than the training set" in result.stderr


def test_toml_paths_are_relative_to_the_toml_files_folder(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "images" / "cat").mkdir(parents=True)
    (project / "run.toml").write_text('data = "images"\nout = "runs/first"\nmodel = "resnet8"\n')
    monkeypatch.chdir(tmp_path)  # not the file's folder
    config = make_config(load_toml(project / "run.toml"))
    assert config.data == project / "images" and config.out == project / "runs" / "first"
    (project / "bad.toml").write_text('data = "imgs"\n')
    with pytest.raises(ConfigError, match=str(project / "imgs")):  # the error shows the path it looked at
        make_config(load_toml(project / "bad.toml"))


def test_more_producers_than_the_memory_holds_is_refused_naming_the_setting(monkeypatch):
    monkeypatch.setattr(procs, "available_memory", lambda: 10 * 2**30)  # this machine's figure moves with its load
    check_memory_for_producers(160)  # 64 MiB each: 160 fill 10 GiB
    with pytest.raises(ValueError, match=r"^initial_producers=161: .* 10.0 GiB is available .* expected at most 160"):
        check_memory_for_producers(161, "initial_producers")


@pytest.mark.parametrize("settings, facts, named", [
    ({"on_consumer_failure": "continue"}, (2, True, False), "works on one machine"),
    ({"on_consumer_failure": "continue"}, (2, False, True), "works with CPU consumers for now"),
    ({"min_consumers": 3}, (2, False, False), "min_consumers=3 is more than the 2 consumer(s) of devices='cpu:2'"),
])
def test_failure_settings_the_run_cannot_keep_are_refused_naming_the_setting(settings, facts, named):
    averaging = AveragingSettings(**settings)
    with pytest.raises(ValueError, match=re.escape(named)):
        averaging.check_failure_settings(*facts, devices="cpu:2")
    averaging.check_failure_settings(3, False, False, devices="cpu:3")  # one CPU machine of enough consumers: kept


def test_a_producer_timeout_over_half_the_collective_timeout_is_warned_of_with_several_consumers_only():
    config = make_config({"producer_timeout_s": 40, "collective_timeout_s": 60})
    assert "producer_timeout_s=40 is more than half of collective_timeout_s=60" in config.producer_timeout_warning(2)
    assert config.producer_timeout_warning(1) is None  # no peer waits on a lone consumer's batch
    assert make_config({"producer_timeout_s": 20, "collective_timeout_s": 60}).producer_timeout_warning(2) is None

"""What a resume reads back from its run folder: a checkpoint written before a setting existed (its missing
settings count as what runs did then), and a config.json or summary.json that stoker did not write."""

from __future__ import annotations

import json

import pytest

from stoker.common.config import ConfigError, TrainConfig, make_config
from stoker.observe.summary import previous_segments
from stoker.run.resume import setting_differences

# The settings this session added, absent from every checkpoint written before it.
ADDED_LATER = ("init", "lr_head_multiplier", "warmup_epochs", "label_smoothing", "mixup", "cutmix", "ema",
               "clip_grad_norm", "no_decay_norm_bias", "random_erasing", "val_image_size")


def _older_checkpoint_settings() -> dict:
    recorded = TrainConfig().as_json()
    for name in ADDED_LATER:
        del recorded[name]
    return recorded


def test_settings_a_checkpoint_does_not_record_count_as_their_values_then_not_as_objects():
    # Runs before the recipe decayed every parameter: that is what the checkpoint continues.
    assert setting_differences(_older_checkpoint_settings(), TrainConfig(no_decay_norm_bias=False)) == []


def test_a_default_that_changed_what_is_trained_is_named_on_resume():
    assert setting_differences(_older_checkpoint_settings(), TrainConfig()) == [
        "no_decay_norm_bias: checkpoint False, now True"]


@pytest.mark.parametrize("saved,message", [
    ("[1]", "config.json holds a list, not the settings"),
    ('{"batch_size": "lots"}', r"batch_size='lots' \(from .*config.json\)"),
])
def test_a_run_folders_config_that_is_not_stokers_is_named_with_its_file(tmp_path, saved, message):
    (tmp_path / "config.json").write_text(saved)
    with pytest.raises(ConfigError, match=message):
        make_config({"resume": str(tmp_path)})


@pytest.mark.parametrize("summary", ["[1, 2]", '{"segments": "abc"}', '{"segments": [{"wall_s": "x"}]}'])
def test_a_summary_that_is_not_stokers_starts_the_timeline_again_with_a_warning(tmp_path, summary, caplog):
    (tmp_path / "summary.json").write_text(summary)
    assert previous_segments(tmp_path) == []
    assert "not a summary stoker wrote" in caplog.text


def test_the_segments_of_a_summary_stoker_wrote_are_kept(tmp_path):
    segment = {"start_step": 0, "end_step": 8, "status": "interrupted", "wall_s": 3.5,
               "throughput_samples_per_s": 120.0}
    (tmp_path / "summary.json").write_text(json.dumps({"segments": [segment]}))
    assert previous_segments(tmp_path) == [segment]

"""What a resume reads back from its run folder: a checkpoint written before a setting existed (its missing
settings count as what runs did then), and a config.json or summary.json that stoker did not write."""

from __future__ import annotations

import json

import pytest

from stoker.common.config import ConfigError, TrainConfig, default_of, make_config
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


# config.json as the single flat TrainConfig (before the settings were sections) wrote it, recorded from that code.
FLAT_CONFIG_JSON = (
    '{"data": "DATA", "val": null, "val_fraction": 0.1, "model": "resnet8", "image_size": null, "augment": "standard", '
    '"devices": "auto", "producers": "auto", "min_producers": 1, "initial_producers": null, "max_producers": null, '
    '"batch_size": 64, "epochs": 2, "optimizer": "sgd", "lr": 0.05, "schedule": "cosine", "momentum": 0.9, '
    '"weight_decay": 0.0005, "sync_every": 1, "outer_optimizer": "none", "outer_lr": 0.7, "outer_momentum": 0.9, '
    '"overlap_averaging": false, "average_in_backward": true, "seed": 0, "out": null, "resume": null, '
    '"checkpoint_every": 0, "slots_per_consumer": 4, "check_replicas_every": 0, "collective_timeout_s": 60.0, '
    '"producer_timeout_s": 20.0, "max_bad_fraction": 0.1, "log_every_s": 10.0, "report": true, "tensorboard": false, '
    '"precision": "fp32", "channels_last": true, "compile": false, "deterministic": false, "init": null, '
    '"lr_head_multiplier": 1.0, "warmup_epochs": 0.0, "label_smoothing": 0.0, "mixup": 0.0, "cutmix": 0.0, '
    '"ema": 0.0, "clip_grad_norm": 0.0, "no_decay_norm_bias": true, "random_erasing": 0.0, "val_image_size": null}')


def test_a_run_folder_written_before_the_sections_resumes_with_its_own_settings(tmp_path):
    recorded = json.loads(FLAT_CONFIG_JSON.replace("DATA", str(tmp_path)))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(recorded))
    resumed = make_config({"resume": str(run), "epochs": 3})  # `--resume RUN_DIR --epochs 3`
    now = {**resumed.as_json(), "resume": None, "epochs": 2}
    assert {name: value for name, value in now.items() if name in recorded} == recorded
    assert all(now[name] == default_of(name) for name in set(now) - set(recorded))  # settings added since
    assert setting_differences(recorded, resumed) == []  # the checkpoint's copy: nothing that changes the plan


def test_a_checkpoint_whose_epoch_offset_is_past_the_training_set_is_refused(tmp_path):
    """A position is bounded before it sizes the rest of its epoch: 121 samples trained of a set of 120."""
    from stoker.run.resume import ResumeError, check_resumable

    config = TrainConfig(resume=tmp_path, epochs=2)
    meta = {"config": config.as_json(), "position": {"epoch": 0, "step": 3, "global_step": 3, "offset": 121}}
    with pytest.raises(ResumeError, match="says 121 samples of its epoch were trained, more than the 120"):
        check_resumable(tmp_path, meta, config, [], {"train": 120, "val": 0})

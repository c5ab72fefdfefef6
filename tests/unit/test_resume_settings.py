"""A checkpoint written before a setting existed: its missing settings count as what runs did then."""

from __future__ import annotations

from stoker.common.config import TrainConfig
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

"""Everything a resume reads from a checkpoint is under a checksum, and anything unreadable or modified falls back
to the previous valid checkpoint with a message: real checkpoint folders, written by `checkpoint.commit`."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from stoker.common import checkpoint


def write_checkpoint(run_dir, global_step: int) -> None:
    """A checkpoint as the controller commits it: tensor files with their checksums, then meta.json."""
    temporary = checkpoint.checkpoint_dir(run_dir, global_step, temporary=True)
    files = {name: checkpoint.save_tensors(temporary / name, {"w": torch.full((3,), float(global_step))})
             for name in (checkpoint.MODEL_FILE, checkpoint.rank_file(0))}
    meta = {"position": {"epoch": global_step // 8, "step": global_step % 8, "global_step": global_step},
            "files": files, "num_consumers": 1, "config": {"seed": 0}, "classes": ["a", "b"]}
    checkpoint.commit(temporary, checkpoint.checkpoint_dir(run_dir, global_step), meta, keep=3)


@pytest.fixture
def two_checkpoints(tmp_path):
    write_checkpoint(tmp_path, 8)
    write_checkpoint(tmp_path, 16)
    return tmp_path


def meta_path(run_dir, global_step: int):
    return checkpoint.checkpoint_dir(run_dir, global_step) / checkpoint.META_FILE


def test_an_untouched_checkpoint_is_the_one_resumed(two_checkpoints):
    folder, meta = checkpoint.newest_valid(two_checkpoints)
    assert folder.name == "step_00000016" and meta["position"]["global_step"] == 16


def test_an_edited_position_is_refused_and_the_previous_checkpoint_used(two_checkpoints, caplog):
    """The review's case: a position moved by 7 steps skipped them while the summary said "missing 0"."""
    path = meta_path(two_checkpoints, 16)
    meta = json.loads(path.read_text())
    meta["position"] = {"epoch": 2, "step": 7, "global_step": 23}
    path.write_text(json.dumps(meta, indent=1))
    with caplog.at_level(logging.WARNING):
        folder, meta = checkpoint.newest_valid(two_checkpoints)
    assert folder.name == "step_00000008" and meta["position"]["global_step"] == 8
    assert "step_00000016/meta.json: checksum mismatch" in caplog.text


@pytest.mark.parametrize("content,reason", [
    ("[]", "not a JSON object"),
    ('{"position": {"epoch": 2, "step": 0, "global_step": 16}}', "no meta_sha256"),
    ('{"files": ', "unreadable"),
    ("", "unreadable"),
])
def test_an_unreadable_meta_json_falls_back_to_the_previous_checkpoint(two_checkpoints, caplog, content, reason):
    meta_path(two_checkpoints, 16).write_text(content)
    with caplog.at_level(logging.WARNING):
        folder, _ = checkpoint.newest_valid(two_checkpoints)
    assert folder.name == "step_00000008"
    assert "skipping checkpoint" in caplog.text and reason in caplog.text


def _newest_valid_after_forging(run_dir, caplog, key: str, value) -> str:
    """Step 16's meta.json with `key` set to `value` under a checksum the forger recomputed: the newest valid
    checkpoint must then be step 8. Returns what was logged."""
    path = meta_path(run_dir, 16)
    meta = json.loads(path.read_text())
    meta[key] = value
    meta[checkpoint.META_CHECKSUM] = checkpoint.meta_checksum(meta)
    path.write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING):
        folder, _ = checkpoint.newest_valid(run_dir)
    assert folder.name == "step_00000008"
    return caplog.text


def test_a_recomputed_checksum_over_a_position_of_another_step_is_refused(two_checkpoints, caplog):
    """A forger (or a bug) that also recomputes the checksum still cannot move a checkpoint to another step."""
    logged = _newest_valid_after_forging(two_checkpoints, caplog, "position",
                                         {"epoch": 2, "step": 7, "global_step": 23})
    assert "'position' says step 23, the folder's name 16" in logged


@pytest.mark.parametrize("pixels", ["2", True, 0, 2.0])
def test_a_pixels_version_that_is_not_a_positive_integer_is_refused(two_checkpoints, caplog, pixels):
    logged = _newest_valid_after_forging(two_checkpoints, caplog, "pixels", pixels)
    assert "'pixels' (the decoder's pixels version) is not a positive integer" in logged

"""An out-of-memory error under `--global-batch fixed` on fewer devices says which setting gave each device how
many samples and what to change."""

from __future__ import annotations

import pytest
import torch

from stoker.training.memory_share import explaining_out_of_memory, fixed_share_note


def test_the_note_names_the_setting_the_share_and_the_way_out():
    note = fixed_share_note(batch_size=64, largest_share=128, consumers=2, global_batch="fixed")
    assert "--global-batch fixed" in note and "2 device(s) up to 128 samples" in note
    assert "--batch-size 64" in note and "--global-batch shrink" in note
    assert fixed_share_note(64, 64, 4, "fixed") == ""  # the run's own share
    assert fixed_share_note(64, 64, 2, "shrink") == ""


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")])
def test_an_out_of_memory_error_in_a_step_is_raised_again_with_the_note(error):
    def step():
        raise error

    with pytest.raises(torch.OutOfMemoryError, match=r"^--global-batch fixed .*128 samples.*\. CUDA out of memory"):
        with explaining_out_of_memory(fixed_share_note(64, 128, 2, "fixed")):
            step()
    with pytest.raises(type(error)) as raised, explaining_out_of_memory(""):
        step()
    assert raised.value is error  # no note: the error as it was
    with pytest.raises(RuntimeError, match="^a shape mismatch$"), explaining_out_of_memory("note"):
        raise RuntimeError("a shape mismatch")

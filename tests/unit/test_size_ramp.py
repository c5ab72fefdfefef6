"""--image-size-ramp: the side of each epoch is FFCV's `get_resolution` (written here from its definition), the
setting is checked with its name, and a ramped ring holds each epoch's training batch at that epoch's side, byte
for byte the batch a ring of that fixed side holds, read back at that side by the feed (also on the staged path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stoker.common.choices import SizeRamp
from stoker.common.config import ConfigError, make_config
from stoker.pipeline.plan import BatchPlan
from stoker.pipeline.producer import Part, ProducerSetup, build_batch
from stoker.pipeline.ring import SlotRing
from stoker.training.to_device import DeviceLoader
from tests.unit.test_feed import FakeOps
from tests.unit.test_val_image_size import _expected, pictures  # noqa: F401 (a fixture)

BATCH = 4


def ffcv_resolution(epoch: int, min_res: int, max_res: int, start_ramp: int, end_ramp: int) -> int:
    """FFCV's `get_resolution` (examples/imagenet, train_imagenet.py) as it defines it."""
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    interp = np.interp([epoch], [start_ramp, end_ramp], [min_res, max_res])
    return int(np.round(interp[0] / 32)) * 32


@pytest.mark.parametrize("ramp", ["160:192@2-8", "160:192@65-76", "128:256@0-9", "160:224@10-20", "96:96@3-5",
                                  "160:192@4-4"])
def test_each_epochs_side_is_ffcvs_get_resolution(ramp):
    parsed = SizeRamp.parse(ramp)
    for epoch in range(90):
        assert parsed.size_at(epoch) == ffcv_resolution(epoch, parsed.low, parsed.high, parsed.start, parsed.end)


def test_sides_off_the_multiples_of_32_stay_within_min_and_max():
    """FFCV's rounding would give 0 px here (12 / 32 rounds to 0) and 224 past a MAX of 209; the ramp keeps each
    side within MIN..MAX, so the ring's slots (sized for MAX) hold every epoch's batch."""
    assert [SizeRamp.parse("8:24@0-4").size_at(epoch) for epoch in range(6)] == [8, 8, 8, 24, 24, 24]
    assert max(SizeRamp.parse("160:209@0-10").size_at(epoch) for epoch in range(12)) == 209
    assert SizeRamp.parse("160:192@2-8").sizes == (160, 192)
    assert SizeRamp.parse("16:48@0-2").sizes == (16, 32, 48)


def test_the_setting_sizes_training_and_validation_and_is_checked_by_name():
    config = make_config({"image_size_ramp": "160:192@2-8"})
    assert (config.resolved_image_size, config.resolved_val_image_size) == (192, 192)
    assert make_config({"image_size_ramp": "160:192@2-8", "val_image_size": 224}).resolved_val_image_size == 224
    assert make_config({"image_size_ramp": "160:192@2-8", "image_size": 192}).resolved_image_size == 192
    for values, words in (({"image_size_ramp": "192:160@2-8"}, "MIN 192 is above MAX 160"),
                          ({"image_size_ramp": "160:192@8-2"}, "END epoch 2 is before START epoch 8"),
                          ({"image_size_ramp": "0:192@2-8"}, "sizes from 8 to 2048 px"),
                          ({"image_size_ramp": "160:4096@2-8"}, "sizes from 8 to 2048 px"),
                          ({"image_size_ramp": "160:192"}, "expected MIN:MAX@START-END"),
                          ({"image_size_ramp": "160:192@2-8", "image_size": 224}, "disagree")):
        with pytest.raises(ConfigError, match="image_size_ramp='") as raised:
            make_config(values)
        assert words in str(raised.value)


@pytest.fixture()
def ramped():
    ring = SlotRing.create(num_slots=2, batch_size=BATCH, image_size=48, num_status=1, val_image_size=24,
                           ramp=SizeRamp.parse("16:48@0-2"), samples=(BATCH, BATCH))
    yield ring
    ring.close()


def test_each_epochs_batch_is_the_fixed_sides_batch(pictures, ramped):  # noqa: F811 (the fixture)
    source, _ = pictures
    setup = ProducerSetup(ramped.spec, source, source, "standard", seed=0)
    for epoch, side in ((0, 16), (1, 32), (2, 48), (7, 48)):
        work = BatchPlan("train", epoch, 0, 0, np.arange(BATCH, dtype=np.int64)[::-1].copy(), BATCH)
        build_batch(Part(epoch, work, 0), setup, ramped, ramped.status[0])
        plain = SlotRing.create(num_slots=2, batch_size=BATCH, image_size=side, num_status=1, samples=(BATCH, BATCH))
        try:
            build_batch(Part(epoch, work, 0), ProducerSetup(plain.spec, source, source, "standard", seed=0), plain,
                        plain.status[0])
            assert ramped.images_of("train", epoch)[0].shape == (BATCH, side, side, 3)
            assert np.array_equal(ramped.images_of("train", epoch)[0], plain.images[0]), epoch
            # Contiguous from the slot's start, as a batch of one side is: the slot's first bytes are the batch.
            assert np.array_equal(ramped.pixels[0, :BATCH * side * side * 3], plain.pixels[0, :BATCH * side * side * 3])
        finally:
            plain.close()


@pytest.mark.parametrize("staged", [False, True], ids=["cpu", "staged"])
def test_the_feed_reads_each_epoch_at_its_side(ramped, staged):
    rng = np.random.default_rng(0)
    ops = FakeOps() if staged else None
    loader = DeviceLoader(ramped, torch.device("cpu"), ops=ops)
    for epoch, side in ((0, 16), (1, 32), (2, 48), (1, 32)):
        view = ramped.images_of("train", epoch)[0]
        view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)
        ramped.counts[0] = BATCH
        images, _, _ = loader.take(0, lambda _: None, epoch=epoch)
        assert tuple(images.shape) == (BATCH, 3, side, side)
        torch.testing.assert_close(images, _expected(view))
    if ops is not None:
        assert not ops.violations

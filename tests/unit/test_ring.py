"""The slot ring's shared memory: allocated when it is made, the same bytes in every process that attaches."""

from __future__ import annotations

import os

import numpy as np
import pytest

from stoker.pipeline.ring import SHM_DIR, SlotRing

KERNEL = tuple(int(part) for part in os.uname().release.split(".")[:2])


@pytest.mark.skipif(KERNEL < (5, 14), reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_creating_the_ring_allocates_all_of_its_memory() -> None:
    """The segment's own blocks, not /dev/shm's use, which any other program on the machine changes meanwhile."""
    ring = SlotRing.create(num_slots=4, batch_size=16, image_size=128, num_status=2)
    try:
        allocated = os.stat(os.path.join(SHM_DIR, ring.spec.name)).st_blocks * 512
        assert allocated >= 0.99 * ring.spec.nbytes, (allocated, ring.spec.nbytes)
    finally:
        ring.close()


def test_an_attached_ring_sees_the_bytes_the_creator_wrote() -> None:
    ring = SlotRing.create(num_slots=3, batch_size=4, image_size=32, num_status=2)
    pixels = np.random.default_rng(0).integers(0, 256, ring.images.shape, dtype=np.uint8)
    ring.images[:] = pixels
    ring.counts[:] = (4, 3, 2)
    attached = SlotRing.attach(ring.spec)
    try:
        assert np.array_equal(attached.images, pixels)
        assert attached.counts.tolist() == [4, 3, 2]
        assert (attached.status == -1).all()
        attached.images[1, 0] = 7
        assert (ring.images[1, 0] == 7).all()
    finally:
        attached.close()
        attached.close()  # idempotent
        ring.close()

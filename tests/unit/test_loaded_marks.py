"""The ring's per-sample marks (`SlotRing.loaded_of`): a file that has loaded whole once may later be decoded only down
to its crop's box, by any producer; a file changed since, or one that never loaded, is read to the end of its scan,
so damage below the box is still refused."""

from __future__ import annotations

import numpy as np
import pytest

from stoker.data.pixels import imaging
from stoker.data.pixels.imaging import make_decode_warnings_errors
from stoker.pipeline.plan import BatchPlan
from stoker.pipeline.producer import Part, ProducerSetup, Source, build_batch
from stoker.pipeline.ring import SlotRing
from tests.conftest import photograph_jpeg, scan_data_start

_jpegcrop = pytest.importorskip("stoker.data.pixels._jpegcrop", reason="the crop-aware decoder was not built")


def damaged_below_the_middle(data: bytes) -> bytes:
    """The same photograph with a tenth of its scan zeroed near the end: libjpeg says so only at the scan's end."""
    start = scan_data_start(data)
    tenth = (len(data) - 2 - start) // 10
    return data[:start + 8 * tenth] + bytes(tenth) + data[start + 9 * tenth:]


@pytest.fixture()
def ring():
    ring = SlotRing.create(num_slots=1, batch_size=2, image_size=64, num_status=1, samples=(2, 0))
    yield ring
    ring.close()


def load_both(ring: SlotRing, setup: ProducerSetup, epoch: int) -> dict:
    _, skipped = build_batch(Part(epoch, BatchPlan("train", epoch, 0, 0, np.arange(2), 2), 0), setup, ring,
                             ring.status[0])
    return skipped


class DecodeSpy:
    """The crop-aware decoder, recording for each call the file's length and whether it read the scan to its end."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    def decode(self, data, *box_and_to_end):
        to_end = bool(box_and_to_end[5]) if len(box_and_to_end) > 5 else True
        self.calls.append((len(data), to_end))
        return _jpegcrop.decode(data, *box_and_to_end)


def test_a_sample_marked_once_it_loads_whole_is_later_decoded_to_its_box_and_a_refused_one_never(ring, tmp_path,
                                                                                             monkeypatch):
    good, bad = tmp_path / "good.jpg", tmp_path / "bad.jpg"
    good.write_bytes(photograph_jpeg(0, False))
    bad.write_bytes(damaged_below_the_middle(photograph_jpeg(1, False)))
    make_decode_warnings_errors()
    spy = DecodeSpy()
    monkeypatch.setattr(imaging, "_jpegcrop", spy)
    setup = ProducerSetup(ring.spec, Source((str(good), str(bad)), np.zeros(2, np.int64)), None, "standard", 0)
    for epoch in range(3):
        assert set(load_both(ring, setup, epoch)) == {1}  # refused every epoch, whatever its crop
    assert ring.loaded_of("train").tolist() == [good.stat().st_size, 0]
    sizes = {good.stat().st_size: "good", bad.stat().st_size: "bad"}
    read_to_end = [(sizes[length], to_end) for length, to_end in spy.calls]
    assert read_to_end.count(("good", True)) == 1 and read_to_end.count(("good", False)) == 2  # epochs 1 and 2
    assert read_to_end.count(("bad", True)) == 3 and ("bad", False) not in read_to_end


def test_a_file_changed_after_it_loaded_is_read_to_its_end_again(ring, tmp_path):
    """The mark is the byte length that loaded: a file rewritten since (here damaged and cut by a byte) is read to
    the end of its scan and refused, as on its first load."""
    paths = [tmp_path / "0.jpg", tmp_path / "1.jpg"]
    for index, path in enumerate(paths):
        path.write_bytes(photograph_jpeg(index, False))
    make_decode_warnings_errors()
    setup = ProducerSetup(ring.spec, Source(tuple(map(str, paths)), np.zeros(2, np.int64)), None, "standard", 0)
    assert load_both(ring, setup, 0) == {}
    paths[1].write_bytes(damaged_below_the_middle(photograph_jpeg(1, False))[:-3] + b"\xff\xd9")
    for epoch in range(1, 6):  # several crops, most of them above the damage
        assert set(load_both(ring, setup, epoch)) == {1}

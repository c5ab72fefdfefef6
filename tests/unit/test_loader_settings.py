"""stoker.Loader's user errors (before any process starts), a user dataset's items built as producers build them,
and rank and world size read at the first iter(), not in the constructor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import stoker
from stoker.common.config import make_config
from stoker.data.formats.user_dataset import DatasetSource


class Squares:
    def __init__(self, side: int = 8) -> None:
        self.side = side

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int):
        return np.random.randint(0, 255, (self.side, self.side, 3), dtype=np.uint8), index % 2


@pytest.mark.parametrize("setting,value", [
    ("batch_size", 0), ("augment", "flip"), ("producers", 0), ("image_size", 4), ("seed", -1), ("device", "tpu:0"),
    ("batch_size", True), ("producers", True), ("producer_timeout_s", "soon"), ("max_bad_fraction", None),
    ("drop_last", "sometimes"), ("channels_last", None), ("device", "mps"), ("device", "meta"),
    ("metrics_file", "/no/such/folder/metrics.jsonl")])
def test_a_bad_setting_is_named_before_anything_starts(textures, setting, value):
    with pytest.raises(ValueError, match=f"^{setting}="):
        stoker.Loader(textures[0], **{"batch_size": 8, setting: value})


def test_more_fixed_producers_than_max_producers_is_refused(textures):
    with pytest.raises(ValueError, match=r"^producers=5 is above max_producers=2"):
        stoker.Loader(textures[0], batch_size=8, producers=5, max_producers=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU this machine lacks")
@pytest.mark.parametrize("device", ["cuda", "cuda:3", torch.device("cuda", 0)])
def test_a_gpu_that_is_not_there_is_refused_in_the_constructor(textures, device):
    with pytest.raises(ValueError, match=r"^device=.*no CUDA device is visible"):
        stoker.Loader(textures[0], batch_size=8, device=device)


def test_a_torch_device_is_taken_as_its_name(textures):
    loader = stoker.Loader(textures[0], batch_size=8, device=torch.device("cpu"))
    assert loader.device_setting == "cpu"


@pytest.mark.parametrize("item,expected", [
    (3, r"dataset\[0\]: expected a pair \(image, label\), got int 3"),
    ((np.zeros((8, 8, 3), np.uint8), "cat"), r"dataset\[0\]: the label is str 'cat'; expected an integer"),
    ((np.zeros((8, 8, 3), np.uint8), 2.0), r"the label is float 2.0"),
    ((np.zeros((8, 8, 3), np.uint8), -1), r"the label is -1; expected a class index from 0 to 2147483647"),
])
def test_a_dataset_item_that_is_not_an_image_and_a_class_index_names_its_index(item, expected):
    with pytest.raises(ValueError, match=expected):
        stoker.Loader([item] * 4, batch_size=2)


@pytest.mark.parametrize("label", [np.int64(1), torch.tensor(1), 1, torch.tensor([1]), np.array([1])])
def test_integer_labels_of_numpy_and_torch_are_taken(label):
    source = DatasetSource([(np.zeros((8, 8, 3), np.uint8), label)], 8)
    assert source.fill(0, np.empty((8, 8, 3), np.uint8), seed=0, epoch=0) == 1


def test_a_label_too_large_for_any_class_count_names_its_item():
    items = [(np.zeros((8, 8, 3), np.uint8), 1)] * 5 + [(np.zeros((8, 8, 3), np.uint8), 10**30)]
    source = DatasetSource(items, 8)  # found by the producer that builds item 5, not by the constructor's look at 0
    with pytest.raises(ValueError, match=r"^dataset\[5\]: the label is 10{30}; expected a class index from 0 to "):
        source.fill(5, np.empty((8, 8, 3), np.uint8), seed=0, epoch=0)


def test_a_missing_folder_is_named(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        stoker.Loader(tmp_path / "absent", batch_size=8)


def test_a_dataset_item_is_seeded_from_seed_epoch_and_index():
    source = DatasetSource(Squares(), 8)
    first, again, other = (np.empty((8, 8, 3), np.uint8) for _ in range(3))
    source.fill(3, first, seed=0, epoch=1)
    np.random.seed(12345)  # whatever state the producer's generators were left in
    source.fill(3, again, seed=0, epoch=1)
    source.fill(3, other, seed=0, epoch=2)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_a_dataset_item_of_another_shape_names_its_index():
    source = DatasetSource(Squares(side=9), 8)
    with pytest.raises(ValueError, match=r"dataset\[4\].*\(8, 8, 3\)"):
        source.fill(4, np.empty((8, 8, 3), np.uint8), seed=0, epoch=0)


def test_rank_and_world_size_are_read_at_the_first_iter(textures, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    loader = stoker.Loader(textures[0], batch_size=8, image_size=16, producers=1, device="cpu")
    monkeypatch.setenv("RANK", "1")  # as Lightning's launcher does, after building its loaders
    monkeypatch.setenv("WORLD_SIZE", "2")
    with loader:
        batches = list(loader)
    assert loader.info.rank == 1 and loader.info.world_size == 2
    assert len(batches) == len(loader) == 8  # ceil(120 / (8 x 2)): each rank gets its part of every step


def test_the_loader_keeps_the_values_its_settings_were_checked_as(textures):
    loader = stoker.Loader(textures[0], batch_size="8", image_size="16", producers="2")
    assert (loader.batch_size, loader.image_size, loader.producers) == (8, 16, 2)
    loader.close()


def test_an_unknown_keyword_is_refused_naming_it(textures):
    with pytest.raises(TypeError, match="unexpected keyword argument 'settings'"):
        stoker.Loader(textures[0], batch_size=8, settings=3)


@pytest.mark.parametrize("value,expected", [("true", True), ("0", False), (True, True)])
def test_drop_last_is_read_as_stoker_train_reads_it(textures, value, expected):
    """One check: the value `stoker train --drop-last` takes, the Loader takes (a bad one: the same message)."""
    assert stoker.Loader(textures[0], batch_size=8, drop_last=value).drop_last is expected
    assert make_config({"drop_last": value}).drop_last is expected


def test_a_bad_drop_last_gets_stoker_train_s_message(textures):
    with pytest.raises(ValueError) as refused:
        stoker.Loader(textures[0], batch_size=8, drop_last="sometimes")
    assert str(refused.value) == str(pytest.raises(ValueError, make_config, {"drop_last": "sometimes"}).value)


@pytest.mark.parametrize("key,value,expected", [
    ("step", -3, "step is -3; expected an integer from 0 to"),
    ("step", 10_000, "step is 10000; expected an integer from 0 to"),
    ("step", 2.5, "step is 2.5"),
    ("epoch", -1, "epoch is -1; expected an integer from 0 to 1073741823"),
    ("epoch", "1", "epoch is '1'"),
])
def test_a_state_whose_position_is_outside_the_epoch_is_refused(textures, key, value, expected):
    """A step of -3 trained 16 samples twice, one past len() gave an empty epoch: refused before any batch."""
    loader = stoker.Loader(textures[0], batch_size=8, device="cpu")
    state = loader.state_dict()
    assert state["step"] == 0 and state["epoch"] == 0
    last = len(loader) - 1
    loader.load_state_dict({**state, "step": last})  # the last batch is a place to resume from
    with pytest.raises(ValueError, match=f"^load_state_dict: the state's {expected}"):
        loader.load_state_dict({**state, key: value})
    if key == "step" and value == 10_000:
        with pytest.raises(ValueError, match=f"from 0 to {last} \\(this loader has {last + 1} batches per epoch\\)"):
            loader.load_state_dict({**state, key: value})


@pytest.mark.parametrize("epoch", [-1, 2**30, 2**40, 1.0, True])
def test_an_epoch_no_loop_can_reach_is_refused_by_set_epoch_and_in_a_state(textures, epoch):
    """set_epoch(2**40) (or a state saying so) made the next iter() wait for ever: the scheduler ends there."""
    loader = stoker.Loader(textures[0], batch_size=8, device="cpu")
    loader.set_epoch(2**30 - 1)  # the last epoch taken
    with pytest.raises(ValueError, match=r"^set_epoch: .*; expected an integer epoch from 0 to 1073741823"):
        loader.set_epoch(epoch)
    with pytest.raises(ValueError, match=r"^load_state_dict: the state's epoch is .*expected an integer"):
        loader.load_state_dict({**loader.state_dict(), "epoch": epoch})


@pytest.mark.parametrize("step,offset,refused", [(15, 0, True), (14, 0, True), (20, 5, True), (0, 120, True),
                                                 (7, 100, False), (3, 3, False)])
def test_a_state_of_another_world_size_whose_offset_its_step_cannot_reach_is_refused(textures, step, offset,
                                                                                     refused):
    """Saved at world size 2 after a resume at another: step 15 with no sample before it gave 0 batches where
    len() said 15, silently. An offset below the step (each step trains a sample) or with nothing left is refused;
    one a step can have reached loads, and len() counts the rest of the epoch from it."""
    loader = stoker.Loader(textures[0], batch_size=8, device="cpu")  # 120 samples: 15 batches
    state = {**loader.state_dict(), "world_size": 2, "step": step, "offset": offset}
    if refused:
        with pytest.raises(ValueError, match=rf"^load_state_dict: the state's offset {offset} does not fit its step "
                                             rf"{step}: expected an offset from {step} to 119"):
            loader.load_state_dict(state)
    else:
        loader.load_state_dict(state)
        assert len(loader) == step + -(-(120 - offset) // 8)
    loader.close()


def test_a_state_saved_by_a_decoder_that_gave_other_pixels_is_taken_with_a_warning(textures, caplog):
    """A state from before pixel versions were recorded (version 1: any DCT scale) resumes the same place; the log
    says that its images are not bitwise the uninterrupted run's. Its own state says nothing."""
    loader = stoker.Loader(textures[0], batch_size=8, device="cpu")
    state = loader.state_dict()
    loader.load_state_dict(state)
    assert "pixels version" not in caplog.text
    loader.load_state_dict({key: value for key, value in state.items() if key != "pixels"})
    assert "pixels version 1, now 2" in caplog.text and "not bitwise" in caplog.text
    for pixels in ("2", True, 0):
        with pytest.raises(ValueError, match=r"^load_state_dict: the state.s pixels is .*; expected a positive"):
            loader.load_state_dict({**state, "pixels": pixels})
    loader.close()

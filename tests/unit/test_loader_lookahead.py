"""stoker.Loader builds the next epoch's first batches while the loop ends the current one (producers do not wait
for the loop's epoch boundary): what was built ahead is the same as a fresh loader's epoch, it counts in the books
only once the loop enters that epoch, and a jump (set_epoch to another epoch) drops it."""

from __future__ import annotations

import time

import pytest
import torch

import stoker
from stoker.common.procs import POLL_S


def make_loader(textures) -> stoker.Loader:
    return stoker.Loader(textures[0], batch_size=32, image_size=16, producers=1, device="cpu", seed=3)


def epoch_batches(loader: stoker.Loader, epoch: int) -> list[torch.Tensor]:
    loader.set_epoch(epoch)
    return [images.clone() for images, _ in loader]


@pytest.fixture(scope="module")
def fresh(textures) -> dict[int, list[torch.Tensor]]:
    """Epochs 1 and 3 as a loader's first iteration gives them (nothing built ahead)."""
    batches = {}
    for epoch in (1, 3):
        with make_loader(textures) as loader:
            batches[epoch] = epoch_batches(loader, epoch)
    return batches


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def wait_for_a_built_batch(loader: stoker.Loader) -> None:
    deadline = time.monotonic() + 30
    while not loader._ready and time.monotonic() < deadline:
        loader._pump(POLL_S)


def test_the_next_epochs_first_batches_are_built_while_this_one_ends(textures, fresh):
    with make_loader(textures) as loader:
        epoch_batches(loader, 0)
        wait_for_a_built_batch(loader)  # the loop is between epochs: nothing asked for epoch 1 yet
        assert loader._ready and (loader._ready[0].epoch, loader._ready[0].step) == (1, 0)
        books = loader.summary()["epoch_accounting"]
        assert [(row["epoch"], row["missing"]) for row in books] == [(0, 0)]  # epoch 1 not booked before it starts
        ahead = epoch_batches(loader, 1)
        books = loader.summary()["epoch_accounting"]
    assert all(torch.equal(a, b) for a, b in zip(ahead, fresh[1], strict=True))
    assert [(row["epoch"], row["consumed"], row["missing"]) for row in books] == [(0, 120, 0), (1, 120, 0)]


def test_a_jump_to_another_epoch_drops_what_was_built_ahead(textures, fresh):
    with make_loader(textures) as loader:
        epoch_batches(loader, 0)
        wait_for_a_built_batch(loader)
        jumped = epoch_batches(loader, 3)
        books = loader.summary()["epoch_accounting"]
    assert all(torch.equal(a, b) for a, b in zip(jumped, fresh[3], strict=True))
    assert [(row["epoch"], row["consumed"], row["missing"]) for row in books] == [(0, 120, 0), (3, 120, 0)]

"""A user's own map-style dataset as a source of samples: its `__getitem__` runs in stoker's producers.

Each item must be an HWC uint8 image of the loader's size and an integer label. Before each item the producer
seeds Python's `random`, NumPy's global generator and torch from (seed, epoch, index), so a dataset that augments
with any of them gives the same bytes whichever producer builds the sample, however many there are.
"""

from __future__ import annotations

import os
import pickle
import random
import sys
from collections.abc import Iterator, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any, overload

import numpy as np


class DatasetNotLoadable(RuntimeError):
    """A producer could not unpickle the user's dataset."""


class ItemNames(Sequence[str]):
    """`paths[i]` of a dataset: how messages and `skipped_files` name item i."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self._size = size

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._size))]
        if not -self._size <= index < self._size:
            raise IndexError(index)
        return f"{self.name}[{index % self._size}]"

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(self._size))


def item_seed(seed: int, epoch: int, index: int) -> int:
    """One 63-bit seed per (seed, epoch, index): independent of the batch, the producer and their number."""
    return int(np.random.SeedSequence([seed, epoch, index, 0xDA7A]).generate_state(1, np.uint64)[0] >> 1)


def seed_everything(seed: int) -> None:
    """The three generators a user's augmentation may draw from."""
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class DatasetSource:
    """Wraps a map-style dataset (`len` and `__getitem__`); pickled to every producer (spawn), so the dataset
    must pickle: a class defined at the top level of a module or of the script."""

    def __init__(self, dataset: Any, image_size: int) -> None:
        self._dataset: Any = dataset
        self._pickled: bytes | None = None
        self.image_size = image_size
        self.paths = ItemNames(type(dataset).__name__, len(dataset))
        self.labels = np.zeros(0, dtype=np.int64)  # known only once an item is built
        self._torch_threads_set = False

    def __getstate__(self) -> dict[str, Any]:
        # The dataset travels as bytes, loaded at the producer's start (`load`): a class a producer cannot import
        # (one defined under `if __name__ == "__main__":`) then fails in the producer's own code, which reports it
        # to the loop at once, not in multiprocessing's start-up, which prints a traceback and exits, again for every
        # replacement, until the run gives up without saying why.
        # ForkingPickler, as multiprocessing itself would: torch's reducers send tensors through shared memory.
        pickled = self._pickled if self._pickled is not None else bytes(ForkingPickler.dumps(self._dataset))
        return {"_dataset": None, "_pickled": pickled, "image_size": self.image_size, "paths": self.paths,
                "labels": self.labels, "_torch_threads_set": False}

    @property
    def dataset(self) -> Any:
        if self._dataset is None and self._pickled is not None:
            try:
                self._dataset, self._pickled = pickle.loads(self._pickled), None  # not held twice
            except Exception as error:
                raise DatasetNotLoadable(
                    f"the dataset ({self.paths.name}) could not be loaded in a producer process: "
                    f"{type(error).__name__}: {error}. Producers are spawned: define its class at the top level "
                    "of a module or of the script, outside `if __name__ == \"__main__\":`") from error
        return self._dataset

    def load(self) -> None:
        """What the first item would otherwise pay for (unpickling the dataset, importing its modules: seconds of a
        contended core, once taken for a hang on that item): done at the producer's start, as its imports are."""
        self._one_torch_thread()
        _ = self.dataset

    def read(self, sample_id: int) -> bytes:
        raise TypeError("a dataset's items are built by `fill`, not read as files")

    def fill(self, sample_id: int, out: np.ndarray, seed: int, epoch: int) -> int:
        """Build item `sample_id` of `epoch` into `out` (HWC uint8); returns its label."""
        self._one_torch_thread()
        seed_everything(item_seed(seed, epoch, sample_id))
        image, label = unpack_item(self.dataset[sample_id], sample_id)
        pixels = _as_array(image)
        expected = (self.image_size, self.image_size, 3)
        if pixels.shape != expected or pixels.dtype != np.uint8:
            raise ValueError(f"dataset[{sample_id}]: the image is {pixels.dtype} of shape {tuple(pixels.shape)}; "
                             f"expected uint8 of shape {expected} (HWC, the loader's image_size)")
        out[...] = pixels
        return label

    def _one_torch_thread(self) -> None:
        """A producer is one core's worth of work: torch's own thread pool would only compete with its peers."""
        if not self._torch_threads_set:
            import torch

            torch.set_num_threads(1)
            self._torch_threads_set = True


# Far above any class count, and what every label type on the way holds (a slot's int64, a GPU's int32 index).
MAX_LABEL = 2**31 - 1


def unpack_item(item: Any, index: int) -> tuple[Any, int]:
    """(image, label) of item `index`, the label a class index >= 0 (an int, a NumPy integer, a 0-d tensor)."""
    try:
        image, label = item
    except (TypeError, ValueError):
        raise ValueError(f"dataset[{index}]: expected a pair (image, label), got {_describe(item)}") from None
    number = _plain(label)
    if isinstance(number, (bool, np.bool_)) or not isinstance(number, (int, np.integer)):
        raise ValueError(f"dataset[{index}]: the label is {_describe(label)}; expected an integer class index >= 0")
    if not 0 <= number <= MAX_LABEL:
        raise ValueError(f"dataset[{index}]: the label is {int(number)}; expected a class index from 0 to "
                         f"{MAX_LABEL}")
    return image, int(number)


def _plain(label: Any) -> Any:
    """A tensor or array of one element (shape () or (1,): `torch.tensor([3])`) as its Python number; anything
    else as it is."""
    shape = getattr(label, "shape", None)
    if shape is not None and hasattr(label, "item") and int(np.prod(shape)) == 1:
        return label.item()
    return label


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _as_array(image: Any) -> np.ndarray:
    if isinstance(image, np.ndarray):
        return image
    if hasattr(image, "numpy"):  # a torch tensor
        return image.detach().cpu().numpy()
    return np.asarray(image)


def check_dataset(dataset: Any) -> None:
    """In the user's process, before anything starts: a map-style dataset with items."""
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ValueError(f"data: a {type(dataset).__name__} is neither a path (ImageFolder, shards) nor a map-style "
                         "dataset (with __len__ and __getitem__)")
    if len(dataset) == 0:
        raise ValueError(f"data: the {type(dataset).__name__} is empty")
    if type(dataset).__module__ == "__main__" and not _main_importable():
        raise ValueError(f"data: the {type(dataset).__name__} class is defined in a script with no file (read from "
                         "standard input, `python -c`, or an interactive session), which the producers, started "
                         "as new processes (spawn), cannot import; define the class in a .py file and import it")


def _main_importable() -> bool:
    """Whether a spawned process can import the main script again (and with it the classes defined there)."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) is not None:  # python -m module
        return True
    path = getattr(main, "__file__", None)
    return path is not None and os.path.isfile(path)

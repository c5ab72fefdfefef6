"""`stoker eval` and `stoker predict`: a trained model over a folder, fed by stoker's producers.

Both read the model file's card (model, classes, image size, preprocessing) and ask nothing again. The images go
through the `stoker.Loader` engine with validation's preprocessing (augment "none": the centre crop, stoker's
decoder), as uint8 on the host; each batch goes to the next of the devices given (one model replica on each),
where it is normalized as the consumer's feed does (`feed.normalize_pixels`) and run. An unusable image is
listed with its reason, never fatal.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from stoker.common.config import check_data_path
from stoker.common.devices import available_cores, resolve_devices
from stoker.common.terminal import printable
from stoker.data.formats.image_list import list_images
from stoker.data.index import PackedIndex
from stoker.data.sources import load_source
from stoker.observe.evaluation import per_class_accuracy, whole_confusion
from stoker.training.to_device import normalization_constants, normalize_pixels
from stoker.training.val_totals import ValTotals
from stoker.use.inference import LoadedModel, load
from stoker.use.inference_settings import InferenceSettings
from stoker.use.loader import Loader

log = logging.getLogger(__name__)

MAX_BAD_FRACTION = 1.0  # every image may be bad: each is listed, none stops the command
DEFAULT_SETTINGS = InferenceSettings()


@dataclass(frozen=True)
class Scored:
    """One batch: the samples' positions in the index, their labels (on the host) and logits (on the device that
    ran them: nothing waits for a device until the pass ends)."""

    positions: np.ndarray
    labels: torch.Tensor
    logits: torch.Tensor


class Replicas:
    """The model on each distinct device; batches go to them in turn (on GPUs the launches are asynchronous, so
    the devices run side by side). Nothing in a batch's way waits for a device: the normalization constants are
    on each device once, and every batch goes there from pinned memory (a copy from pageable memory waits for
    the device's stream to drain first)."""

    def __init__(self, loaded: LoadedModel, devices: list[str]) -> None:
        self.loaded = loaded
        self.devices = [torch.device(d) for d in dict.fromkeys(devices)]
        if all(d.type == "cpu" for d in self.devices):
            torch.set_num_threads(available_cores())  # one process: every core for the one CPU replica
        self.models: list[nn.Module] = [copy.deepcopy(loaded.model).to(d).eval() for d in self.devices]
        host = normalization_constants(loaded.card.mean, loaded.card.std)
        self.constants = [tuple(c.to(d) for c in host) for d in self.devices]
        self.turn = 0

    def run(self, pixels: torch.Tensor) -> torch.Tensor:
        """Logits of a uint8 NCHW batch, on the device that ran it."""
        device, model, (mean_255, inv_std_255) = (self.devices[self.turn], self.models[self.turn],
                                                  self.constants[self.turn])
        self.turn = (self.turn + 1) % len(self.devices)
        # NHWC again (the Loader hands out an NCHW view of it), channels_last as the trainer feeds its model
        images = normalize_pixels(to_device(pixels.permute(0, 2, 3, 1), device), mean_255, inv_std_255,
                                  torch.channels_last)
        with torch.no_grad():
            return model(images)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the host) copied to `device` without the host waiting: through pinned memory to a GPU (torch's
    caching host allocator reuses a pinned block only once the copy from it is done)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def scored_batches(loaded: LoadedModel, index: PackedIndex, settings: InferenceSettings,
                   skipped: dict[str, str]) -> Iterator[Scored]:
    """The model's logits for every usable sample of `index`; what the producers could not use lands in
    `skipped` (path: reason) once the pass ends."""
    replicas = Replicas(loaded, resolve_devices("cpu:1" if settings.devices == "cpu" else settings.devices))
    loader = Loader(index, batch_size=settings.batch_size, image_size=loaded.image_size, augment="none",
                    producers=settings.producers, device=None, drop_last=False, max_bad_fraction=MAX_BAD_FRACTION)
    with loader:
        for pixels, labels in loader:
            positions = loader.batch_ids.copy()
            if len(positions):
                yield Scored(positions, labels, replicas.run(pixels).float())
        for item in loader.summary()["skipped_files"]:  # the scan's refusals and the producers'
            skipped[item["path"]] = item["reason"]


# ---- eval ----------------------------------------------------------------------------------------------------------

def eval_index(data: Path | str, classes: tuple[str, ...]) -> tuple[PackedIndex, np.ndarray]:
    """The labelled data and, per class of the data, the model's output for it; a class the model does not know
    is an error naming it (and what the model knows)."""
    check_data_path("data", data)
    index = load_source(data)
    known = {name: k for k, name in enumerate(classes)}
    unknown = [name for name in index.classes if name not in known]
    if unknown:
        shown = ", ".join(repr(n) for n in unknown[:10]) + (f" and {len(unknown) - 10} more" if len(unknown) > 10
                                                             else "")
        raise ValueError(f"data={str(data)!r}: class folder(s) {shown} are not classes of the model (it knows "
                         f"{', '.join(map(printable, classes[:20]))}{', ...' if len(classes) > 20 else ''})")
    return index, np.asarray([known[name] for name in index.classes], dtype=np.int64)


def evaluate(model_file: Path, data: Path | str, settings: InferenceSettings = DEFAULT_SETTINGS,
             model: str | None = None, accept_changed_module: bool = False) -> dict[str, Any]:
    """Loss, top-1, top-5, per-class accuracy and the confusion matrix of the model on `data`. `model`: the
    `module:function` the card names, which its module's import needs (`--model`; `inference.rebuild`), taken
    as it is now with `accept_changed_module` (`--accept-changed-module`)."""
    loaded = load(model_file, model=model, accept_changed_module=accept_changed_module)
    index, to_model = eval_index(data, loaded.classes)
    per_device: dict[torch.device, ValTotals] = {}
    skipped: dict[str, str] = {}
    lookup = torch.from_numpy(to_model)
    for batch in scored_batches(loaded, index, settings, skipped):
        device = batch.logits.device
        totals = per_device.setdefault(device, ValTotals(len(loaded.classes), device))
        totals.add(batch.logits, to_device(lookup[batch.labels], device))
    result = _summed(per_device.values(), len(loaded.classes)).reduce()
    refused = {s.path: s.reason for s in index.skipped}
    return {
        "model": str(loaded.path), "data": str(data), "architecture": loaded.card.model,
        "num_classes": len(loaded.classes), "image_size": loaded.image_size, "count": result.count if result else 0,
        "loss": result.loss if result else None, "top1": result.accuracy if result else None,
        "top5": result.top5 if result else None,
        "per_class": per_class_accuracy(result.confusion, list(loaded.classes)) if result else None,
        "confusion": whole_confusion(result.confusion, list(loaded.classes)) if result else None,
        "skipped_files": [{"path": p, "reason": r} for p, r in {**refused, **skipped}.items()],
    }


def _summed(totals: Iterable[ValTotals], num_classes: int) -> ValTotals:
    """Every device's totals added on the host (the figures of one pass over all of them)."""
    whole = ValTotals(num_classes, torch.device("cpu"))
    for part in totals:
        whole.sums += part.sums.cpu()
        whole.confusion += part.confusion.cpu()
    return whole


# ---- predict -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prediction:
    path: str  # as the user named the folder, then the file's path below it
    classes: tuple[str, ...]  # the top k, most probable first
    probabilities: tuple[float, ...]
    error: str = ""  # why the file could not be used (then no classes)


def predict(model_file: Path, images: Path, top_k: int = 5, settings: InferenceSettings = DEFAULT_SETTINGS,
            model: str | None = None, accept_changed_module: bool = False) -> tuple[int, list[Prediction]]:
    """(k, predictions): the top-k classes (k at most the model's classes) and their probabilities for every
    image in `images` (recursively), bad files included with their reason; sorted by path. `model`: as for
    `evaluate`."""
    loaded = load(model_file, model=model, accept_changed_module=accept_changed_module)
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k={top_k!r}: expected an integer >= 1")
    index = list_images(images)
    k = min(top_k, len(loaded.classes))
    root_real = os.path.realpath(images)
    shown = {path: _shown_path(images, root_real, path) for path in index.paths}
    rows: list[Prediction] = []
    skipped: dict[str, str] = {}
    tops = [(batch.positions, batch.logits.softmax(1).topk(k, dim=1))
            for batch in scored_batches(loaded, index, settings, skipped)]
    for positions, top in tops:  # read once every batch has been launched
        for position, values, outputs in zip(positions, top.values.tolist(), top.indices.tolist()):
            rows.append(Prediction(shown[index.paths[int(position)]], tuple(loaded.classes[o] for o in outputs),
                                   tuple(values)))
    rows += [Prediction(shown.get(p) or _shown_path(images, root_real, p), (), (), r) for p, r in skipped.items()]
    return k, sorted(rows, key=lambda row: row.path)


def _shown_path(images: Path, root_real: str, path: str) -> str:
    return os.path.join(str(images), os.path.relpath(path, root_real))


def prediction_rows(predictions: list[Prediction], top_k: int) -> Iterator[list[str]]:
    """CSV rows: path, then class and probability for each of the top k, then the error (empty when none)."""
    yield ["path", *[f"{name}_{i}" for i in range(1, top_k + 1) for name in ("class", "probability")], "error"]
    for row in predictions:
        pairs = [value for c, p in zip(row.classes, row.probabilities) for value in (c, f"{p:.6g}")]
        yield [row.path, *pairs, *[""] * (2 * top_k - len(pairs)), row.error]

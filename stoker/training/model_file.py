"""`model.pt`, `model_best.pt`, `model_ema.pt`: the weights and everything using them needs, in one file.

A model file is a dict that `torch.load(weights_only=True)` reads (strings, numbers, lists, dicts and tensors; no
pickled objects): the weights under `state_dict` (what `--init` and a plain `load_state_dict` take), and beside them
the card: the model as `--model` takes it, the class names in output order, the image size, and the validation
preprocessing (the centre square of 0.875 of the short side resized to the image size, stoker's decoder; then
(x / 255 - mean) / std). Without the card the same weights scored 76.5% with a plain resize and 96.8% with
stoker's own decode on 400 digits (docs/benchmarks.md): the preprocessing is part of the model.
"""

from __future__ import annotations

import logging
import math
import pickle
import zipfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from stoker.common.checkpoint import describe_load_error, save_tensors
from stoker.data.pixels.imaging import CENTER_CROP_FRACTION
from stoker.training.archive import ArchiveError, check_torch_archive
from stoker.training.model_source import locate_module
from stoker.training.to_device import MEAN, STD

FORMAT_KEY = "stoker_model"  # its value is the format's version
FORMAT_VERSION = 1
log = logging.getLogger(__name__)

BEST_MODEL_FILE = "model_best.pt"
Kind = Literal["final", "best", "ema"]
KINDS = ("final", "best", "ema")


class ModelFileError(ValueError):
    """Not a model file stoker wrote, or a damaged one; the message names the file."""


@dataclass(frozen=True)
class ModelCard:
    """What using the weights needs, and where they came from."""

    model: str  # as --model takes it: a built-in name or module:function
    classes: tuple[str, ...]  # output k is classes[k]
    image_size: int
    mean: tuple[float, float, float] = MEAN
    std: tuple[float, float, float] = STD
    crop_fraction: float = CENTER_CROP_FRACTION
    # A module:function model: the module's file and SHA-256 when it was trained; stoker.load imports the module
    # only while its files still hash to this (model_source.check_recorded_module).
    module_file: str | None = None
    module_sha256: str | None = None
    kind: Kind = "final"
    epoch: int | None = None  # counted from 1, as the "epoch N: val accuracy" lines: the epoch model_best.pt is from
    val_accuracy: float | None = None

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def as_dict(self) -> dict[str, Any]:
        card = asdict(self)
        card.update(classes=list(self.classes), mean=list(self.mean), std=list(self.std))
        card["preprocess"] = (f"centre square of {self.crop_fraction} x the short side, resized to "
                              f"{self.image_size}x{self.image_size} RGB; (x / 255 - mean) / std")
        return card


def model_card(model: str, classes: tuple[str, ...] | list[str], image_size: int) -> ModelCard:
    """The card of a run's model; for module:function, the module's file as it is now (before training)."""
    module_file, digest = _module_source(model)
    return ModelCard(model, tuple(classes), image_size, module_file=module_file, module_sha256=digest)


def _module_source(model: str) -> tuple[str | None, str | None]:
    if ":" not in model:
        return None, None
    try:  # the same function stoker.load checks the module with before importing it
        source = locate_module(model.split(":", 1)[0])
    except (ValueError, ImportError, OSError) as error:
        log.warning("model %s: its module's files cannot be hashed (%s): stoker.load will need model=", model,
                    error)
        return None, None
    return str(source.file), source.sha256


def save_model(path: Path, state_dict: dict[str, torch.Tensor], card: ModelCard) -> None:
    """Atomically (temporary file, fsync, rename), CPU tensors."""
    save_tensors(path, {FORMAT_KEY: FORMAT_VERSION, "state_dict": state_dict, "card": card.as_dict()})


def save_best(path: Path, state_dict: dict[str, torch.Tensor], card: ModelCard, epoch: int,
              accuracy: float) -> None:
    save_model(path, state_dict, replace(card, kind="best", epoch=epoch, val_accuracy=accuracy))


def read_model(path: Path) -> tuple[ModelCard, dict[str, torch.Tensor]]:
    """The card and the weights, or a ModelFileError naming `path` and what is wrong with it."""
    loaded = _load(path)
    if isinstance(loaded, dict) and FORMAT_KEY not in loaded and loaded and all(
            isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ModelFileError(f"{path}: a plain state_dict, without the card stoker.load needs (model, classes, "
                             "image size); stoker train writes one into RUN_DIR/model.pt (a checkpoint's model.pt "
                             "and files of other tools have none)")
    if not isinstance(loaded, dict) or loaded.get(FORMAT_KEY) is None:
        raise ModelFileError(f"{path}: not a stoker model file (expected the dict stoker train writes as "
                             f"model.pt, with a {FORMAT_KEY!r} key; found {_describe(loaded)})")
    if loaded[FORMAT_KEY] != FORMAT_VERSION:
        raise ModelFileError(f"{path}: model file format {loaded[FORMAT_KEY]!r}; this stoker reads version "
                             f"{FORMAT_VERSION}")
    state = loaded.get("state_dict")
    if not isinstance(state, dict) or not state or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ModelFileError(f"{path}: its 'state_dict' is not a mapping of names to tensors")
    card = _card(path, loaded.get("card"))
    if problem := _head_problem(card, state):
        raise ModelFileError(f"{path}: {problem}")
    return card, state


def _load(path: Path) -> Any:
    try:
        if not path.is_file():
            raise ModelFileError(f"{path}: no such file")
        _check_archive(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except ModelFileError:
        raise
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError, ValueError, OSError) as error:
        raise ModelFileError(f"{path}: not a model file torch can load safely ({describe_load_error(error)})"
                             ) from None


def _check_archive(path: Path) -> None:
    try:
        check_torch_archive(path, "a model file")
    except ArchiveError as error:
        raise ModelFileError(f"{path}: {error}") from None


def _card(path: Path, raw: Any) -> ModelCard:
    if not isinstance(raw, dict):
        raise ModelFileError(f"{path}: no card (model, classes, image size)")
    try:
        card = ModelCard(model=raw["model"], classes=tuple(raw["classes"]), image_size=raw["image_size"],
                         mean=tuple(raw["mean"]), std=tuple(raw["std"]),
                         crop_fraction=raw["crop_fraction"], module_file=raw.get("module_file"),
                         module_sha256=raw.get("module_sha256"), kind=raw.get("kind", "final"),
                         epoch=raw.get("epoch"), val_accuracy=raw.get("val_accuracy"))
    except (KeyError, TypeError) as error:
        raise ModelFileError(f"{path}: its card lacks {error} (model, classes, image_size, mean, std, "
                             "crop_fraction)") from None
    if problem := _card_problem(card):
        raise ModelFileError(f"{path}: its card {problem}")
    return card


def _card_problem(card: ModelCard) -> str | None:
    """What a card that loaded may still get wrong (written by hand, or by a forger who kept the archive whole)."""
    if not isinstance(card.model, str) or not card.model:
        return "names no model"
    if not card.classes or not all(isinstance(c, str) for c in card.classes):
        return "has no class names"
    if type(card.image_size) is not int or not 8 <= card.image_size <= 2048:
        return f"has image_size {card.image_size!r} (expected an integer from 8 to 2048)"
    numbers = (*card.mean, *card.std, card.crop_fraction)
    if len(card.mean) != 3 or len(card.std) != 3 or not all(isinstance(v, float) for v in numbers):
        return "has no mean and std of 3 numbers each"
    if not all(map(math.isfinite, numbers)) or min(card.std) <= 0 or not 0 < card.crop_fraction <= 1:
        return (f"has mean {card.mean}, std {card.std} or crop_fraction {card.crop_fraction} out of range "
                "(finite numbers, std above 0, crop_fraction in (0, 1])")
    return _record_problem(card)


def _record_problem(card: ModelCard) -> str | None:
    """The card's account of where it came from: a resume steers by `val_accuracy` (which model_best.pt a later
    validation replaces), so it is a fraction or nothing, never a string or 5.0."""
    if card.kind not in KINDS:
        return f"has kind {card.kind!r} (expected one of {', '.join(KINDS)})"
    if card.epoch is not None and (type(card.epoch) is not int or card.epoch < 1):
        return f"has epoch {card.epoch!r} (expected an integer from 1)"
    accuracy = card.val_accuracy
    if accuracy is not None and (type(accuracy) is not float or not 0.0 <= accuracy <= 1.0):
        return f"has val_accuracy {accuracy!r} (expected a fraction from 0 to 1)"
    return None


def _head_problem(card: ModelCard, state: dict[str, torch.Tensor]) -> str | None:
    """The card's class count sizes the model built for the weights: a count no weight has as its outputs (a
    forged card listing 500,000 classes beside a 10-class head) is refused before anything that size is built.
    Any classifier with K outputs holds a weight of K rows (a linear or 1x1-convolution head), wherever its
    architecture puts it."""
    outputs = {tensor.shape[0] for tensor in state.values() if tensor.dim() >= 2}
    if card.num_classes in outputs:
        return None
    heads = [f"{name} {tuple(t.shape)}" for name, t in state.items() if t.dim() >= 2][-1:]
    return (f"its card lists {card.num_classes} classes, but no weight in its state_dict has {card.num_classes} "
            f"outputs (the last weight is {heads[0] if heads else 'absent'}): the card does not belong to "
            "these weights")


def _describe(loaded: Any) -> str:
    if isinstance(loaded, dict):
        return f"a dict with keys {sorted(map(str, loaded))[:8]}"
    return type(loaded).__name__



def recorded_accuracy(path: Path) -> float | None:
    """The validation accuracy an existing model_best.pt records; None without one (or with one that does not
    load: it is then replaced at the next validation, with a warning)."""
    if not path.exists():
        return None
    try:
        return read_model(path)[0].val_accuracy
    except ModelFileError as error:
        log.warning("%s; the next validation replaces it", error)
        return None

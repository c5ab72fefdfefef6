"""`stoker.load(RUN_DIR or MODEL.pt)`: a trained model, its classes, and the preprocessing validation used.

    model = stoker.load("runs/photos")
    x = model.preprocess("cat.jpg")                    # exactly the tensor validation gave that file
    probabilities = model(x[None]).softmax(1)[0]
    print(model.classes[int(probabilities.argmax())])

`preprocess` decodes with stoker's own decoder (libjpeg-turbo at a reduced scale, libpng or Pillow), takes the
centre square of 0.875 of the short side, resizes it with OpenCV as the producers do, and normalizes with the
mean and std the model was trained with, in the same float32 operations as the consumer's feed: the same file
gives the same tensor, bit for bit. A model of `--model module:function` is rebuilt by importing that module
from the working directory or PYTHONPATH, as training did, but only when the caller names that same
`module:function` (`model="module:function"`, `--model` of eval and predict: the file's card alone never chooses
code to run) and the file the import would run hashes to the SHA-256 training recorded (else a ValueError; pass
`model=function` to build it yourself).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from stoker.common.checkpoint import describe_load_error
from stoker.data.pixels.imaging import (
    CENTER_CROP_FRACTION,
    UnusableImage,
    center_crop_box,
    load_into,
    resize_box_into,
    to_rgb_array,
)
from stoker.training.model_file import ModelCard, ModelFileError, read_model
from stoker.training.model_source import ModuleNotVerified, check_recorded_module, import_verified
from stoker.training.models import build_model
from stoker.training.to_device import normalization_constants, normalize_pixels

log = logging.getLogger(__name__)

MODEL_FILE = "model.pt"
ImageLike = str | Path | bytes | bytearray | memoryview | Image.Image | np.ndarray


class LoadedModel:
    """The model (eval mode, on `device`), its `classes` in output order, its `image_size` and `card`. Calling it
    runs the model on a normalized (B, 3, S, S) batch, such as `preprocess` gives."""

    def __init__(self, model: nn.Module, card: ModelCard, path: Path, device: torch.device) -> None:
        self.model = model
        self.card = card
        self.path = path
        self.device = device
        self.classes: tuple[str, ...] = card.classes
        self.image_size = card.image_size

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(images.to(self.device))

    def __repr__(self) -> str:
        return (f"LoadedModel({self.card.model!r}, {len(self.classes)} classes, {self.image_size} px, "
                f"from {str(self.path)!r})")

    def preprocess(self, image: ImageLike) -> torch.Tensor:
        """(3, S, S) float32 on the CPU: the file (a path or its bytes), a PIL image or an (H, W, 3) uint8 RGB
        array decoded, cropped, resized and normalized as validation does. A file stoker cannot use is a
        ValueError that names it and says why."""
        pixels = self.pixels(image)
        return normalize(torch.from_numpy(pixels)[None], self.card)[0]

    def pixels(self, image: ImageLike) -> np.ndarray:
        """(S, S, 3) uint8: what a producer writes into a batch slot for this image in validation."""
        out = np.empty((self.image_size, self.image_size, 3), dtype=np.uint8)
        if isinstance(image, Image.Image):
            _crop_array_into(to_rgb_array(image), out)
            return out
        if isinstance(image, np.ndarray):
            _crop_array_into(_as_rgb(image), out)
            return out
        name, data = _read(image)
        try:
            load_into(data, out, "none", None)
        except UnusableImage as error:
            raise ValueError(f"{name}: {error}") from None
        return out


def load(source: str | Path, device: str | torch.device = "cpu",
         model: Callable[..., nn.Module] | str | None = None, accept_changed_module: bool = False) -> LoadedModel:
    """The model in RUN_DIR/model.pt (or the model file named), in eval mode on `device`. Raises ValueError
    (`ModelFileError`) naming the file when it is not a stoker model file, was modified, or does not fit its
    model. `model`: the function that builds the architecture (called as `model(num_classes=K)`), instead of
    the card's; or the card's own model by name (`"module:function"`, which a card naming a module needs: the
    module is imported only when the caller names it and while its file is the one training recorded, or, with
    `accept_changed_module`, as it is now, with a warning that says what differs)."""
    path = model_path(Path(source))
    card, state = read_model(path)
    if card.crop_fraction != CENTER_CROP_FRACTION:
        raise ModelFileError(f"{path}: its card asks for a centre crop of {card.crop_fraction}; this stoker's "
                             f"validation crops {CENTER_CROP_FRACTION}")
    network = _built_by(model, card, path) if callable(model) else rebuild(card, path, model, accept_changed_module)
    try:
        network.load_state_dict(state)
    except RuntimeError as error:
        raise ModelFileError(f"{path}: its weights do not fit {card.model!r} with {card.num_classes} classes "
                             f"({describe_load_error(error, 600)})") from None
    target = torch.device(device)
    return LoadedModel(network.eval().to(target), card, path, target)


def _built_by(factory: Callable[..., nn.Module], card: ModelCard, path: Path) -> nn.Module:
    network = factory(num_classes=card.num_classes)
    if not isinstance(network, nn.Module):
        raise ModelFileError(f"{path}: model= returned {type(network).__name__}, expected a torch nn.Module")
    return network


def model_path(source: Path) -> Path:
    if not source.is_dir():
        return source
    path = source / MODEL_FILE
    if not path.exists():
        best = source / "model_best.pt"
        hint = f" ({best} is there: load it by name)" if best.exists() else \
            " (a run writes it when it completes)"
        raise ModelFileError(f"{path}: no such file{hint}")
    return path


def rebuild(card: ModelCard, path: Path, named: str | None = None, accept_changed: bool = False) -> nn.Module:
    """The architecture the card names, with its classes. A model file must not choose what code runs: a built-in
    model is built by name; a module:function only when the caller names the same one (`named`: `--model`),
    checked before anything is looked up or imported, then imported by name (never from a path the file
    records) and only after its file is found (without running it) to hash to what training recorded."""
    if named is not None and named != card.model:
        raise ModelFileError(f"{path}: its model is {card.model!r}, not {named!r} as given; give the model the "
                             f"file was trained with (or, in Python, model=your_function to build another)")
    if ":" in card.model and named is None:
        raise ModelFileError(f"{path}: its model is {card.model!r}, code of your own, which stoker imports only "
                             f"when you name it (a model file must not choose what code runs); if you trust "
                             f"that module, pass --model {card.model} (stoker eval/predict) or "
                             f"stoker.load(..., model={card.model!r})")
    try:
        if ":" in card.model:
            import_verified(check_recorded_module(card.model, card.module_sha256, path, accept_changed))
        return build_model(card.model, card.num_classes)
    except ModuleNotVerified as error:  # found, so where it was trained from is no help
        raise ModelFileError(f"{path}: cannot rebuild its model: {error}") from None
    except ValueError as error:
        where = f"; it was trained from {card.module_file}: run from its folder or put that on PYTHONPATH" \
            if card.module_file else ""
        raise ModelFileError(f"{path}: cannot rebuild its model: {error}{where}") from None


def normalize(pixels: torch.Tensor, card: ModelCard, device: torch.device | None = None,
              memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """uint8 (B, H, W, 3) -> float32 NCHW (x - 255 mean) * (1 / (255 std)) with the card's mean and std:
    the consumer's feed's own function (`feed.normalize_pixels`), so the result is the same to the bit."""
    device = device or pixels.device
    mean_255, inv_std_255 = normalization_constants(card.mean, card.std)
    return normalize_pixels(pixels, mean_255.to(device), inv_std_255.to(device), memory_format, device,
                            non_blocking=True)


def _read(image: Any) -> tuple[str, bytes]:
    if isinstance(image, (bytes, bytearray, memoryview)):
        return "the image bytes", bytes(image)
    if isinstance(image, (str, Path)):
        try:
            return str(image), Path(image).read_bytes()
        except OSError as error:
            raise ValueError(f"{image}: cannot read it ({error.strerror})") from None
    raise TypeError(f"preprocess takes a path, bytes, a PIL image or an (H, W, 3) uint8 array, not "
                    f"{type(image).__name__}")


def _as_rgb(array: np.ndarray) -> np.ndarray:
    if array.dtype != np.uint8 or not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] == 3)):
        raise ValueError(f"preprocess: an array must be (H, W, 3) or (H, W) uint8 RGB; this one is "
                         f"{array.shape} {array.dtype}")
    return np.ascontiguousarray(np.repeat(array[:, :, None], 3, axis=2) if array.ndim == 2 else array)


def _crop_array_into(image: np.ndarray, out: np.ndarray) -> None:
    """The validation crop and resize of an image already decoded (a JPEG decoded elsewhere may differ from
    stoker's reduced-scale decode of the same file in the last bits: pass the file for the exact tensor)."""
    resize_box_into(image, center_crop_box(*image.shape[:2]), False, out)

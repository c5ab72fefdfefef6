"""What a training step does to a batch on the device besides forward and backward: random erasing, mixup or
cutmix, label smoothing, gradient clipping.

Everything runs after the feed, on the device, so no extra bytes cross shared memory. Every random draw comes
from `plan.step_rng(seed, epoch, step, rank)` (a few scalars per batch, drawn on the host), so a batch's pixels and
mixing are the same whatever the number of producers, and an exact resume stays exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from stoker.common.config import RecipeSettings
from stoker.pipeline.plan import step_rng

ERASE_SCALE = (0.02, 0.33)  # RandomErasing's defaults (Zhong et al. 2017; torchvision, timm)
ERASE_RATIO = (0.3, 3.3)
ERASE_TRIES = 10
CUTMIX_SWITCH = 0.5  # with both mixup and cutmix on, each batch takes one of them, cutmix at this probability


@dataclass(frozen=True)
class RecipeSpec:
    """The recipe's settings, and what its random draws and one-hot targets need besides."""

    num_classes: int
    seed: int
    settings: RecipeSettings = RecipeSettings()

    @property
    def soft_targets(self) -> bool:
        return bool(self.settings.label_smoothing or self.settings.mixup or self.settings.cutmix)


@dataclass(frozen=True)
class Mix:
    """How a batch was mixed: image i took `1 - lam` of image i-1 (the batch rolled by one, as torchvision's
    reference does), inside `box` (top, left, height, width) for cutmix or everywhere for mixup."""

    lam: float
    box: tuple[int, int, int, int] | None = None


class Recipe:
    def __init__(self, spec: RecipeSpec) -> None:
        self.spec = spec

    def prepare(self, images: torch.Tensor, labels: torch.Tensor, epoch: int, step: int,
                rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, targets) for the loss: labels as they are when nothing is soft, else class probabilities."""
        spec, settings = self.spec, self.spec.settings
        if not (settings.random_erasing or spec.soft_targets):
            return images, labels
        rng = step_rng(spec.seed, epoch, step, rank)
        if settings.random_erasing:
            erase(images, erasing_boxes(images.shape, settings.random_erasing, rng))
        if not spec.soft_targets:
            return images, labels
        targets = F.one_hot(labels, spec.num_classes).to(images.dtype)
        mix = draw_mix(images.shape, settings.mixup, settings.cutmix, rng)
        if mix is not None and len(labels) > 1:
            images, targets = apply_mix(images, targets, mix)
        return images, smooth(targets, settings.label_smoothing)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if targets.dtype == torch.int64:
            return F.cross_entropy(logits, targets)
        return soft_cross_entropy(logits, targets)

    def clip(self, parameters: list[torch.nn.Parameter]) -> None:
        if self.spec.settings.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(parameters, self.spec.settings.clip_grad_norm)


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -(targets * F.log_softmax(logits.float(), dim=1)).sum(dim=1).mean()


def smooth(targets: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Szegedy et al. 2016: (1 - epsilon) of the target, epsilon spread evenly over every class."""
    if not epsilon:
        return targets
    return targets * (1 - epsilon) + epsilon / targets.shape[1]


def draw_mix(shape: torch.Size | tuple[int, ...], mixup: float, cutmix: float,
             rng: np.random.Generator) -> Mix | None:
    if not (mixup or cutmix):
        return None
    use_cutmix = bool(cutmix) and (not mixup or rng.random() < CUTMIX_SWITCH)
    alpha = cutmix if use_cutmix else mixup
    lam = float(rng.beta(alpha, alpha))
    if not use_cutmix:
        return Mix(lam)
    return cutmix_box(shape[2], shape[3], lam, rng)


def cutmix_box(height: int, width: int, lam: float, rng: np.random.Generator) -> Mix:
    """Yun et al. 2019: a box of (1 - lam) of the area at a uniform centre, clipped to the image; lam is then
    what the box left of the image (its area may have been clipped)."""
    cut = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * cut), int(width * cut)
    centre_y, centre_x = int(rng.integers(0, height)), int(rng.integers(0, width))
    top, bottom = max(centre_y - cut_h // 2, 0), min(centre_y + cut_h // 2, height)
    left, right = max(centre_x - cut_w // 2, 0), min(centre_x + cut_w // 2, width)
    box = (top, left, bottom - top, right - left)
    return Mix(1.0 - box[2] * box[3] / (height * width), box)


def apply_mix(images: torch.Tensor, targets: torch.Tensor, mix: Mix) -> tuple[torch.Tensor, torch.Tensor]:
    partner_images, partner_targets = images.roll(1, 0), targets.roll(1, 0)
    if mix.box is None:
        images = images * mix.lam + partner_images * (1 - mix.lam)
    else:
        top, left, height, width = mix.box
        images = images.clone()
        images[:, :, top:top + height, left:left + width] = partner_images[:, :, top:top + height,
                                                                           left:left + width]
    return images, targets * mix.lam + partner_targets * (1 - mix.lam)


def erasing_boxes(shape: torch.Size | tuple[int, ...], probability: float,
                  rng: np.random.Generator) -> list[tuple[int, int, int, int, int]]:
    """(sample, top, left, height, width) for each sample erased: torchvision's RandomErasing.get_params (area a
    uniform share of the image in ERASE_SCALE, log-uniform aspect ratio, 10 tries), drawn for every sample."""
    count, _, height, width = shape
    boxes = []
    log_ratio = (math.log(ERASE_RATIO[0]), math.log(ERASE_RATIO[1]))
    for sample in range(count):
        if rng.random() >= probability:
            continue
        for _ in range(ERASE_TRIES):
            area = height * width * rng.uniform(*ERASE_SCALE)
            ratio = math.exp(rng.uniform(*log_ratio))
            h, w = int(round(math.sqrt(area * ratio))), int(round(math.sqrt(area / ratio)))
            if h < height and w < width:
                top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
                boxes.append((sample, top, left, h, w))
                break
    return boxes


def erase(images: torch.Tensor, boxes: list[tuple[int, int, int, int, int]]) -> None:
    """Erased to 0 after normalization: the dataset's mean colour (torchvision's default value)."""
    for sample, top, left, height, width in boxes:
        images[sample, :, top:top + height, left:left + width] = 0

"""The training recipe's pieces, each against an independent statement of it: torch's own label smoothing, the
mixup and cutmix papers' definitions, the EMA recurrence, the written warmup schedule, which parameters decay."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stoker.common.config import RecipeSettings
from stoker.training.ema import ModelEma
from stoker.training.groups import head_parameter_names, parameter_groups
from stoker.training.models import build_model
from stoker.training.recipe import (
    ERASE_RATIO,
    ERASE_SCALE,
    Mix,
    Recipe,
    RecipeSpec,
    apply_mix,
    cutmix_box,
    erasing_boxes,
    smooth,
    soft_cross_entropy,
)
from stoker.training.schedule import LearningRate


def test_label_smoothing_matches_torch() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 10, generator=generator)
    labels = torch.randint(0, 10, (16,), generator=generator)
    recipe = Recipe(RecipeSpec(10, seed=0, settings=RecipeSettings(label_smoothing=0.1)))
    images, targets = recipe.prepare(torch.zeros(16, 3, 8, 8), labels, epoch=0, step=0, rank=0)
    ours = recipe.loss(logits, targets)
    assert torch.allclose(ours, F.cross_entropy(logits, labels, label_smoothing=0.1), atol=1e-6)


def test_mixed_targets_loss_is_the_mix_of_two_smoothed_losses() -> None:
    """Cross-entropy is linear in the target: the mixed loss is lam CE(y) + (1 - lam) CE(partner's y)."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 5, generator=generator)
    labels = torch.randint(0, 5, (8,), generator=generator)
    images = torch.randn(8, 3, 4, 4, generator=generator)
    lam = 0.3
    _, targets = apply_mix(images, F.one_hot(labels, 5).float(), Mix(lam))
    loss = soft_cross_entropy(logits, smooth(targets, 0.1))
    expected = lam * F.cross_entropy(logits, labels, label_smoothing=0.1) + (1 - lam) * F.cross_entropy(
        logits, labels.roll(1), label_smoothing=0.1)
    assert torch.allclose(loss, expected, atol=1e-6)


def test_mixup_pixels_are_the_convex_combination() -> None:
    """Zhang et al. 2018: x = lam x_i + (1 - lam) x_j."""
    images = torch.rand(4, 3, 6, 6)
    mixed, _ = apply_mix(images, torch.eye(4), Mix(0.7))
    for i in range(4):
        assert torch.allclose(mixed[i], 0.7 * images[i] + 0.3 * images[(i - 1) % 4])


def test_cutmix_box_area_and_pixels() -> None:
    """Yun et al. 2019: the box holds the partner's pixels, the rest the image's own; lam = 1 - box area / area;
    unclipped, the box covers (1 - lam) of the image."""
    rng = np.random.default_rng(0)
    images = torch.rand(3, 3, 32, 32)
    for _ in range(50):
        lam = float(rng.beta(1.0, 1.0))
        mix = cutmix_box(32, 32, lam, rng)
        assert mix.box is not None
        top, left, height, width = mix.box
        assert mix.lam == pytest.approx(1 - height * width / 32 ** 2)
        mixed, targets = apply_mix(images, torch.eye(3), mix)
        inside = torch.zeros(32, 32, dtype=torch.bool)
        inside[top:top + height, left:left + width] = True
        assert torch.equal(mixed[1][:, inside], images[0][:, inside])
        assert torch.equal(mixed[1][:, ~inside], images[1][:, ~inside])
        assert targets[1, 1] == pytest.approx(mix.lam) and targets[1, 0] == pytest.approx(1 - mix.lam)
    # a box away from every edge is not clipped: it covers (1 - lam) of the image, within its rounding to pixels
    unclipped = 0
    for _ in range(300):
        lam = float(rng.beta(1.0, 1.0))
        top, left, height, width = cutmix_box(100, 100, lam, rng).box or (0, 0, 0, 0)
        if top > 0 and left > 0 and top + height < 100 and left + width < 100:
            unclipped += 1
            assert abs(height * width - (1 - lam) * 100 * 100) <= 2 * (100 + 100)
    assert unclipped > 30


def test_random_erasing_boxes_keep_their_ranges() -> None:
    boxes = erasing_boxes((400, 3, 32, 32), 0.5, np.random.default_rng(0))
    assert 150 < len(boxes) < 250  # p = 0.5 of 400 samples
    for _, top, left, height, width in boxes:
        assert 0 <= top and top + height <= 32 and 0 <= left and left + width <= 32
        assert ERASE_SCALE[0] * 0.7 <= height * width / 32 ** 2 <= ERASE_SCALE[1] * 1.3
        assert ERASE_RATIO[0] * 0.6 <= height / width <= ERASE_RATIO[1] / 0.6


def test_ema_follows_its_recurrence() -> None:
    torch.manual_seed(0)
    model, shadow = nn.Linear(4, 3), nn.Linear(4, 3)
    ema = ModelEma(shadow, model, decay=0.9)
    expected = model.weight.detach().clone()
    for step in range(5):
        with torch.no_grad():
            model.weight.add_(torch.randn(3, 4))
        ema.update(model, step)
        expected = 0.9 * expected + 0.1 * model.weight.detach()
        assert torch.allclose(ema.model.weight, expected, atol=1e-6)
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model, 6)  # two steps since the last update (a window of --sync-every 2): decay 0.9 ** 2
    expected = 0.81 * expected + 0.19 * model.weight.detach()
    assert torch.allclose(ema.model.weight, expected, atol=1e-6)


def test_warmup_then_cosine_as_written() -> None:
    """Linear over the first W steps (step s at (s + 1) / W of the peak), then cosine from the peak to 0."""
    schedule = LearningRate(0.4, "cosine", total_steps=110, warmup_steps=10)
    assert [schedule.at(s) for s in range(10)] == pytest.approx([0.4 * (s + 1) / 10 for s in range(10)])
    assert schedule.at(10) == pytest.approx(0.4)
    assert schedule.at(60) == pytest.approx(0.2)
    assert schedule.at(109) == pytest.approx(0.4 * 0.5 * (1 + math.cos(math.pi * 99 / 100)))
    step = LearningRate(1.0, "step", total_steps=100)
    assert [step.at(s) for s in (0, 49, 50, 74, 75, 99)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    assert LearningRate(0.1, "constant", 100, 5).at(50) == 0.1


def test_no_decay_on_norms_and_biases() -> None:
    model = build_model("resnet8", 10)
    groups = parameter_groups(model, 5e-4, no_decay_norm_bias=True)
    decayed = {id(p) for g in groups if g["weight_decay"] for p in g["params"]}
    exempt = {id(p) for g in groups if not g["weight_decay"] for p in g["params"]}
    for module in model.modules():
        for name, parameter in module.named_parameters(recurse=False):
            if isinstance(module, nn.BatchNorm2d) or name == "bias":
                assert id(parameter) in exempt, (module, name)
            else:
                assert isinstance(module, (nn.Conv2d, nn.Linear)) and name == "weight"
                assert id(parameter) in decayed
    assert len(decayed) + len(exempt) == len(list(model.parameters()))
    plain = parameter_groups(model, 5e-4, no_decay_norm_bias=False)
    assert len(plain) == 1 and plain[0]["weight_decay"] == 5e-4


def test_head_groups_carry_the_multiplier() -> None:
    model = build_model("resnet8", 10)
    head = head_parameter_names(model)
    assert head == {"head.weight", "head.bias"}
    groups = parameter_groups(model, 5e-4, True, head, 10.0)
    scaled = {id(p) for g in groups if g["lr_scale"] == 10.0 for p in g["params"]}
    assert scaled == {id(model.head.weight), id(model.head.bias)}

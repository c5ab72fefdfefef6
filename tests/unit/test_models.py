"""The built-in ImageNet-style models have the published sizes (torchvision's parameter counts)."""

from __future__ import annotations

import pytest
import torch

from stoker.training.models import build_model


@pytest.mark.parametrize("name,parameters", [("resnet18", 11_689_512), ("resnet50", 25_557_032)])
def test_imagenet_resnets_have_the_published_size(name, parameters):
    model = build_model(name, num_classes=1000)
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert model(torch.zeros(1, 3, 64, 64)).shape == (1, 1000)

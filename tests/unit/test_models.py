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


def test_a_factory_without_num_classes_is_one_line_and_exit_2(textures, tmp_path):
    import os

    from tests.conftest import run_cli

    (tmp_path / "my_models.py").write_text("from torch import nn\n\ndef tiny():\n    return nn.Flatten()\n")
    train, val = textures
    result = run_cli("train", "--data", str(train), "--val", str(val), "--model", "my_models:tiny", check=False,
                     env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "num_classes" in lines[0] and "my_models:tiny" in lines[0], lines

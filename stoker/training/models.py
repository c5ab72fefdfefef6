"""Built-in ResNet-style classifiers (no torchvision) and loading of user model factories (`module:function`)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

import torch
from torch import nn

from stoker.training.model_source import put_working_directory_on_path


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    """The identity, or a 1x1 projection where the block changes the resolution or the width."""
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4: ResNet-50's block (the stride on the 3x3, as in
    torchvision's v1.5)."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.shortcut = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        return torch.relu(self.bn3(self.conv3(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """Stem, stages of basic blocks (the first of each later stage halves the resolution), global pool, linear.

    `imagenet_stem` uses the 7x7/2 convolution and max-pool of ResNet-18 for large inputs; otherwise a 3x3 stem
    keeps small images (32-64 px) at full resolution, as CIFAR ResNets do.
    """

    def __init__(self, blocks: tuple[int, ...], widths: tuple[int, ...], num_classes: int,
                 imagenet_stem: bool = False, block: type[nn.Module] = BasicBlock) -> None:
        super().__init__()
        if imagenet_stem:
            self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 7, 2, 3, bias=False), nn.BatchNorm2d(widths[0]),
                                      nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                      nn.ReLU(inplace=True))
        stages = []
        in_channels = widths[0]
        expansion = getattr(block, "expansion", 1)
        for index, (count, width) in enumerate(zip(blocks, widths)):
            for position in range(count):
                stride = 2 if index > 0 and position == 0 else 1
                stages.append(block(in_channels, width, stride))
                in_channels = width * expansion
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.stages(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(features, 1), 1))


def resnet8(num_classes: int) -> ResNet:
    return ResNet((1, 1, 1), (16, 32, 64), num_classes)


def resnet14(num_classes: int) -> ResNet:
    return ResNet((2, 2, 2), (16, 32, 64), num_classes)


def resnet20(num_classes: int) -> ResNet:
    return ResNet((3, 3, 3), (16, 32, 64), num_classes)


def resnet18(num_classes: int) -> ResNet:
    return ResNet((2, 2, 2, 2), (64, 128, 256, 512), num_classes, imagenet_stem=True)


def resnet50(num_classes: int) -> ResNet:
    return ResNet((3, 4, 6, 3), (64, 128, 256, 512), num_classes, imagenet_stem=True, block=Bottleneck)


BUILTIN: dict[str, Callable[[int], nn.Module]] = {
    "resnet8": resnet8, "resnet14": resnet14, "resnet20": resnet20, "resnet18": resnet18, "resnet50": resnet50,
}


def resolve_factory(name: str) -> Callable[..., nn.Module]:
    """A built-in name, or `module:function` imported from the working directory or PYTHONPATH."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise ValueError(f"model={name!r}: expected one of {sorted(BUILTIN)} or 'module:function'")
    module_name, function_name = name.split(":", 1)
    put_working_directory_on_path()
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"model={name!r}: cannot import module {module_name!r} ({error})") from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise ValueError(f"model={name!r}: module {module_name!r} has no function {function_name!r}")
    _check_takes_num_classes(name, factory)
    return factory


def _check_takes_num_classes(name: str, factory: Callable[..., nn.Module]) -> None:
    """stoker calls `function(num_classes=K)`: a function that cannot take it is a user error, told in one line
    (not a TypeError from inside the call)."""
    try:
        inspect.signature(factory).bind(num_classes=1)
    except TypeError:
        raise ValueError(f"model={name!r}: stoker calls it as {name.split(':', 1)[1]}(num_classes=K); its "
                         f"signature {inspect.signature(factory)} does not take num_classes") from None
    except ValueError:  # no signature to read (a builtin): the call itself will tell
        pass


def build_model(name: str, num_classes: int) -> nn.Module:
    model = resolve_factory(name)(num_classes=num_classes)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={name!r}: the factory returned {type(model).__name__}, expected a torch nn.Module")
    return model


def check_model(name: str, num_classes: int, image_size: int, size_setting: str = "image_size") -> None:
    """Build the model once and run one tiny input through it, so a bad factory fails before processes start;
    `size_setting` names the setting the input's side comes from in the error."""
    model = build_model(name, num_classes)
    model.eval()
    with torch.no_grad():
        try:
            output = model(torch.zeros(1, 3, image_size, image_size))
        except Exception as error:
            raise ValueError(f"model={name!r}: forward on a (1, 3, {image_size}, {image_size}) input "
                             f"({size_setting}={image_size}) failed: {type(error).__name__}: {error}") from None
    if tuple(output.shape) != (1, num_classes):
        raise ValueError(f"model={name!r}: output shape {tuple(output.shape)}, expected (1, {num_classes})")

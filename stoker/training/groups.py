"""The optimizer's parameter groups: which parameters get weight decay, and which learn at the head's rate.

Weight decay on a norm layer's scale or on a bias pulls it towards 0 without regularizing anything the model
computes (Goyal et al. 2017, He et al. 2019 "Bag of Tricks": no bias decay); timm and torchvision's references
exempt every parameter of a norm layer and every bias. A fine-tuned head learns faster than the pretrained body
(`--lr-head-multiplier`): its groups carry `lr_scale`, which the schedule multiplies in.
"""

from __future__ import annotations

from typing import Any

from torch import nn

NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)


def parameter_groups(model: nn.Module, weight_decay: float, no_decay_norm_bias: bool,
                     head: frozenset[str] = frozenset(), head_multiplier: float = 1.0) -> list[dict[str, Any]]:
    """Groups in a fixed order (decayed, not decayed; body, then head), empty ones left out."""
    exempt = no_decay_parameter_names(model) if no_decay_norm_bias else set()
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            groups.setdefault((name in head, name in exempt), []).append(parameter)
    out = []
    for in_head in (False, True):
        for no_decay in (False, True):
            members = groups.get((in_head, no_decay))
            if members:
                out.append({"params": members, "weight_decay": 0.0 if no_decay else weight_decay,
                            "lr_scale": head_multiplier if in_head else 1.0})
    return out


def optimizer_groups(model: nn.Module, weight_decay: float, no_decay_norm_bias: bool,
                     head_multiplier: float) -> list[dict[str, Any]]:
    """The groups the consumer's optimizer is built with (and a resume's checkpoint is checked against)."""
    head = head_parameter_names(model) if head_multiplier != 1.0 else frozenset()
    return parameter_groups(model, weight_decay, no_decay_norm_bias, head, head_multiplier)


def no_decay_parameter_names(model: nn.Module) -> set[str]:
    names = set()
    for module_name, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            if isinstance(module, NORM_TYPES) or name == "bias":
                names.add(f"{module_name}.{name}" if module_name else name)
    return names


def head_parameter_names(model: nn.Module) -> frozenset[str]:
    """The classifier head: the parameters of the model's last nn.Linear."""
    last = None
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last = module_name
    if last is None:
        return frozenset()
    module = model.get_submodule(last)
    return frozenset(f"{last}.{name}" if last else name for name, _ in module.named_parameters(recurse=False))


def check_head_multiplier(model: nn.Module, model_name: str, multiplier: float) -> None:
    """Before any process starts: a multiplier for a head the model does not have would change nothing, silently."""
    if multiplier != 1.0 and not head_parameter_names(model):
        raise ValueError(f"lr_head_multiplier={multiplier}: model={model_name!r} has no nn.Linear layer, which is "
                         "what the classifier head is taken to be (its last one); use 1, or end the model with an "
                         "nn.Linear")

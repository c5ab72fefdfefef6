"""Whether a checkpoint's tensor files hold what a resume of this model reads, checked in the controller as each
file is loaded for verification (`checkpoint.newest_valid`).

A file can match its checksum and still not fit: meta.json's checksums were recomputed by someone who edited a
file, or a bug wrote it. Without this check the consumer found out while starting ("size mismatch for
stem.0.weight") and the resume failed; with it, the checkpoint is refused with a warning like a damaged one and
the newest one that fits is used. The model is built on the meta device (shapes without memory) where its
builder allows.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stoker.common.checkpoint import MODEL_FILE, CheckpointError, FitCheck
from stoker.common.config import TrainConfig
from stoker.run.resume import setting_differences
from stoker.training.averager import NOTHING_PENDING
from stoker.training.groups import optimizer_groups

# What every rank's file holds, and the type a resume reads it as (the rest depends on the settings).
RANK_FIELDS: dict[str, type] = {"optimizer": dict, "torch_rng": torch.Tensor, "pending": torch.Tensor}
SHOWN = 5  # names listed per kind of misfit


@dataclass(frozen=True)
class ModelShapes:
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]  # each state_dict tensor's shape and dtype
    groups: list[list[tuple[int, ...]]]  # the optimizer's groups: each parameter's shape, in the optimizer's order


def model_fit_check(config: TrainConfig, num_classes: int) -> FitCheck:
    """The check `checkpoint.newest_valid` runs on each loaded .pt file: it fits this run's model and optimizer. A
    checkpoint that records other settings or another class count is left to `resume.check_resumable`, which
    names the difference."""
    shapes = _model_shapes(config, num_classes)

    def check(path: Path, loaded: Any, meta: dict[str, Any]) -> None:
        classes = meta.get("classes")
        if setting_differences(meta.get("config"), config) or not (
                isinstance(classes, list) and len(classes) == num_classes):
            return
        if path.name == MODEL_FILE:
            _check_model_state(path, "", loaded, shapes.tensors)
        else:
            _check_rank_state(path, loaded, shapes)

    return check


def _model_shapes(config: TrainConfig, num_classes: int) -> ModelShapes:
    from stoker.training.models import build_model

    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a builder that loads weights: "copying ... to a meta parameter"
            model = build_model(config.model, num_classes)
    except Exception:  # a builder of one's own that computes with its tensors: the CPU build it trained with
        model = build_model(config.model, num_classes)
    groups = optimizer_groups(model, config.weight_decay, config.no_decay_norm_bias, config.lr_head_multiplier)
    return ModelShapes({name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()
                        if isinstance(t, torch.Tensor)},
                       [[tuple(p.shape) for p in group["params"]] for group in groups])


def _check_rank_state(path: Path, state: Any, shapes: ModelShapes) -> None:
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict of a replica's state, found {type(state).__name__}")
    for field, kind in RANK_FIELDS.items():
        if field not in state:
            raise CheckpointError(f"{path}: holds no {field!r}")
        if not isinstance(state[field], kind):
            raise CheckpointError(f"{path}: {field!r} is not a {kind.__name__} "
                                  f"(found {type(state[field]).__name__})")
    if state["pending"].shape != (len(NOTHING_PENDING),):
        raise CheckpointError(f"{path}: 'pending' is not {len(NOTHING_PENDING)} numbers "
                              f"(shape {tuple(state['pending'].shape)})")
    _check_optimizer(path, state["optimizer"], shapes.groups)
    if "model" in state:
        _check_model_state(path, "['model']", state["model"], shapes.tensors)
    if "ema" in state:
        ema = state["ema"]
        if not isinstance(ema, dict):
            raise CheckpointError(f"{path}['ema']: expected a dict, found {type(ema).__name__}")
        _check_model_state(path, "['ema']", {k[len("model."):]: v for k, v in ema.items() if k.startswith("model.")},
                           shapes.tensors)


def _check_optimizer(path: Path, optimizer: dict[str, Any], groups: list[list[tuple[int, ...]]]) -> None:
    """The groups' sizes as the consumer builds them, and each parameter's state (momentum, Adam's moments) of its
    parameter's shape: torch's load_state_dict checks only the sizes, and a buffer of another shape fails at the
    first step."""
    loaded, state = optimizer.get("param_groups"), optimizer.get("state")
    if not isinstance(loaded, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in loaded) or not isinstance(state, dict):
        raise CheckpointError(f"{path}: the optimizer is not 'param_groups' (a list of groups with 'params') and "
                              "'state'")
    sizes, expected_sizes = [len(g["params"]) for g in loaded], [len(group) for group in groups]
    if sizes != expected_sizes:
        raise CheckpointError(f"{path}: the optimizer's groups hold {sizes} parameters, this model's "
                              f"{expected_sizes}")
    for group, expected in zip(loaded, groups, strict=True):
        for key, shape in zip(group["params"], expected, strict=True):
            entry = state.get(key)
            for name, value in (entry.items() if isinstance(entry, dict) else ()):
                if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != shape:
                    raise CheckpointError(f"{path}: the optimizer's {name!r} of parameter {key} has shape "
                                          f"{tuple(value.shape)}, the parameter {shape}")


def _check_model_state(path: Path, where: str, state: Any, expected: dict[str, tuple]) -> None:
    """Names, shapes and dtypes exactly as the model's own state_dict."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}{where}: expected the model's state_dict (names to tensors)")
    state = {name: t for name, t in state.items() if isinstance(t, torch.Tensor)}  # a module's _extra_state aside
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misfit = sorted(f"{name} {tuple(state[name].shape)} {state[name].dtype}".replace("torch.", "")
                    for name in set(expected) & set(state)
                    if (tuple(state[name].shape), state[name].dtype) != expected[name])
    problems = [f"{len(names)} {kind}: {', '.join(names[:SHOWN])}{' ...' if len(names) > SHOWN else ''}"
                for kind, names in (("missing", missing), ("unexpected", unexpected),
                                    ("of another shape or dtype", misfit)) if names]
    if problems:
        raise CheckpointError(f"{path}{where} does not fit the model ({'; '.join(problems)})")

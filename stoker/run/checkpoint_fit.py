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
from pathlib import Path
from typing import Any

import torch

from stoker.common.checkpoint import MODEL_FILE, CheckpointError, FitCheck
from stoker.common.config import TrainConfig
from stoker.training.averager import NOTHING_PENDING

# What every rank's file holds, and the type a resume reads it as (the rest depends on the settings).
RANK_FIELDS: dict[str, type] = {"optimizer": dict, "torch_rng": torch.Tensor, "pending": torch.Tensor}
SHOWN = 5  # names listed per kind of misfit


def model_fit_check(model_name: str, num_classes: int) -> FitCheck:
    """The check `checkpoint.newest_valid` runs on each loaded .pt file: it fits this model. A checkpoint that
    records another model or class count is left to `resume.check_resumable`, which names the difference."""
    expected, parameters = _model_shapes(model_name, num_classes)

    def check(path: Path, loaded: Any, meta: dict[str, Any]) -> None:
        if not _records(meta, model_name, num_classes):
            return
        if path.name == MODEL_FILE:
            _check_model_state(path, "", loaded, expected)
        else:
            _check_rank_state(path, loaded, expected, parameters)

    return check


def _model_shapes(model_name: str, num_classes: int) -> tuple[dict[str, tuple], int]:
    """Each state_dict tensor's (shape, dtype), and the number of parameters the optimizer holds (the trainable
    ones: `training/groups.py` leaves frozen ones out)."""
    from stoker.training.models import build_model

    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a builder that loads weights: "copying ... to a meta parameter"
            model = build_model(model_name, num_classes)
    except Exception:  # a builder of one's own that computes with its tensors: the CPU build it trained with
        model = build_model(model_name, num_classes)
    return ({name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items() if isinstance(t, torch.Tensor)},
            sum(1 for p in model.parameters() if p.requires_grad))


def _records(meta: dict[str, Any], model_name: str, num_classes: int) -> bool:
    config, classes = meta.get("config"), meta.get("classes")
    recorded = config.get("model", TrainConfig().model) if isinstance(config, dict) else None
    return recorded == model_name and isinstance(classes, list) and len(classes) == num_classes


def _check_rank_state(path: Path, state: Any, expected: dict[str, tuple], parameters: int) -> None:
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
    groups = state["optimizer"].get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        raise CheckpointError(f"{path}: the optimizer's 'param_groups' is not a list of groups with 'params'")
    if (count := sum(len(g["params"]) for g in groups)) != parameters:
        raise CheckpointError(f"{path}: the optimizer holds {count} parameters, the model {parameters}")
    if "model" in state:
        _check_model_state(path, "['model']", state["model"], expected)
    if "ema" in state:
        ema = state["ema"]
        if not isinstance(ema, dict):
            raise CheckpointError(f"{path}['ema']: expected a dict, found {type(ema).__name__}")
        _check_model_state(path, "['ema']", {k[len("model."):]: v for k, v in ema.items() if k.startswith("model.")},
                           expected)


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

"""`--init`: start from pretrained weights (a torchvision or timm state_dict, or an earlier stoker model.pt).

The file must be the zip archive torch.save writes (whole: its CRCs are checked, stoker.training.archive), and is
loaded with `torch.load(weights_only=True)` (a pickle cannot run code), plain or under a
`state_dict` or `model` key. Keys are matched by name after removing the wrapper prefix that makes the most of
them match (`module.` of DDP, `_orig_mod.` of torch.compile, `model.` of Lightning). A classifier head of another
shape (other classes) is re-initialized and named in the log; any other missing or unexpected key, or a shape
that differs, is an error listing every one, raised before any process starts.
"""

from __future__ import annotations

import logging
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from stoker.common.checkpoint import describe_load_error
from stoker.training.archive import ArchiveError, check_torch_archive
from stoker.training.groups import head_parameter_names

log = logging.getLogger(__name__)

WRAPPER_KEYS = ("state_dict", "model")
# Not learned: a counter BatchNorm uses only without momentum; checkpoints made elsewhere often lack it.
IGNORED_SUFFIXES = (".num_batches_tracked",)
SHOWN = 20  # keys listed per kind of mismatch


class InitError(ValueError):
    """The --init file cannot be loaded into the model; the message lists every key that does not fit."""


@dataclass(frozen=True)
class InitPlan:
    state: dict[str, torch.Tensor]  # the file's tensors, renamed to the model's keys, head left out
    reinitialized: tuple[str, ...]  # the head's keys kept at the model's own initialization
    prefix: str  # the prefix removed from the file's keys


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    _check_archive(path)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError, ValueError) as error:
        raise InitError(f"init={str(path)!r}: not a state_dict torch can load safely "
                        f"({describe_load_error(error)})") from None
    for key in WRAPPER_KEYS:
        if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
            loaded = loaded[key]
            break
    if not isinstance(loaded, dict) or not loaded or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
        raise InitError(f"init={str(path)!r}: expected a state_dict (names to tensors), plain or under "
                        f"{' or '.join(repr(k) for k in WRAPPER_KEYS)}; found {type(loaded).__name__}")
    return loaded


def _check_archive(path: Path) -> None:
    try:
        check_torch_archive(path, "a state_dict file")
    except ArchiveError as error:
        raise InitError(f"init={str(path)!r}: {error}") from None


def plan_init(path: Path, model: nn.Module) -> InitPlan:
    """What loading `path` into `model` does, or an InitError listing every key that does not fit."""
    source = read_state_dict(path)
    expected = {k: v for k, v in model.state_dict().items() if not k.endswith(IGNORED_SUFFIXES)}
    prefix = _best_prefix(source, expected)
    renamed = {k[len(prefix):]: v for k, v in source.items() if k.startswith(prefix)
               and not k.endswith(IGNORED_SUFFIXES)}
    missing = sorted(set(expected) - set(renamed))
    unexpected = sorted(set(renamed) - set(expected))
    mismatched = sorted(k for k in set(expected) & set(renamed) if renamed[k].shape != expected[k].shape)
    head = head_parameter_names(model)
    head_misfit = set(mismatched) | set(missing)
    reinitialized = tuple(sorted(head_misfit & head)) if head_misfit & head else ()
    problems = _describe(path, [k for k in missing if k not in head], unexpected,
                         [k for k in mismatched if k not in head], renamed, expected)
    if problems:
        raise InitError(problems)
    state = {k: v for k, v in renamed.items() if k not in reinitialized}
    return InitPlan(state, reinitialized, prefix)


def apply_init(plan: InitPlan, model: nn.Module) -> None:
    model.load_state_dict(plan.state, strict=False)


def log_plan(path: Path, plan: InitPlan) -> None:
    log.info("init from %s: %d tensors loaded%s", path, len(plan.state),
             f" (prefix {plan.prefix!r} removed)" if plan.prefix else "")
    if plan.reinitialized:
        log.info("init: classifier head re-initialized (another shape in %s): %s", path.name,
                 ", ".join(plan.reinitialized))


def _best_prefix(source: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> str:
    candidates = {""}
    for key in source:
        parts = key.split(".")
        candidates.update(".".join(parts[:depth]) + "." for depth in range(1, min(3, len(parts))))
    return max(sorted(candidates), key=lambda p: sum(k[len(p):] in expected for k in source if k.startswith(p)))


def _describe(path: Path, missing: list[str], unexpected: list[str], mismatched: list[str],
              renamed: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> str:
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing: {_listed(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected: {_listed(unexpected)}")
    if mismatched:
        shapes = [f"{k} {tuple(renamed[k].shape)} vs {tuple(expected[k].shape)}" for k in mismatched]
        parts.append(f"{len(mismatched)} of another shape (file vs model): {_listed(shapes)}")
    if not parts:
        return ""
    return (f"init={str(path)!r} does not fit the model: " + "; ".join(parts)
            + " (only the classifier head, the last nn.Linear, may differ)")


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown + (f", ... ({len(items) - SHOWN} more)" if len(items) > SHOWN else "")


def check_init(path: Path, model_name: str, num_classes: int) -> InitPlan:
    """Before any process starts: the file loads into the model, or an InitError says why. Logs the plan."""
    from stoker.training.models import build_model

    plan = plan_init(path, build_model(model_name, num_classes))
    log_plan(path, plan)
    return plan

"""Whether `--resume` continues the same run: the checkpoint's recorded settings, classes and data sizes against
this start's, before any process starts.

A resume trains the batches the plan would have given the run it continues: a setting that changes the plan (the
data, the seed, the batch size, the model, the optimizer, the arithmetic, ...) or a class list that changed (a
renamed class folder shifts every later label) would silently train another run from its weights. Which settings
may change is declared on each field (`Setting.may_change_on_resume`); every other one is compared, so a setting
added later is compared too unless it declares otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stoker.common.choices import SizeRamp
from stoker.common.config import (
    BUILTIN_IMAGE_SIZE,
    DEFAULT_IMAGE_SIZE,
    MAY_CHANGE_ON_RESUME,
    TrainConfig,
    unrecorded_meant,
)
from stoker.training.model_file import BEST_MODEL_FILE, ModelFileError, read_model


class ResumeError(ValueError):
    """The checkpoint cannot be continued with these settings; the message names what differs and what to do."""


def check_resumable(folder: Path, meta: dict[str, Any], config: TrainConfig, classes: list[str],
                    samples: dict[str, int]) -> None:
    """Raise `ResumeError` when the run is already complete, or when this start differs from the checkpoint in a
    setting that changes the plan, the class list or the number of samples."""
    where = f"resume={str(config.resume)!r} ({folder.name})"
    differences = [*setting_differences(meta.get("config"), config), *_class_differences(meta.get("classes"), classes),
                   *_sample_differences(meta.get("samples"), samples)]
    if differences:
        raise ResumeError(f"{where}: {'; '.join(differences)}; a resume continues the same run, so these must be "
                          "as the checkpoint recorded (only epochs, producers, devices, checkpoints, logging, "
                          "reports and timeouts may change); start a new run with --out to train with them")
    position = meta["position"]
    if position.get("offset", 0) > samples["train"]:  # before it sizes the epoch's rest (a forged checksum)
        raise ResumeError(f"{where}: the checkpoint's position says {position['offset']} samples of its epoch were "
                          f"trained, more than the {samples['train']} training samples")
    done = position["epoch"]  # epochs whose every step is done (a checkpoint at a step of the next: only those)
    if done >= config.epochs:
        if done == config.epochs and position["step"] == 0:
            raise ResumeError(f"{where}: run already completed ({done}/{config.epochs} epochs); give --epochs "
                              f"{done + 1} or more to train on")
        raise ResumeError(f"{where}: the checkpoint has {done} epochs done, more than epochs={config.epochs}; "
                          f"give --epochs {done + 1} or more to train on")


def setting_differences(recorded: Any, config: TrainConfig) -> list[str]:
    """'name: checkpoint X, now Y' for every plan-changing setting that differs. A setting the checkpoint does not
    record (added to stoker after it was written) counts as what runs did then: its default, or the value
    its `Setting.unrecorded` names when the default changed what is trained."""
    if not isinstance(recorded, dict):
        return ["the checkpoint records no settings"]
    now = config.as_json()
    defaults = {**TrainConfig().as_json(), **unrecorded_meant()}
    recorded = {**recorded, "image_size": _image_size(recorded)}
    now = {**now, "image_size": config.resolved_image_size}
    differences = []
    for name in sorted(set(now) - MAY_CHANGE_ON_RESUME):
        before = recorded.get(name, defaults[name])
        if before != now[name]:
            differences.append(f"{name}: checkpoint {before!r}, now {now[name]!r}")
    return differences


def _image_size(recorded: dict[str, Any]) -> Any:
    """The largest resolution the recorded run trained at (an unset image size depends on whether data was given;
    a ramp's is its MAX)."""
    if isinstance(recorded.get("image_size_ramp"), str):
        return SizeRamp.parse(recorded["image_size_ramp"]).high
    if recorded.get("image_size") is not None:
        return recorded["image_size"]
    return BUILTIN_IMAGE_SIZE if recorded.get("data") is None else DEFAULT_IMAGE_SIZE


def _class_differences(recorded: Any, classes: list[str]) -> list[str]:
    if recorded is None or list(recorded) == classes:
        return []
    if len(recorded) != len(classes):
        return [f"classes: checkpoint {len(recorded)}, now {len(classes)}"]
    index = next(i for i, (a, b) in enumerate(zip(recorded, classes, strict=True)) if a != b)
    return [f"classes: label {index} was {recorded[index]!r} at the checkpoint, now {classes[index]!r} (a renamed, "
            "added or removed class folder shifts the labels)"]


def _sample_differences(recorded: Any, samples: dict[str, int]) -> list[str]:
    """Checkpoints written before their sample counts were recorded hold none: nothing to compare."""
    if not isinstance(recorded, dict):
        return []
    return [f"{kind} samples: checkpoint {recorded.get(kind)}, now {count}" for kind, count in samples.items()
            if recorded.get(kind) != count]


def replicas_agree(meta: dict[str, Any]) -> bool:
    """Whether every replica in the checkpoint holds the averaged model (saved right after an averaging). Written
    before this was recorded: so at every step with `sync_every` 1 and no overlap."""
    if "replicas_agree" in meta:
        return bool(meta["replicas_agree"])
    config = meta.get("config")
    if not isinstance(config, dict):
        return False
    return config.get("sync_every", 1) == 1 and not config.get("overlap_averaging", False)


def check_other_count(config: TrainConfig, saved: int, consumers: int, agree: bool) -> None:
    """A resume with another number of consumers: the epoch in progress is planned again for them, and each new
    consumer takes a saved one's optimizer and RNG state; that needs every replica to hold the averaged model."""
    where = f"resume={str(config.resume)!r}: the checkpoint has {saved} consumers, this run {consumers}"
    if not agree:
        raise ResumeError(f"{where}, and it was saved between two averagings (sync_every={config.sync_every}), "
                          f"where replicas differ; resume with {saved} consumers, or from a checkpoint at an "
                          "averaging")


DISCARDED_BEST_FILE = "model_best.discarded.pt"


def set_aside_later_best(run_dir: Path, epochs_done: int) -> Path | None:
    """A resume that falls back to an older checkpoint discards the epochs after it: a model_best.pt one of them
    chose is set aside (renamed, not deleted), so the resumed run's own validations choose the best again and the
    summary never names a model of epochs that no longer happened. Returns where it went, or None."""
    best = run_dir / BEST_MODEL_FILE
    if not best.exists():
        return None
    try:
        epoch = read_model(best)[0].epoch
    except ModelFileError:
        return None  # the consumer warns and replaces it at the first validation
    if epoch is None or epoch <= epochs_done:
        return None
    aside = run_dir / DISCARDED_BEST_FILE
    best.replace(aside)
    return aside

"""Training configuration: one frozen, validated dataclass shared by the command line, TOML files and the API.

Every user error is raised here as `ConfigError` (a `ValueError`) naming the setting, the value and what is
allowed, before any process starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import tomllib
from pathlib import Path
from typing import Any, Literal

import pydantic
from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.dataclasses import dataclass

from stoker.common.devices import check_devices_form
from stoker.common.procs import MAX_PRODUCERS

Augment = Literal["standard", "noflip", "none", "trivial", "randaug"]

BUILTIN_IMAGE_SIZE = 32
DEFAULT_IMAGE_SIZE = 224


class ConfigError(ValueError):
    """A setting the user gave is wrong; the message says which, what it was and what is allowed."""


# The settings `--resume` may change: they decide how the run is executed, watched or stopped, not which batches
# it trains on, in what order or with what arithmetic. Every other setting (a field added below included, unless
# it is listed here) changes the plan, and a resume that gives it another value than the checkpoint recorded
# stops with exit code 2 naming it (stoker/run/resume.py). `epochs` may grow: a cosine schedule is then stretched
# over the new total, so the learning rate jumps back up at the resumed step (README, "Resume").
MAY_CHANGE_ON_RESUME = frozenset({
    "epochs", "out", "resume", "devices", "producers", "min_producers", "initial_producers", "max_producers",
    "slots_per_consumer", "checkpoint_every", "check_replicas_every", "collective_timeout_s", "producer_timeout_s",
    "max_bad_fraction", "log_every_s", "report", "tensorboard",
    "val_image_size",  # validation only reads the model: the training steps stay bitwise the same
})


# What a run did before a setting existed, where that is not the setting's default: a checkpoint written before
# the setting was added is compared (on resume) with this, not with today's default.
UNRECORDED_MEANT: dict[str, Any] = {
    "no_decay_norm_bias": False,  # weight decay on every parameter, as every run did before the recipe
}


# The numeric settings: none takes a boolean (pydantic's lax mode reads true as 1).
NUMBER_SETTINGS = (
    "val_fraction", "image_size", "producers", "min_producers", "initial_producers", "max_producers", "batch_size",
    "epochs", "lr", "momentum", "weight_decay", "sync_every", "outer_lr", "outer_momentum", "seed", "checkpoint_every",
    "slots_per_consumer", "check_replicas_every", "collective_timeout_s", "producer_timeout_s", "max_bad_fraction",
    "log_every_s", "lr_head_multiplier", "warmup_epochs", "label_smoothing", "mixup", "cutmix", "ema", "clip_grad_norm",
    "random_erasing", "val_image_size",
)


# allow_inf_nan: no setting means anything at infinity or NaN (lr = inf passed, and diverged at step 1 after every
# process had started).
@dataclass(frozen=True, config=ConfigDict(extra="forbid", strict=False, allow_inf_nan=False))
class TrainConfig:
    # A new field changes the plan (a resume must keep its value) unless MAY_CHANGE_ON_RESUME above names it.
    data: Path | None = None
    val: Path | None = None
    val_fraction: float = Field(default=0.1, ge=0.0, lt=1.0)
    model: str = "resnet8"
    image_size: int | None = Field(default=None, ge=8, le=2048)
    augment: Augment = "standard"
    devices: str = "auto"
    producers: int | Literal["auto"] = "auto"
    min_producers: int = Field(default=1, ge=1, le=MAX_PRODUCERS)
    initial_producers: int | None = Field(default=None, ge=1, le=MAX_PRODUCERS)
    max_producers: int | None = Field(default=None, ge=1, le=MAX_PRODUCERS)
    batch_size: int = Field(default=64, ge=1, le=65536)
    epochs: int = Field(default=10, ge=1, le=1_000_000)
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(default=0.05, gt=0.0)
    schedule: Literal["cosine", "step", "constant"] = "cosine"
    momentum: float = Field(default=0.9, ge=0.0, lt=1.0)
    weight_decay: float = Field(default=5e-4, ge=0.0)
    sync_every: int = Field(default=1, ge=1)
    outer_optimizer: Literal["none", "sgd", "nesterov"] = "none"
    outer_lr: float = Field(default=0.7, gt=0.0)
    outer_momentum: float = Field(default=0.9, ge=0.0, lt=1.0)
    overlap_averaging: bool = False
    average_in_backward: bool = True
    seed: int = Field(default=0, ge=0, le=2**64 - 1)  # torch.manual_seed takes no more
    out: Path | None = None
    resume: Path | None = None
    checkpoint_every: int = Field(default=0, ge=0)
    slots_per_consumer: int = Field(default=4, ge=2, le=64)
    check_replicas_every: int = Field(default=0, ge=0)
    collective_timeout_s: float = Field(default=60.0, gt=0)
    # A third of the collective timeout: a hung file is detected, its batch rebuilt and the waiting rank trained
    # while its peers still wait in the averaging collective (at equal timeouts they gave up first).
    producer_timeout_s: float = Field(default=20.0, gt=0)
    max_bad_fraction: float = Field(default=0.1, ge=0.0, le=1.0)
    log_every_s: float = Field(default=10.0, gt=0)
    report: bool = True
    tensorboard: bool = False
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    channels_last: bool = True
    compile: bool = False
    deterministic: bool = False
    # The training recipe (stoker/training/recipe.py, schedule.py, ema.py, init.py); every switch off by default
    # except no_decay_norm_bias, which SGD and AdamW recipes keep on (timm, torchvision's references).
    init: Path | None = None
    lr_head_multiplier: float = Field(default=1.0, gt=0.0)
    warmup_epochs: float = Field(default=0.0, ge=0.0)
    label_smoothing: float = Field(default=0.0, ge=0.0, lt=1.0)
    mixup: float = Field(default=0.0, ge=0.0)
    cutmix: float = Field(default=0.0, ge=0.0)
    ema: float = Field(default=0.0, ge=0.0, lt=1.0)
    clip_grad_norm: float = Field(default=0.0, ge=0.0)
    no_decay_norm_bias: bool = True
    random_erasing: float = Field(default=0.0, ge=0.0, le=1.0)
    # Validation's side (short side resized, centre crop) when it differs from training's: FFCV trains at 160-192
    # and tests at 224-256 (Touvron et al. 2019, "Fixing the train-test resolution discrepancy"). None: image_size.
    val_image_size: int | None = Field(default=None, ge=8, le=2048)

    @field_validator("devices")
    @classmethod
    def _devices_form(cls, value: str) -> str:
        return check_devices_form(value)  # the same check as eval's and predict's --devices

    @field_validator(*NUMBER_SETTINGS, mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # epochs = true in a TOML was 1 epoch to pydantic, lr = true 1.0
            raise ValueError(f"expected a number, got {str(value).lower()}")
        return value

    @field_validator("producers")
    @classmethod
    def _producers_positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= MAX_PRODUCERS:
            raise ValueError(f"expected 'auto' or a number of producer processes from 1 to {MAX_PRODUCERS}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.initial_producers is not None and not (
                self.min_producers <= self.initial_producers <= (self.max_producers or self.initial_producers)):
            raise ValueError(f"initial_producers={self.initial_producers} is outside min_producers.."
                             f"max_producers ({self.min_producers}..{self.max_producers})")
        if self.overlap_averaging and self.outer_optimizer != "none":
            raise ValueError(f"overlap_averaging=true cannot be combined with outer_optimizer="
                             f"{self.outer_optimizer!r}: the outer step needs the average before training goes on")
        if self.overlap_averaging and self.ema:
            raise ValueError(f"ema={self.ema} cannot be combined with overlap_averaging=true: the EMA follows the "
                             "averaged model, and overlapped replicas are averaged one window late (they differ "
                             "when the EMA would be updated)")
        if isinstance(self.producers, int) and self.max_producers is not None and self.producers > self.max_producers:
            raise ValueError(f"producers={self.producers} is above max_producers={self.max_producers} (a fixed count "
                             "is its own ceiling: give one of the two)")
        if self.max_producers is not None and self.max_producers < self.min_producers:
            raise ValueError(f"max_producers={self.max_producers} is below min_producers={self.min_producers}")
        for name in ("data", "val"):
            folder = getattr(self, name)
            if folder is not None and not (folder.is_dir() or folder.is_file() or "{" in str(folder)):
                raise ValueError(f"{name}={str(folder)!r} is not a folder, a .tar shard, a list file or a brace "
                                 "pattern (expected an ImageFolder root or WebDataset-layout shards)")
        if self.tensorboard and importlib.util.find_spec("tensorboardX") is None:
            raise ValueError("tensorboard=true needs the tensorboardX package: pip install 'stoker[tensorboard]'")
        if self.init is not None and not self.init.is_file():
            raise ValueError(f"init={str(self.init)!r} is not a file (expected a state_dict saved with torch.save)")
        if self.warmup_epochs >= self.epochs:
            raise ValueError(f"warmup_epochs={self.warmup_epochs} must be below epochs={self.epochs}")
        if self.resume is not None and not self.resume.is_dir():
            raise ValueError(f"resume={str(self.resume)!r} is not a run folder")
        return self

    @property
    def resolved_image_size(self) -> int:
        if self.image_size is not None:
            return self.image_size
        return BUILTIN_IMAGE_SIZE if self.data is None else DEFAULT_IMAGE_SIZE

    @property
    def resolved_val_image_size(self) -> int:
        return self.resolved_image_size if self.val_image_size is None else self.val_image_size

    def replace(self, **changes: Any) -> TrainConfig:
        return make_config({**self.as_dict(), **changes})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def as_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.as_dict().items()}


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(TrainConfig))
assert MAY_CHANGE_ON_RESUME <= set(FIELD_NAMES), "MAY_CHANGE_ON_RESUME names a setting that does not exist"
assert set(UNRECORDED_MEANT) <= set(FIELD_NAMES), "UNRECORDED_MEANT names a setting that does not exist"


RUN_CONFIG_FILE = "config.json"


def make_config(values: dict[str, Any], origins: dict[str, str] | None = None) -> TrainConfig:
    """Build a TrainConfig, turning pydantic's report into one `ConfigError` that names every bad setting, and
    the file it came from (`origins`: setting -> file, for values read from a TOML file).

    With `resume`, the resumed run's own settings are the defaults: `--resume RUN_DIR` alone continues it.
    """
    origins = dict(origins or {})
    if values.get("resume") is not None:
        saved = _saved_settings(Path(values["resume"]))
        origins.update({key: str(Path(values["resume"]) / RUN_CONFIG_FILE) for key in saved if key not in values})
        values = {**saved, **values}
    unknown = sorted(set(values) - set(FIELD_NAMES))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; allowed: {', '.join(FIELD_NAMES)}")
    try:
        return TrainConfig(**values)
    except pydantic.ValidationError as error:
        raise ConfigError(_describe(error, origins)) from None


def _saved_settings(run_dir: Path) -> dict[str, Any]:
    try:
        saved = json.loads((run_dir / RUN_CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise ConfigError(f"resume={str(run_dir)!r}: no {RUN_CONFIG_FILE}; is this a stoker run folder?") from None
    except ValueError as error:
        raise ConfigError(f"resume={str(run_dir)!r}: unreadable {RUN_CONFIG_FILE} ({error})") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"resume={str(run_dir)!r}: {RUN_CONFIG_FILE} holds a {type(saved).__name__}, not the "
                          "settings stoker writes there (an object of setting: value)")
    return {k: v for k, v in saved.items() if k in FIELD_NAMES and k not in ("resume", "out")}


def _describe(error: pydantic.ValidationError, origins: dict[str, str]) -> str:
    lines = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"] if not isinstance(part, int)) or "config"
        where = where.split(".")[0]
        value = problem.get("input")
        shown = f"={value!r}" if not isinstance(value, (dict, pydantic.BaseModel)) and where != "config" else ""
        origin = f" (from {origins[where]})" if where in origins else ""
        lines.append(f"{where}{shown}{origin}: {problem['msg']}")
    return "invalid configuration: " + "; ".join(dict.fromkeys(lines))


def load_toml(path: Path) -> dict[str, Any]:
    """Read settings from a TOML file: top-level keys or a [train] table, named like the command-line flags."""
    try:
        with open(path, "rb") as handle:
            raw = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"config={str(path)!r}: file not found") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config={str(path)!r}: not valid TOML ({error})") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"config={str(path)!r}: not a text file (TOML is UTF-8; byte {error.start} is "
                          f"{error.object[error.start:error.start + 1]!r})") from None
    table = raw.get("train", raw)
    if not isinstance(table, dict):
        raise ConfigError(f"config={str(path)!r}: [train] must be a table")
    values = {key.replace("-", "_"): value for key, value in table.items()}
    # A file's paths mean what they say wherever the command runs from: relative to the file's own folder (and
    # shown resolved in any error).
    folder = path.resolve().parent
    return {key: (str(folder / value) if key in PATH_SETTINGS and isinstance(value, str) else value)
            for key, value in values.items()}


PATH_SETTINGS = frozenset(f.name for f in dataclasses.fields(TrainConfig) if "Path" in str(f.type))

"""Settings: typed, frozen, validated sections, one vocabulary for `stoker train`, TOML files, `stoker.Loader`,
`stoker eval` and `stoker predict`.

Each setting is declared once, on its section's field: its type and bounds (checked by pydantic), and a `Setting`
beside them with its flag's help, its `--help` group and how a run treats it (may a resume change it, is it each
machine's own, does it differ between any two runs). `TrainConfig` is every section at once, flat: the flags, the
TOML keys and `RUN_DIR/config.json` name settings without their section. The other commands validate the sections
they take with the same classes (`check_section`), so a bad value gets the same message everywhere.

Every user error is raised here as `ConfigError` (a `ValueError`) naming the setting, the value and what is
allowed, before any process starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import tomllib
from dataclasses import dataclass as plain_dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import pydantic
from pydantic import BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic.dataclasses import dataclass

from stoker.common.choices import BUILTIN_IMAGE_SIZE, DEFAULT_IMAGE_SIZE, Augment, SizeRamp
from stoker.common.devices import check_devices_form
from stoker.common.procs import MAX_PRODUCERS
from stoker.common.sizes import parse_size
from stoker.common.urls import check_url, data_location, is_remote

__all__ = ["BUILTIN_IMAGE_SIZE", "DEFAULT_IMAGE_SIZE", "Augment", "ConfigError", "TrainConfig", "make_config"]

# The `--help` groups, in the order shown.
DATA, RECIPE, DEVICES, AVERAGING, RUN, OUTPUT, EXPERT = (
    "data", "model and recipe", "devices and producers", "averaging", "run folder and checkpoints", "output",
    "expert knobs")
GROUPS = (DATA, RECIPE, DEVICES, AVERAGING, RUN, OUTPUT, EXPERT)

_UNSET: Any = object()
S = TypeVar("S")
MAX_SLOTS_PER_CONSUMER = 64  # each slot holds a whole batch in shared memory
MIN_IMAGE_SIZE = 8
MAX_IMAGE_SIZE = 2048


class ConfigError(ValueError):
    """A setting the user gave is wrong; the message says which, what it was and what is allowed."""


@plain_dataclass(frozen=True)
class Setting:
    """What a setting is besides its type: its flag, and how a run treats it.

    `may_change_on_resume`: it decides how the run is executed, watched or stopped, not which batches it trains
    on, in what order or with what arithmetic; every other setting is compared on `--resume`, and a different
    value stops the start with exit code 2 naming it (`run/resume.py`). `machine_local`: each machine of a
    multi-machine run has its own (paths, producer counts); the others must agree. `per_run`: differs between any
    two runs, so a comparison of two runs does not list it. `unrecorded`: what runs did before the setting
    existed, where that is not its default (a checkpoint written then is compared with it). `loader`:
    `stoker.Loader` takes it as a keyword, meaning what it means here."""

    help: str
    metavar: str
    group: str | None = None  # None: the section's
    may_change_on_resume: bool = False
    machine_local: bool = False
    per_run: bool = False
    unrecorded: Any = _UNSET
    loader: bool = False


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):  # pydantic's lax mode reads true as 1: epochs = true was 1 epoch, lr = true 1.0
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


Count = Annotated[int, BeforeValidator(_not_a_bool)]
Real = Annotated[float, BeforeValidator(_not_a_bool)]
MaybeCount = Annotated[int | None, BeforeValidator(_not_a_bool)]

# allow_inf_nan: no setting means anything at infinity or NaN (lr = inf passed, and diverged at step 1 after every
# process had started).
SECTION = ConfigDict(extra="forbid", strict=False, allow_inf_nan=False)


# `--data` and `--val`: a local folder, shard or list file (a Path), or the URL of remote shards (a str).
DataLocation = Annotated[Path | str | None, BeforeValidator(data_location)]


def check_data_path(name: str, path: Path | str | None) -> None:
    """What `--data` (and `--val`, a Loader's `data`, eval's `--data`) may name, before anything is read."""
    if isinstance(path, str):
        check_url(name, path)
    elif path is not None and not (path.is_dir() or path.is_file() or any(c in str(path) for c in "{*?")):
        raise ValueError(f"{name}={str(path)!r} is not a folder, a .tar shard, a Parquet file, a list file or a "
                         "pattern (expected an ImageFolder root, WebDataset-layout shards or Parquet files)")


@dataclass(frozen=True, config=SECTION)
class DataSettings:
    GROUP: ClassVar[str] = DATA

    data: Annotated[DataLocation, Setting(
        "ImageFolder root (a sub-folder per class), WebDataset-layout .tar shards (a brace pattern such as "
        "train-{000..127}.tar, a folder of shards, a list file) or Parquet files (one, a folder, a pattern, a "
        "datasets.save_to_disk folder), local or at an https:// or s3:// URL; default: the built-in dataset",
        "DIR|SHARDS|URL", machine_local=True)] = None
    val: Annotated[DataLocation, Setting(
        "validation ImageFolder, shards or Parquet files, local or remote (default: hold out --val-fraction of "
        "--data)", "DIR|SHARDS|URL", machine_local=True)] = None
    image_column: Annotated[str | None, Setting(
        "Parquet data: the column holding each image's bytes (default: image, else img, else the only one that "
        "can)", "NAME", loader=True)] = None
    label_column: Annotated[str | None, Setting(
        "Parquet data: the column holding each integer label (default: label, else labels)", "NAME",
        loader=True)] = None
    cache_dir: Annotated[Path | None, Setting(
        "keep whole copies of remote shards here, so later epochs read them from disk (shared safely by runs on "
        "this machine); default: read remote shards over the network every epoch", "DIR", machine_local=True,
        may_change_on_resume=True, loader=True)] = None
    cache_size: Annotated[str | None, Setting(
        "the most --cache-dir may hold, e.g. 50GB (default: half the disk's free space at start, its own copies "
        "counted as free)", "SIZE",
        machine_local=True, may_change_on_resume=True, loader=True)] = None
    val_fraction: Annotated[Real, Setting(
        "share of each class held out for validation when --val is not given", "F")] = Field(
        default=0.1, ge=0.0, lt=1.0)
    image_size: Annotated[MaybeCount, Setting("training resolution (default 32 on the built-in data, else 224)",
                                              "PX", loader=True)] = Field(default=None, ge=MIN_IMAGE_SIZE,
                                                                          le=MAX_IMAGE_SIZE)
    # FFCV's progressive resizing (its ResNet-50 recipe: 160 px, ramped to 192 over the last epochs): the side is a
    # pure function of the epoch, so the batches stay a pure function of (seed, epoch, step, rank).
    image_size_ramp: Annotated[str | None, Setting(
        "MIN:MAX@START-END: train at MIN px up to epoch START and at MAX px from epoch END on, linear in between in "
        "steps of 32 (FFCV's min_res, max_res, start_ramp, end_ramp; epochs from 0); validation stays at "
        "--val-image-size (default MAX)", "RAMP", loader=True)] = None
    augment: Annotated[Augment, Setting(
        "standard (random resized crop + flip) | noflip | none | trivial (standard + TrivialAugment) | randaug "
        "(standard + RandAugment, 2 ops at magnitude 9)", "MODE", group=RECIPE, loader=True)] = "standard"
    max_bad_fraction: Annotated[Real, Setting(
        "stop when more than this share of files is unusable", "F", may_change_on_resume=True, loader=True)] = Field(
        default=0.1, ge=0.0, le=1.0)
    # Validation's side (short side resized, centre crop) when it differs from training's: FFCV trains at 160-192
    # and tests at 224-256 (Touvron et al. 2019, "Fixing the train-test resolution discrepancy"). Validation only
    # reads the model, so the training steps stay bitwise the same whatever it is.
    val_image_size: Annotated[MaybeCount, Setting(
        "validation resolution: short side resized, centre crop (default: --image-size; larger than training's "
        "helps, e.g. train 160, validate 224)", "PX", may_change_on_resume=True)] = Field(
        default=None, ge=MIN_IMAGE_SIZE, le=MAX_IMAGE_SIZE)

    @model_validator(mode="after")
    def _paths_exist(self) -> DataSettings:
        check_data_path("data", self.data)
        check_data_path("val", self.val)
        if self.cache_bytes is not None and self.cache_dir is None:  # (a cache_size that does not parse: named)
            raise ValueError(f"cache_size={self.cache_size!r} bounds --cache-dir, which is not given")
        if self.cache_dir is not None and self.cache_dir.exists() and not self.cache_dir.is_dir():
            raise ValueError(f"cache_dir={str(self.cache_dir)!r} is a file, not a folder")
        self._ramp_fits()
        return self

    def _ramp_fits(self) -> None:
        ramp = self.size_ramp
        if ramp is None:
            return
        if not MIN_IMAGE_SIZE <= ramp.low <= ramp.high <= MAX_IMAGE_SIZE:
            raise ValueError(f"image_size_ramp={self.image_size_ramp!r}: sizes from {MIN_IMAGE_SIZE} to "
                             f"{MAX_IMAGE_SIZE} px expected")
        if self.image_size is not None and self.image_size != ramp.high:
            raise ValueError(f"image_size={self.image_size} and image_size_ramp={self.image_size_ramp!r} disagree: "
                             f"the ramp ends at {ramp.high} px, the largest training size (give one of the two)")

    @property
    def size_ramp(self) -> SizeRamp | None:
        """`image_size_ramp` read (None: every epoch at `resolved_image_size`)."""
        if self.image_size_ramp is None:
            return None
        try:
            return SizeRamp.parse(self.image_size_ramp)
        except ValueError as error:
            raise ValueError(f"image_size_ramp={self.image_size_ramp!r}: {error}") from None

    @property
    def cache_bytes(self) -> int | None:
        """`cache_size` in bytes (None: not given)."""
        return None if self.cache_size is None else parse_size("cache_size", self.cache_size)

    @property
    def resolved_image_size(self) -> int:
        """The largest training side: every epoch's, or the ramp's last."""
        ramp = self.size_ramp
        if ramp is not None:
            return ramp.high
        if self.image_size is not None:
            return self.image_size
        return BUILTIN_IMAGE_SIZE if self.data is None else DEFAULT_IMAGE_SIZE

    @property
    def resolved_val_image_size(self) -> int:
        return self.resolved_image_size if self.val_image_size is None else self.val_image_size


@dataclass(frozen=True, config=SECTION)
class FeedSettings:
    """What the producers build and how many there are: every command that reads images takes these."""

    GROUP: ClassVar[str] = DEVICES

    batch_size: Annotated[Count, Setting("samples per consumer per step", "B", group=RECIPE,
                                         loader=True)] = Field(
        default=64, ge=1, le=65536)
    # As DataLoader's drop_last (a Loader's argument of that name): a last step of a few samples trains BatchNorm
    # on their statistics alone, and its running averages follow them.
    drop_last: Annotated[bool, Setting(
        "true | false: leave out each epoch's short last step (its samples wait for another epoch's order)", "BOOL",
        group=RECIPE, loader=True)] = False
    producers: Annotated[int | Literal["auto"], BeforeValidator(_not_a_bool), Setting(
        "auto (fork more when consumers wait) or a fixed count", "M", may_change_on_resume=True,
        machine_local=True, loader=True)] = "auto"
    min_producers: Annotated[Count, Setting("lower bound for --producers auto", "A", may_change_on_resume=True,
                                            machine_local=True, loader=True)] = Field(default=1, ge=1, le=MAX_PRODUCERS)
    initial_producers: Annotated[MaybeCount, Setting(
        "where --producers auto starts (default: a producer per core, at least --min-producers)", "M",
        may_change_on_resume=True, machine_local=True)] = Field(default=None, ge=1, le=MAX_PRODUCERS)
    max_producers: Annotated[MaybeCount, Setting(
        "upper bound for --producers auto (default: the parts the ring holds in flight, slots x batch / 4, at most "
        "128 and half the memory)", "B",
        may_change_on_resume=True, machine_local=True, loader=True)] = Field(default=None, ge=1, le=MAX_PRODUCERS)
    # A third of the collective timeout: a hung file is detected, its batch rebuilt and the waiting rank trained
    # while its peers still wait in the averaging collective (at equal timeouts they gave up first).
    producer_timeout_s: Annotated[Real, Setting(
        "seconds without progress on one file before a producer counts as hung", "S", group=EXPERT,
        may_change_on_resume=True, loader=True)] = Field(default=20.0, gt=0)
    slots_per_consumer: Annotated[Count, Setting("batch slots in shared memory per consumer", "K", group=EXPERT,
                                                 may_change_on_resume=True)] = Field(default=4, ge=2,
                                                                                     le=MAX_SLOTS_PER_CONSUMER)

    @field_validator("producers")
    @classmethod
    def _producers_in_range(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= MAX_PRODUCERS:
            raise ValueError(f"expected 'auto' or a number of producer processes from 1 to {MAX_PRODUCERS}")
        return value

    @model_validator(mode="after")
    def _counts_consistent(self) -> FeedSettings:
        if self.initial_producers is not None and not (
                self.min_producers <= self.initial_producers <= (self.max_producers or self.initial_producers)):
            raise ValueError(f"initial_producers={self.initial_producers} is outside min_producers.."
                             f"max_producers ({self.min_producers}..{self.max_producers})")
        if isinstance(self.producers, int) and self.max_producers is not None and self.producers > self.max_producers:
            raise ValueError(f"producers={self.producers} is above max_producers={self.max_producers} (a fixed count "
                             "is its own ceiling: give one of the two)")
        if self.max_producers is not None and self.max_producers < self.min_producers:
            raise ValueError(f"max_producers={self.max_producers} is below min_producers={self.min_producers}")
        return self


@dataclass(frozen=True, config=SECTION)
class DeviceSettings:
    GROUP: ClassVar[str] = DEVICES

    devices: Annotated[str, Setting(
        "auto (every visible GPU; without one, two CPU consumers sharing each step's batch, one on a 1-core "
        "machine) | cpu:N | cuda | "
        "cuda:0,1", "SPEC", may_change_on_resume=True, machine_local=True)] = "auto"
    precision: Annotated[Literal["fp32", "bf16", "fp16"], Setting(
        "fp32 | bf16 | fp16: autocast over fp32 weights (fp16 with a gradient scaler)", "P")] = "fp32"
    channels_last: Annotated[bool, Setting("true | false: feed the model channels_last input or plain NCHW", "BOOL",
                                           group=EXPERT, loader=True)] = True
    compile: Annotated[bool, Setting("true | false: torch.compile the model in each consumer", "BOOL",
                                     group=EXPERT)] = False
    deterministic: Annotated[bool, Setting(
        "true | false: deterministic cuDNN algorithms, no TF32 (bitwise resume on GPUs)", "BOOL",
        group=EXPERT)] = False
    # Not measured on a GPU yet: 2 leaves the host one device step to copy a batch into pinned memory and launch
    # the next; 3 gives it two, for one more staging buffer and one step later reports.
    steps_ahead: Annotated[Count, Setting(
        "steps the host may run ahead of a GPU (as many pinned staging buffers): the first GPU runs compare 2 and 3",
        "N", group=EXPERT, may_change_on_resume=True)] = Field(default=3, ge=1, le=8)

    @field_validator("devices")
    @classmethod
    def _devices_form(cls, value: str) -> str:
        return check_devices_form(value)


@dataclass(frozen=True, config=SECTION)
class ModelSettings:
    GROUP: ClassVar[str] = RECIPE

    model: Annotated[str, Setting("resnet8 | resnet14 | resnet20 | resnet18 | resnet50 | module:function",
                                  "NAME")] = "resnet8"
    init: Annotated[Path | None, Setting(
        "start from this state_dict (plain or under 'state_dict'/'model'; loaded by name, a head of another shape "
        "re-initialized)", "STATE_DICT")] = None

    @model_validator(mode="after")
    def _init_is_a_file(self) -> ModelSettings:
        if self.init is not None and not self.init.is_file():
            raise ValueError(f"init={str(self.init)!r} is not a file (expected a state_dict saved with torch.save)")
        return self


@dataclass(frozen=True, config=SECTION)
class OptimizerSettings:
    """The optimizer and the learning rate over the run."""

    GROUP: ClassVar[str] = RECIPE

    epochs: Annotated[Count, Setting(
        "passes over the training set", "E", may_change_on_resume=True)] = Field(default=10, ge=1, le=1_000_000)
    optimizer: Annotated[Literal["sgd", "adamw"], Setting(
        "sgd (with --momentum, --weight-decay) | adamw (--weight-decay)", "NAME")] = "sgd"
    lr: Annotated[Real, Setting("peak learning rate", "LR")] = Field(default=0.05, gt=0.0)
    schedule: Annotated[Literal["cosine", "step", "constant"], Setting(
        "learning rate over the run: cosine (decays to 0 at the last step) | step (x0.1 at 50%% and 75%% of the "
        "steps) | constant", "NAME")] = "cosine"
    momentum: Annotated[Real, Setting("SGD momentum (--optimizer sgd)", "MU")] = Field(default=0.9, ge=0.0, lt=1.0)
    weight_decay: Annotated[Real, Setting("weight decay: SGD's (added to the gradient) or AdamW's (decoupled)",
                                          "WD")] = Field(default=5e-4, ge=0.0)
    warmup_epochs: Annotated[Real, Setting(
        "linear warmup of the learning rate over E epochs, per step, then --schedule", "E")] = Field(
        default=0.0, ge=0.0)
    lr_head_multiplier: Annotated[Real, Setting(
        "learning rate multiplier of the classifier head (fine-tuning with --init)", "X")] = Field(default=1.0, gt=0.0)
    # On by default, as SGD and AdamW recipes keep it (timm, torchvision's references); every run before the
    # recipe decayed every parameter.
    no_decay_norm_bias: Annotated[bool, Setting(
        "true | false: no weight decay on norm layers' weights and on biases", "BOOL", unrecorded=False)] = True

    @model_validator(mode="after")
    def _warmup_within_the_run(self) -> OptimizerSettings:
        if self.warmup_epochs >= self.epochs:
            raise ValueError(f"warmup_epochs={self.warmup_epochs} must be below epochs={self.epochs}")
        return self


@dataclass(frozen=True, config=SECTION)
class RecipeSettings:
    """What a step does to its batch on the device besides forward and backward (`training/recipe.py`), and the
    EMA that follows the model; every switch off by default."""

    GROUP: ClassVar[str] = RECIPE

    label_smoothing: Annotated[Real, Setting("label smoothing of the targets (0: off)", "S")] = Field(
        default=0.0, ge=0.0, lt=1.0)
    mixup: Annotated[Real, Setting("mixup with Beta(A, A) mixing weights, on the device (0: off)", "A")] = Field(
        default=0.0, ge=0.0)
    cutmix: Annotated[Real, Setting(
        "cutmix with Beta(A, A) box areas, on the device (0: off; with --mixup, one of the two per batch)",
        "A")] = Field(default=0.0, ge=0.0)
    random_erasing: Annotated[Real, Setting("random erasing probability per sample, on the device (0: off)",
                                            "P")] = Field(default=0.0, ge=0.0, le=1.0)
    clip_grad_norm: Annotated[Real, Setting(
        "clip each replica's gradient norm to N before the replicas are averaged (0: off)", "N")] = Field(
        default=0.0, ge=0.0)
    ema: Annotated[Real, Setting(
        "keep an EMA of the weights with this decay (0: off), validated each epoch and saved as model_ema.pt",
        "D")] = Field(default=0.0, ge=0.0, lt=1.0)


@dataclass(frozen=True, config=SECTION)
class AveragingSettings:
    GROUP: ClassVar[str] = AVERAGING

    sync_every: Annotated[Count, Setting("average replicas every H steps", "H")] = Field(default=1, ge=1)
    outer_optimizer: Annotated[Literal["none", "sgd", "nesterov"], Setting(
        "none (plain average) | sgd | nesterov: apply the averaged change with --outer-lr, --outer-momentum "
        "(DiLoCo)", "NAME")] = "none"
    outer_lr: Annotated[Real, Setting("outer optimizer learning rate (1 with momentum 0 is the plain average)",
                                      "LR")] = Field(default=0.7, gt=0.0)
    outer_momentum: Annotated[Real, Setting("outer optimizer momentum", "MU")] = Field(default=0.9, ge=0.0, lt=1.0)
    average_in_backward: Annotated[bool, Setting(
        "true | false: start averaging during backward, group by group (same result)", "BOOL")] = True
    overlap_averaging: Annotated[bool, Setting(
        "true | false: average in the background while the next steps train, one window late (replicas identical "
        "again at the end)", "BOOL")] = False
    check_replicas_every: Annotated[Count, Setting(
        "compare replica hashes every K steps (0: at the end only)", "K", group=EXPERT,
        may_change_on_resume=True)] = Field(default=0, ge=0)
    collective_timeout_s: Annotated[Real, Setting(
        "seconds a consumer waits for its peers before the run fails", "S", group=EXPERT,
        may_change_on_resume=True)] = Field(default=60.0, gt=0)
    on_consumer_failure: Annotated[Literal["auto", "continue", "stop"], Setting(
        "continue | stop: when a consumer dies, the others go on without it (auto: continue with 2 or more CPU "
        "consumers on one machine and no overlapped averaging, else stop)", "WHAT", may_change_on_resume=True)] = "auto"
    min_consumers: Annotated[Count, Setting(
        "fewest consumers a run goes on with after failures; below, it ends failed", "K",
        may_change_on_resume=True)] = Field(default=1, ge=1)
    consumer_restarts: Annotated[Count, Setting(
        "times a consumer that died is started again on its device (it rejoins the others at their next regroup); "
        "past that its device stays out", "R", may_change_on_resume=True)] = Field(default=2, ge=0, le=100)
    global_batch: Annotated[Literal["shrink", "fixed"], Setting(
        "with fewer consumers (a death, or a resume on fewer): shrink (each keeps --batch-size, the learning rate "
        "follows the global batch) | fixed (the global batch, the steps and the schedule stay; each consumer takes "
        "a larger share, its slots sized for --min-consumers)", "HOW")] = "shrink"

    @model_validator(mode="after")
    def _outer_step_needs_the_average(self) -> AveragingSettings:
        if self.overlap_averaging and self.outer_optimizer != "none":
            raise ValueError(f"overlap_averaging=true cannot be combined with outer_optimizer="
                             f"{self.outer_optimizer!r}: the outer step needs the average before training goes on")
        return self

    @model_validator(mode="after")
    def _survivors_need_an_agreed_state(self) -> AveragingSettings:
        if self.overlap_averaging and self.on_consumer_failure == "continue":
            raise ValueError("on_consumer_failure='continue' cannot be combined with overlap_averaging=true: "
                             "overlapped replicas never hold one agreed state to go on from; use 'stop' or 'auto'")
        return self

    def check_failure_settings(self, consumers: int, several_machines: bool, on_gpus: bool, devices: str) -> None:
        """Before any process starts: `--on-consumer-failure continue` and `--min-consumers` this run can keep
        (`consumers` of this machine, from `devices`)."""
        if self.on_consumer_failure == "continue" and several_machines:
            raise ValueError("on_consumer_failure='continue' works on one machine; on several, a lost machine is "
                             "restarted by torchrun and resumes from the last checkpoint: use 'auto' or 'stop'")
        if self.on_consumer_failure == "continue" and on_gpus:
            raise ValueError("on_consumer_failure='continue' works with CPU consumers for now: on a GPU the state "
                             "kept after an averaging is copied before the device has finished it, and NCCL peers "
                             "of a dead consumer wait out the collective timeout; use 'auto' or 'stop'")
        if self.min_consumers > consumers:
            raise ValueError(f"min_consumers={self.min_consumers} is more than the {consumers} consumer(s) of "
                             f"devices={devices!r}")

    def continues_after_failure(self, consumers: int, machines: int, on_gpus: bool) -> bool:
        """Whether the survivors of a consumer's death go on without it (`on_consumer_failure`)."""
        if self.on_consumer_failure == "stop" or consumers < 2 or self.overlap_averaging:
            return False
        return machines == 1 and not on_gpus


@dataclass(frozen=True, config=SECTION)
class RunSettings:
    """The run folder, checkpoints and the seed everything random is drawn from."""

    GROUP: ClassVar[str] = RUN

    seed: Annotated[Count, Setting("seed for initialization, sampling and augmentation", "S", group=RECIPE,
                                   loader=True)] = Field(default=0, ge=0,
                                                         le=2**64 - 1)  # torch.manual_seed takes no more
    out: Annotated[Path | None, Setting(
        "run folder for summary.json, metrics.jsonl and checkpoints (default runs/<time>)", "RUN_DIR",
        may_change_on_resume=True, machine_local=True, per_run=True)] = None
    resume: Annotated[Path | None, Setting(
        "continue from the newest valid checkpoint of this run folder", "RUN_DIR", may_change_on_resume=True,
        machine_local=True, per_run=True)] = None
    checkpoint_every: Annotated[Count, Setting(
        "also checkpoint every STEPS steps (0: only at the end of each epoch, as always)", "STEPS",
        may_change_on_resume=True)] = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _resume_is_a_run_folder(self) -> RunSettings:
        if self.resume is not None and not self.resume.is_dir():
            raise ValueError(f"resume={str(self.resume)!r} is not a run folder")
        return self


@dataclass(frozen=True, config=SECTION)
class ObserveSettings:
    GROUP: ClassVar[str] = OUTPUT

    log_every_s: Annotated[Real, Setting(
        "seconds between progress lines when output is not a terminal", "S", may_change_on_resume=True,
        machine_local=True)] = Field(default=10.0, gt=0)
    report: Annotated[bool, Setting("true | false: draw RUN_DIR/report.png and report.txt at the end", "BOOL",
                                    may_change_on_resume=True, machine_local=True)] = True
    tensorboard: Annotated[bool, Setting(
        "true | false: also write TensorBoard event files to RUN_DIR/tensorboard", "BOOL", may_change_on_resume=True,
        machine_local=True)] = False

    @model_validator(mode="after")
    def _tensorboard_installed(self) -> ObserveSettings:
        if self.tensorboard and importlib.util.find_spec("tensorboardX") is None:
            raise ValueError("tensorboard=true needs the tensorboardX package: pip install 'stoker[tensorboard]'")
        return self


# The sections `stoker train` takes, in the order `--help` and config.json list their settings.
SECTIONS: tuple[type, ...] = (DataSettings, ModelSettings, FeedSettings, DeviceSettings, OptimizerSettings,
                              RecipeSettings, AveragingSettings, RunSettings, ObserveSettings)


# SECTIONS in reverse: a dataclass lists its bases' fields from the last base to the first.
@dataclass(frozen=True, config=SECTION)
class TrainConfig(ObserveSettings, RunSettings, AveragingSettings, RecipeSettings, OptimizerSettings, DeviceSettings,
                  FeedSettings, ModelSettings, DataSettings):
    """Every section of `stoker train` at once, flat (`config.lr`, `config.producers`); `config.section(X)`
    gives one section of it."""

    @model_validator(mode="after")
    def _sections_agree(self) -> TrainConfig:
        if self.overlap_averaging and self.ema:
            raise ValueError(f"ema={self.ema} cannot be combined with overlap_averaging=true: the EMA follows the "
                             "averaged model, and overlapped replicas are averaged one window late (they differ "
                             "when the EMA would be updated)")
        return self

    def producer_timeout_warning(self, world: int) -> str | None:
        """With several consumers, a rank whose batch is stuck in a hung producer leaves its peers waiting in the
        collective: the producer must be declared hung, replaced and the batch rebuilt well within their timeout."""
        if world > 1 and self.producer_timeout_s > self.collective_timeout_s / 2:
            return (f"producer_timeout_s={self.producer_timeout_s:g} is more than half of collective_timeout_s="
                    f"{self.collective_timeout_s:g}: a producer hung on a file may make the run fail (its peers stop "
                    "waiting) before it is replaced; keep it at a third or less")
        return None

    def section(self, section: type[S]) -> S:
        return section(**{name: getattr(self, name) for name in setting_names(section)})

    def replace(self, **changes: Any) -> TrainConfig:
        return make_config({**self.as_dict(), **changes})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def as_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.as_dict().items()}


def setting_names(section: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(section))


def about(section: type, name: str) -> Setting:
    """The `Setting` declared on a section's field."""
    field = section.__pydantic_fields__[name]  # type: ignore[attr-defined]
    found = [item for item in field.metadata if isinstance(item, Setting)]
    assert len(found) == 1, f"{section.__name__}.{name} declares no Setting"
    return found[0]


def help_group(name: str) -> str:
    section = next(s for s in SECTIONS if name in setting_names(s))
    return about(section, name).group or str(vars(section)["GROUP"])


def names_where(flag: str) -> frozenset[str]:
    """The settings whose `Setting` has `flag` (a boolean property) set."""
    return frozenset(name for name in FIELD_NAMES if getattr(about(TrainConfig, name), flag))


def unrecorded_meant() -> dict[str, Any]:
    """What a run did before each setting existed, where that is not the setting's default."""
    return {name: about(TrainConfig, name).unrecorded for name in FIELD_NAMES
            if about(TrainConfig, name).unrecorded is not _UNSET}


def default_of(name: str) -> Any:
    return TrainConfig.__pydantic_fields__[name].default  # type: ignore[attr-defined]


FIELD_NAMES = setting_names(TrainConfig)
assert TrainConfig.__mro__[1:len(SECTIONS) + 1] == tuple(reversed(SECTIONS)), "TrainConfig's bases are SECTIONS"
assert sorted(FIELD_NAMES) == sorted(n for s in SECTIONS for n in setting_names(s)), "a setting in two sections"
PATH_SETTINGS = frozenset(f.name for f in dataclasses.fields(TrainConfig)
                          if "Path" in str(f.type) or "DataLocation" in str(f.type))
MAY_CHANGE_ON_RESUME = names_where("may_change_on_resume")

RUN_CONFIG_FILE = "config.json"


def takes(config: TrainConfig, **changes: Any) -> bool:
    """Whether the run could be given these settings (the verdict advises only what a run can take)."""
    try:
        config.replace(**changes)
    except ConfigError:
        return False
    return True


def check_section(section: type[S], values: dict[str, Any], origins: dict[str, str] | None = None) -> S:
    """`section(**values)`, pydantic's report turned into one `ConfigError` naming every bad setting, and the file
    it came from (`origins`: setting -> file, for values read from a TOML file)."""
    unknown = sorted(set(values) - set(setting_names(section)))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; allowed: {', '.join(setting_names(section))}")
    try:
        return section(**values)
    except pydantic.ValidationError as error:
        raise ConfigError(_describe(error, origins or {})) from None


def make_config(values: dict[str, Any], origins: dict[str, str] | None = None) -> TrainConfig:
    """A TrainConfig from flat settings (`check_section`). With `resume`, the resumed run's own settings are the
    defaults: `--resume RUN_DIR` alone continues it."""
    origins = dict(origins or {})
    if values.get("resume") is not None:
        saved = _saved_settings(Path(values["resume"]))
        origins.update({key: str(Path(values["resume"]) / RUN_CONFIG_FILE) for key in saved if key not in values})
        values = {**saved, **values}
    return check_section(TrainConfig, values, origins)


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
    per_run = names_where("per_run")
    return {k: v for k, v in saved.items() if k in FIELD_NAMES and k not in per_run}


def _describe(error: pydantic.ValidationError, origins: dict[str, str]) -> str:
    lines = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"] if not isinstance(part, int)) or "config"
        where = where.split(".")[0]
        value = problem.get("input")
        shown = f"={value!r}" if not isinstance(value, (dict, pydantic.BaseModel)) and where != "config" else ""
        origin = f" (from {origins[where]})" if where in origins else ""
        message = problem["msg"].removeprefix("Value error, ")
        lines.append(message if where == "config" and not origin else f"{where}{shown}{origin}: {message}")
    return "; ".join(dict.fromkeys(lines))


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
    return {key: (str(folder / value) if key in PATH_SETTINGS and isinstance(value, str) and not is_remote(value)
                  else value)
            for key, value in values.items()}

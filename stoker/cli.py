"""The `stoker` command: parse, build, run, close. Every flag of `train` can also come from `--config FILE.toml`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from stoker.common.config import FIELD_NAMES, ConfigError, TrainConfig, load_toml, make_config
from stoker.common.terminal import EscapedArguments

USAGE_ERROR = 2

# The groups of `stoker train --help`, in the order shown.
DATA, RECIPE, DEVICES, AVERAGING, RUN, OUTPUT, EXPERT = (
    "data", "model and recipe", "devices and producers", "averaging", "run folder and checkpoints", "output",
    "expert knobs")
GROUPS = (DATA, RECIPE, DEVICES, AVERAGING, RUN, OUTPUT, EXPERT)

# (flag help, metavar, --help group) for each setting: a new setting is one line here, its group included; the
# defaults and the checks live in stoker.common.config.TrainConfig (--help shows each default from there).
TRAIN_FLAGS: dict[str, tuple[str, str, str]] = {
    "data": ("ImageFolder root (a sub-folder per class) or WebDataset-layout .tar shards (a brace pattern "
             "such as train-{000..127}.tar, a folder of shards, a list file); default: the built-in dataset",
             "DIR|SHARDS", DATA),
    "val": ("validation ImageFolder or shards (default: hold out --val-fraction of --data)", "DIR|SHARDS", DATA),
    "val_fraction": ("share of each class held out for validation when --val is not given", "F", DATA),
    "model": ("resnet8 | resnet14 | resnet20 | resnet18 | resnet50 | module:function", "NAME", RECIPE),
    "image_size": ("training resolution (default 32 on the built-in data, else 224)", "PX", DATA),
    "augment": ("standard (random resized crop + flip) | noflip | none | trivial (standard + TrivialAugment) | "
                "randaug (standard + RandAugment, 2 ops at magnitude 9)", "MODE", RECIPE),
    "devices": ("auto (every visible GPU; without one, one CPU consumer, or two on more than 2 cores) | cpu:N | "
                "cuda | cuda:0,1", "SPEC", DEVICES),
    "producers": ("auto (fork more when consumers wait) or a fixed count", "M", DEVICES),
    "min_producers": ("lower bound for --producers auto", "A", DEVICES),
    "initial_producers": ("where --producers auto starts (default: --min-producers)", "M", DEVICES),
    "max_producers": ("upper bound for --producers auto (default: 8 per core, at most 128, reached only while "
                      "forks pay)", "B", DEVICES),
    "batch_size": ("samples per consumer per step", "B", RECIPE),
    "epochs": ("passes over the training set", "E", RECIPE),
    "optimizer": ("sgd (with --momentum, --weight-decay) | adamw (--weight-decay)", "NAME", RECIPE),
    "lr": ("peak learning rate", "LR", RECIPE),
    "schedule": ("learning rate over the run: cosine (decays to 0 at the last step) | step (x0.1 at 50%% and "
                 "75%% of the steps) | constant", "NAME", RECIPE),
    "momentum": ("SGD momentum (--optimizer sgd)", "MU", RECIPE),
    "weight_decay": ("weight decay: SGD's (added to the gradient) or AdamW's (decoupled)", "WD", RECIPE),
    "sync_every": ("average replicas every H steps", "H", AVERAGING),
    "outer_optimizer": ("none (plain average) | sgd | nesterov: apply the averaged change with --outer-lr, "
                        "--outer-momentum (DiLoCo)", "NAME", AVERAGING),
    "outer_lr": ("outer optimizer learning rate (1 with momentum 0 is the plain average)", "LR", AVERAGING),
    "outer_momentum": ("outer optimizer momentum", "MU", AVERAGING),
    "average_in_backward": ("true | false: start averaging during backward, group by group (same result)", "BOOL",
                            AVERAGING),
    "overlap_averaging": ("true | false: average in the background while the next steps train, one window late "
                          "(replicas identical again at the end)", "BOOL", AVERAGING),
    "seed": ("seed for initialization, sampling and augmentation", "S", RECIPE),
    "out": ("run folder for summary.json, metrics.jsonl and checkpoints (default runs/<time>)", "RUN_DIR", RUN),
    "resume": ("continue from the newest valid checkpoint of this run folder", "RUN_DIR", RUN),
    "checkpoint_every": ("also checkpoint every STEPS steps (0: only at the end of each epoch, as always)", "STEPS",
                         RUN),
    "slots_per_consumer": ("batch slots in shared memory per consumer", "K", EXPERT),
    "check_replicas_every": ("compare replica hashes every K steps (0: at the end only)", "K", EXPERT),
    "collective_timeout_s": ("seconds a consumer waits for its peers before the run fails", "S", EXPERT),
    "producer_timeout_s": ("seconds without progress on one file before a producer counts as hung", "S", EXPERT),
    "max_bad_fraction": ("stop when more than this share of files is unusable", "F", DATA),
    "log_every_s": ("seconds between progress lines when output is not a terminal", "S", OUTPUT),
    "report": ("true | false: draw RUN_DIR/report.png and report.txt at the end", "BOOL", OUTPUT),
    "tensorboard": ("true | false: also write TensorBoard event files to RUN_DIR/tensorboard", "BOOL", OUTPUT),
    "precision": ("fp32 | bf16 | fp16: autocast over fp32 weights (fp16 with a gradient scaler)", "P", DEVICES),
    "channels_last": ("true | false: feed the model channels_last input or plain NCHW", "BOOL", EXPERT),
    "compile": ("true | false: torch.compile the model in each consumer", "BOOL", EXPERT),
    "deterministic": ("true | false: deterministic cuDNN algorithms, no TF32 (bitwise resume on GPUs)", "BOOL", EXPERT),
    "init": ("start from this state_dict (plain or under 'state_dict'/'model'; loaded by name, a head of "
             "another shape re-initialized)", "STATE_DICT", RECIPE),
    "lr_head_multiplier": ("learning rate multiplier of the classifier head (fine-tuning with --init)", "X", RECIPE),
    "warmup_epochs": ("linear warmup of the learning rate over E epochs, per step, then --schedule", "E", RECIPE),
    "label_smoothing": ("label smoothing of the targets (0: off)", "S", RECIPE),
    "mixup": ("mixup with Beta(A, A) mixing weights, on the device (0: off)", "A", RECIPE),
    "cutmix": ("cutmix with Beta(A, A) box areas, on the device (0: off; with --mixup, one of the two per "
               "batch)", "A", RECIPE),
    "ema": ("keep an EMA of the weights with this decay (0: off), validated each epoch and saved as "
            "model_ema.pt", "D", RECIPE),
    "clip_grad_norm": ("clip each replica's gradient norm to N before the replicas are averaged (0: off)", "N",
                       RECIPE),
    "no_decay_norm_bias": ("true | false: no weight decay on norm layers' weights and on biases", "BOOL", RECIPE),
    "random_erasing": ("random erasing probability per sample, on the device (0: off)", "P", RECIPE),
    "val_image_size": ("validation resolution: short side resized, centre crop (default: --image-size; larger "
                       "than training's helps, e.g. train 160, validate 224)", "PX", DATA),
}
assert set(TRAIN_FLAGS) == set(FIELD_NAMES), "every setting needs a flag"
assert all(len(flag) == 3 and flag[2] in GROUPS for flag in TRAIN_FLAGS.values()), \
    f"every flag is (help, metavar, group), the group one of {GROUPS}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stoker", description="Train image classifiers on several devices at "
                                     "once, with producer processes that keep every device busy.")
    parser.add_argument("--version", action="version", version=version_line())
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a model", argument_default=argparse.SUPPRESS)
    train.add_argument("--config", metavar="FILE", help="TOML file with any of the settings below (paths in it are "
                       "relative to its folder)")
    groups = {title: train.add_argument_group(title) for title in GROUPS}
    defaults = setting_defaults()
    for name, (help_text, metavar, group) in TRAIN_FLAGS.items():
        shown = help_text if defaults.get(name) is None else f"{help_text} (default: {defaults[name]})"
        groups[group].add_argument("--" + name.replace("_", "-"), dest=name, metavar=metavar, help=shown)
    groups[OUTPUT].add_argument("--quiet", action="store_true", help="no live panel, no progress or epoch lines")
    groups[OUTPUT].add_argument("--json", action="store_true", help="print summary.json to stdout at the end (the "
                                "short table, the verdict and where the files are go to stderr instead)")
    report = commands.add_parser("report", help="redraw a run's report.png, or compare two runs")
    report.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="one run, or two to compare")
    report.add_argument("--out", type=Path, help="where the PNG goes (default RUN_DIR/report.png, or "
                        "report-compare.png for two runs)")
    from stoker.bench import add_bench_parser
    from stoker.data.pack import add_parser as add_pack_parser
    from stoker.use.model_commands import add_parsers as add_model_parsers
    add_pack_parser(commands)
    add_model_parsers(commands)  # eval, predict
    add_bench_parser(commands)
    return parser


def version_line() -> str:
    """stoker's version with torch's and Python's, read from the installed metadata (importing torch takes 2 s)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"stoker {installed('stoker')} (torch {installed('torch')}, Python {sys.version.split()[0]})"


def setting_defaults() -> dict[str, str | None]:
    """Each setting's default as a flag would spell it (true/false for switches); None where it has none."""
    defaults: dict[str, str | None] = {}
    for setting in dataclasses.fields(TrainConfig):
        value = setting.default
        if isinstance(value, FieldInfo):  # a pydantic Field(default, ...) with its checks
            value = value.default
        defaults[setting.name] = str(value).lower() if isinstance(value, bool) else (
            None if value is None else str(value))
    return defaults


def config_from_args(args: argparse.Namespace) -> Any:
    from_file: dict[str, Any] = load_toml(Path(args.config)) if getattr(args, "config", None) else {}
    flags = {name: getattr(args, name) for name in FIELD_NAMES if hasattr(args, name)}
    return make_config({**from_file, **flags}, {key: str(args.config) for key in from_file if key not in flags})


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    # The report's INFO lines ("Using categorical units ...", "generated new fontManager") are no news to a user;
    # a user's own model or dataset module keeps its INFO lines.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:  # file names in log lines printable (issue 24 item 15)
        handler.addFilter(EscapedArguments())
    args = build_parser().parse_args(argv)
    if args.command in ("bench", "pack", "eval", "predict"):
        return args.run(args)
    if args.command == "report":
        return report_command(args)
    return train_command(args)


def report_command(args: argparse.Namespace) -> int:
    from stoker.observe import report

    if len(args.runs) > 2:
        print("stoker: error: report takes one run folder, or two to compare", file=sys.stderr)
        return 2
    try:
        if len(args.runs) == 1 and args.out is None:
            text = report.write_report(args.runs[0])
            print(f"{text}\nwrote {args.runs[0] / report.REPORT_PNG}")
        else:
            out = args.out or Path("report-compare.png")
            print(f"{report.compare(args.runs, out)}\nwrote {out}")
    except ValueError as error:
        print(f"stoker: error: {error}", file=sys.stderr)
        return 2
    return 0


def train_command(args: argparse.Namespace) -> int:
    from stoker.run.lifecycle import startup_signals
    try:
        with startup_signals():
            config = config_from_args(args)
            from stoker.run.controller import Controller
            controller = Controller(config, show_progress=not getattr(args, "quiet", False))
    except ValueError as error:  # ConfigError and every other user error found before a process starts
        print(f"stoker: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt as interrupt:  # Ctrl-C or SIGTERM while indexing: nothing started, nothing to clean
        print(f"stoker: {getattr(interrupt, 'signal_name', 'Ctrl-C')} before training started: stopped, nothing "
              "was started", file=sys.stderr)
        return 130
    summary = controller.run()
    from stoker.observe.report import ending

    out = sys.stderr if getattr(args, "json", False) else sys.stdout
    width = shutil.get_terminal_size().columns if out.isatty() else None
    print(ending(summary, controller.run_dir, width), file=out)
    if getattr(args, "json", False):
        print(json.dumps(summary, indent=2, default=str))
    return {"completed": 0, "interrupted": 130}.get(summary["status"], 1)


__all__ = ["main", "ConfigError"]

"""The `stoker` command: parse, build, run, close. Every flag of `train` can also come from `--config FILE.toml`."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

from stoker.common import zygote
from stoker.common.config import (
    FIELD_NAMES,
    GROUPS,
    OUTPUT,
    ConfigError,
    TrainConfig,
    about,
    default_of,
    help_group,
    load_toml,
    make_config,
)
from stoker.common.procs import LOG_DATEFMT, LOG_FORMAT
from stoker.common.terminal import EscapedArguments

USAGE_ERROR = 2


class StokerParser(argparse.ArgumentParser):
    """stoker's parsers (each command's too: `add_subparsers` makes them of their parent's class). A flag is
    spelled in full (argparse's abbreviations took `--epoch 3` for `--epochs 3`), and a flag a command does not
    know is reported with that command's usage and the nearest flag it has, not the top level's usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            command = self._command_parser(parsed)
            command.error(f"unrecognized arguments: {' '.join(unknown)}{command.nearest_flag(unknown)}")
        return parsed

    def _command_parser(self, parsed: argparse.Namespace) -> StokerParser:
        """The innermost (sub)command the arguments chose: `stoker bench loader`'s parser for its flags."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(str(getattr(parsed, action.dest, "")))
                if isinstance(chosen, StokerParser):
                    return chosen._command_parser(parsed)
        return self

    def nearest_flag(self, unknown: list[str]) -> str:
        flags = [flag for action in self._actions for flag in action.option_strings if flag.startswith("--")]
        for word in unknown:
            if word.startswith("--"):
                flag = word.split("=", 1)[0]
                close = [f for f in flags if f.startswith(flag)] or difflib.get_close_matches(flag, flags, n=1,
                                                                                             cutoff=0.75)
                if close:
                    return f" (did you mean {' or '.join(close[:3])}?)"
        return ""


def build_parser() -> argparse.ArgumentParser:
    parser = StokerParser(prog="stoker", description="Train image classifiers on several devices at "
                                     "once, with producer processes that keep every device busy.")
    parser.add_argument("--version", action="version", version=version_line())
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a model", argument_default=argparse.SUPPRESS)
    train.add_argument("--config", metavar="FILE", help="TOML file with any of the settings below (paths in it are "
                       "relative to its folder)")
    groups = {title: train.add_argument_group(title) for title in GROUPS}
    defaults = setting_defaults()
    for name in FIELD_NAMES:  # the help, the metavar and the group are declared on each setting's field
        setting = about(TrainConfig, name)
        shown = setting.help if defaults[name] is None else f"{setting.help} (default: {defaults[name]})"
        groups[help_group(name)].add_argument(flag_of(name), dest=name, metavar=setting.metavar, help=shown)
    groups[OUTPUT].add_argument("--quiet", action="store_true", help="no live panel, no progress or epoch lines")
    groups[OUTPUT].add_argument("--json", action="store_true", help="print summary.json to stdout at the end (the "
                                "short table, the verdict and where the files are go to stderr instead)")
    report = commands.add_parser("report", help="redraw a run's report.png, or compare two runs")
    report.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="one run, or two to compare")
    report.add_argument("--out", type=Path, help="where the PNG goes (default RUN_DIR/report.png, or "
                        "report-compare.png for two runs)")
    from stoker.bench import add_bench_parser
    from stoker.data.formats.pack import add_parser as add_pack_parser
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


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def setting_defaults() -> dict[str, str | None]:
    """Each setting's default as a flag would spell it (true/false for switches); None where it has none."""
    defaults: dict[str, str | None] = {}
    for name in FIELD_NAMES:
        value = default_of(name)
        defaults[name] = str(value).lower() if isinstance(value, bool) else (None if value is None else str(value))
    return defaults


def config_from_args(args: argparse.Namespace) -> Any:
    from_file: dict[str, Any] = load_toml(Path(args.config)) if getattr(args, "config", None) else {}
    flags = {name: getattr(args, name) for name in FIELD_NAMES if hasattr(args, name)}
    return make_config({**from_file, **flags}, {key: str(args.config) for key in from_file if key not in flags})


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, datefmt=LOG_DATEFMT)
    # The report's INFO lines ("Using categorical units ...", "generated new fontManager") are no news to a user;
    # a user's own model or dataset module keeps its INFO lines.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:  # file names in log lines printable: a name may hold escape codes
        handler.addFilter(EscapedArguments())
    if argv is None:  # run as a program, not called from a user's script
        zygote.main_is_stokers()
    args = build_parser().parse_args(argv)
    if args.command in ("bench", "pack", "eval", "predict"):
        from stoker.bench.runs import RunFailed
        from stoker.run.lifecycle import startup_signals

        try:
            with startup_signals(keep_ignored=True):
                return int(args.run(args))
        except KeyboardInterrupt as interrupt:  # what the command started is stopped by its own cleanup
            print(f"stoker {args.command}: stopped by {getattr(interrupt, 'signal_name', 'Ctrl-C')}",
                  file=sys.stderr)
            return 130
        except RunFailed as failed:  # a benchmark's training run: its error is in one line, not a traceback
            print(f"stoker {args.command}: {failed}", file=sys.stderr)
            return 1
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

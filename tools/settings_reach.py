"""How far the settings given to `stoker train` travel before they are used, traced in a real run.

    .venv/bin/python tools/settings_reach.py [stoker train's flags]      # default: DEFAULT_FLAGS, the built-in set

Runs `stoker train` with a profile hook in every process it starts (controller, consumers, producers) and records
each hand-off of a setting from one of stoker's files to another:

- a call whose arguments hold settings: a settings object (`TrainConfig` or a section: all its fields), a value
  under a setting's own name and equal to the run's (`producer_timeout_s=20.0`), or either of those in a dataclass's
  fields, two levels down (`EngineSpec.build.producer_timeout_s`), or in a tuple's or a list's items (a process's
  arguments); not a method's own `self`, nor a generator's arguments when it is resumed; a dict is a record;
- a return of a settings object, or of a dataclass, tuple or list holding settings, to the caller (a factory's
  result, `EngineSpec.from_sections`); a number or a string worked out and returned is a use, not a hand-off.

A value is also followed under another name (`hang_timeout_s=21.37137`) when it is one setting's alone and unlikely by
chance: a float neither whole nor a half, or a string of 5 characters or more (a path, a model's name, a choice such
as `cosine`). The default run gives its float settings that are not 0 or 1 (a feature off or on) values no gauge
meets by chance (`--lr 0.0537137`, `--producer-timeout-s 21.37137`, ...), so that a setting taken out of its section
and handed on renamed or by position is still seen; an integer setting is followed by its name only.

From the hand-offs it prints, for the run's settings together:

- relays: the files a setting arrives in and is handed on from (the same setting), the way from the flag to its uses,
  each with the number of settings it hands on so;
- climbs: hand-offs from a lower layer (`tests/unit/test_layout.py`'s order) to a higher one, with their functions;
  imports only go down, so a climb is a lower layer's result handed back to its caller, or a callback;
- reached: every file a setting arrives in, its uses included;
- furthest: the settings handed on from the most files, and those files.

A parameter whose own default equals the run's value counts as a setting handed to it. A call's caller is the nearest
stoker code up the stack (a call through functools or a cached property is the code's that made it); a process's
entry or a thread's start has none, `<outside>`, which is neither a relay nor reached.
"""

import inspect
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from itertools import islice
from pathlib import Path
from types import FrameType
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = f"{ROOT / 'stoker'}/"
# tests/unit/test_layout.py's order, lowest first: run and use are siblings; cli.py and stoker/__init__.py above all
LAYER = {"common": 0, "data": 1, "pipeline": 2, "training": 3, "observe": 4, "run": 5, "use": 5}
RECORDS = "STOKER_SETTINGS_REACH"  # the folder each process appends its records to
# one epoch of the built-in set, its floats given values of 6 significant digits and 5 decimals or more, which no
# gauge of the run (rounded to 4 decimals at most) meets by chance (0.1371 did), its behaviour otherwise the default's
DEFAULT_FLAGS = ["--epochs", "1", "--lr", "0.0537137", "--weight-decay", "0.000471371", "--momentum", "0.891371",
                 "--val-fraction", "0.117137", "--max-bad-fraction", "0.137137", "--producer-timeout-s", "21.37137",
                 "--collective-timeout-s", "61.73137", "--log-every-s", "9.713713", "--outer-lr", "0.731371",
                 "--outer-momentum", "0.913713", "--seed", "4241"]
OUTSIDE = "<outside>"  # a process's entry, a thread, functools: a caller not in stoker's code
OWN = ("self", "cls")  # a method given its own object: the object was handed over when it was passed, not now
CONTAINER_ITEMS = 16  # the items of a tuple or a list looked into: a setup travels in a short one
# a generator's or a coroutine's "call" is its resumption, by whoever asks for its next item, not by its maker
SUSPENDED = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
FURTHEST = 5  # the settings handed on from the most files, shown with their relays
VARIABLE_ARGUMENTS = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS


def _stoker_file(path: str) -> str | None:
    return path[len(PACKAGE):] if path.startswith(PACKAGE) else None


def _settings_in(value: Any, sections: tuple[type, ...], run: "RunValues", depth: int = 2,
                 nesting: int = 2) -> set[str]:
    """The settings `value` holds: a section's fields; those in a dataclass's fields, `depth` levels down; those in
    a tuple's or a list's first CONTAINER_ITEMS items, `nesting` containers deep. A dict is a record (a checkpoint's
    meta, the summary, a metrics line) that names settings to write them down, not a way to their use."""
    if isinstance(value, sections):
        return {each.name for each in fields(cast(Any, value))}
    if isinstance(value, tuple | list):
        if nesting == 0:
            return set()
        return set().union(*(_held("", item, sections, run, depth, nesting - 1)
                             for item in islice(value, CONTAINER_ITEMS)))
    if isinstance(value, type) or depth == 0:
        return set()
    return set().union(*(_held(name, getattr(value, name, None), sections, run, depth - 1, nesting)
                         for name in getattr(type(value), "__dataclass_fields__", ())))


def _held(name: str, value: Any, sections: tuple[type, ...], run: "RunValues", depth: int = 2,
          nesting: int = 2) -> set[str]:
    """The settings `value`, found under `name` (an argument's, a field's; '' in a tuple), is or holds."""
    setting = run.setting_named(name, value)
    return {setting} if setting else _settings_in(value, sections, run, depth, nesting)


def _kind(value: Any) -> str | None:
    if isinstance(value, bool):
        return "bool"
    return "number" if isinstance(value, int | float) else "str" if isinstance(value, str | os.PathLike) else None


def _loose_setting(name: str, value: Any, values: dict[str, Any]) -> bool:
    """Whether `value`, under the setting's own name, is the run's value of it (a path or a choice as a string)."""
    expected = values.get(name)
    return expected is not None and _kind(expected) is not None and _same(value, expected)


def _same(value: Any, expected: Any) -> bool:
    if _kind(value) == "str":
        return os.fspath(value) == str(expected)
    return _kind(value) == _kind(expected) and value == expected


def _telling(value: Any) -> bool:
    """Whether a value is unlikely to be met by chance: a float neither whole nor a half, or a string of 5 characters
    or more (not `auto` or `none`). An integer never is: a step counter passes through every one of them."""
    if _kind(value) == "number":
        return not float(value).is_integer() and value != 0.5
    return _kind(value) == "str" and len(str(value)) >= 5


@dataclass(frozen=True)
class RunValues:
    """The run's settings as config.json records them, and those of them telling enough to follow under any name."""

    values: dict[str, Any]
    distinct: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        telling = {name: value for name, value in self.values.items() if _telling(value)}
        shared = {name for name, value in telling.items()
                  if sum(_same(value, other) for other in self.values.values() if _kind(other)) > 1}
        object.__setattr__(self, "distinct", {name: telling[name] for name in telling.keys() - shared})

    def setting_named(self, name: str, value: Any) -> str | None:
        """The setting `value` is: the one `name` names, at the run's value, or the one whose telling value it is."""
        if _loose_setting(name, value, self.values):
            return name
        if _kind(value) is None:
            return None
        return next((setting for setting, expected in self.distinct.items() if _same(value, expected)), None)


def _arguments(frame: FrameType) -> list[tuple[str, Any]]:
    """(name, value) of each argument of the call, those in *args and **kwargs included."""
    code, local = frame.f_code, frame.f_locals
    named = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    found = [(name, local.get(name)) for name in named]
    rest = code.co_varnames[len(named):len(named) + bin(code.co_flags & VARIABLE_ARGUMENTS).count("1")]
    for name in rest:
        value = local.get(name)
        if isinstance(value, tuple):
            found += [(name, item) for item in value]
        elif isinstance(value, dict):
            found += list(value.items())
    return found


def _nearest_stoker_file(frame: FrameType | None) -> str:
    """The stoker file of the nearest frame up the stack: a call through functools or a cached property is the
    stoker code's that made it; a process's entry or a thread's start has none."""
    while frame is not None:
        if (path := _stoker_file(frame.f_code.co_filename)) is not None:
            return path
        frame = frame.f_back
    return OUTSIDE


def _make_hook(folder: str, run: RunValues) -> Callable[[FrameType, str, Any], None]:
    recorded: dict[tuple[str, str, str, str], set[str]] = {}

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        here = _stoker_file(frame.f_code.co_filename) if event in ("call", "return") else None
        if here is None or here == "common/config.py":  # where the settings come from, not a hand-off
            return
        caller = _nearest_stoker_file(frame.f_back)
        sender, receiver = (caller, here) if event == "call" else (here, caller)
        config = sys.modules.get("stoker.common.config")  # a producer never imports it: its values still count
        sections = getattr(config, "SECTIONS", ())
        if event == "call":
            if frame.f_code.co_flags & SUSPENDED:  # resumed: its arguments were handed over when it was made
                return
            held = set().union(*(_held(name, value, sections, run) for name, value in _arguments(frame)
                                 if name not in OWN))
        else:  # a number or a string worked out and returned is a use; an object holding settings is handed back
            held = _settings_in(arg, sections, run)
        known = recorded.setdefault((sender, receiver, frame.f_code.co_qualname, event), set())
        if held - known:
            known |= held
            with open(os.path.join(folder, f"{os.getpid()}.tsv"), "a") as out:
                out.write(f"{sender}\t{receiver}\t{frame.f_code.co_qualname}\t{event}\t{','.join(sorted(held))}\n")

    return hook


def install() -> None:
    """The profile hook, in a process started with RECORDS set (from the sitecustomize this tool writes)."""
    import threading

    folder = os.environ.get(RECORDS)
    if folder:
        hook = _make_hook(folder, RunValues(json.loads(Path(folder, "values.json").read_text())))
        sys.setprofile(hook)
        threading.setprofile(hook)


def _layer(path: str) -> int:
    return LAYER.get(path.split("/")[0], max(LAYER.values()) + 1)


def report(rows: list[list[str]]) -> dict[str, list[str]]:
    """From the hand-offs recorded (sender's file, receiver's file, function, call or return, settings): the relays
    (each with how many settings it hands on), the climbs (each with its functions), the files reached, and the
    settings handed on from the most files."""
    hand_offs = [(sender, receiver, function, set(settings.split(",")))
                 for sender, receiver, function, _, settings in rows if sender != receiver and receiver != OUTSIDE]
    relays_of: dict[str, set[str]] = {}
    for setting in set().union(*(held for *_, held in hand_offs)):
        arrived = {receiver for _, receiver, _, held in hand_offs if setting in held}
        relays_of[setting] = arrived & {sender for sender, _, _, held in hand_offs if setting in held}
    relayed = Counter(path for files in relays_of.values() for path in files)
    climbs: dict[str, set[str]] = {}
    for sender, receiver, function, _ in hand_offs:
        if sender != OUTSIDE and _layer(receiver) > _layer(sender):
            climbs.setdefault(f"{sender} -> {receiver}", set()).add(function)
    furthest = sorted(((setting, files) for setting, files in relays_of.items() if files),
                      key=lambda item: (-len(item[1]), item[0]))[:FURTHEST]
    return {"relays": [f"{path} ({count})" for path, count in sorted(relayed.items())],
            "climbs": [f"{edge}: {', '.join(sorted(functions))}" for edge, functions in sorted(climbs.items())],
            "reached": sorted({receiver for _, receiver, _, _ in hand_offs}),
            "furthest": [f"{setting} ({len(files)}): {', '.join(sorted(files))}" for setting, files in furthest]}


def _run_values(argv: list[str]) -> dict[str, Any]:
    """The settings `stoker train` takes from `argv`, as the run's config.json records them."""
    sys.path.insert(0, str(ROOT))  # this checkout's stoker; here only, not in every traced process
    from stoker import cli

    return cli.config_from_args(cli.build_parser().parse_args(argv)).as_json()


def main(flags: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="settings-reach-") as scratch:
        hook = f"import sys\nsys.path.insert(0, {str(ROOT / 'tools')!r})\nimport settings_reach\n"
        Path(scratch, "sitecustomize.py").write_text(hook + "settings_reach.install()\n")
        flags = flags or DEFAULT_FLAGS
        run = [sys.executable, "-m", "stoker", "train", *flags, "--quiet", "--out", f"{scratch}/run"]
        Path(scratch, "values.json").write_text(json.dumps(_run_values(run[3:])))
        env = {**os.environ, RECORDS: scratch, "PYTHONPATH": os.pathsep.join([scratch, str(ROOT)])}
        subprocess.run(run, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        rows = [line.split("\t") for path in Path(scratch).glob("*.tsv") for line in path.read_text().splitlines()]
    found = report(rows)
    for name, files in found.items():
        print(f"{name}: {len(files)}")
        print("".join(f"  {f}\n" for f in files), end="")


if __name__ == "__main__":
    main(sys.argv[1:])

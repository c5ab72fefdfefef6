"""How far the settings given to `stoker train` travel before they are used, traced in a real run.

    .venv/bin/python tools/settings_reach.py [stoker train's flags]      # default: --epochs 1 on the built-in set

Runs `stoker train` with a profile hook in every process it starts (controller, consumers, producers). A call into
stoker's code is recorded when one of its arguments holds a setting: a settings object (`TrainConfig` or a section),
a value under a setting's own name and equal to the run's (`producer_timeout_s=20.0`), or either of those in a
dataclass's fields, two levels down (`EngineSpec.build.producer_timeout_s`). From the calls (caller's file ->
callee's file) it prints:

- relays: the files a setting arrives in and is handed on from, the way from the flag to its uses;
- climbs: hand-offs from a lower layer (`tests/unit/test_layout.py`'s order) to a higher one;
- reached: every file a setting arrives in, its uses included.

A renamed value is not followed (the name is the thread); a parameter whose own default equals the run's value counts
as a setting handed to it; a call from outside stoker's code (a process's entry, a thread, functools) has the caller
`<outside>`.
"""

import inspect
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = f"{ROOT / 'stoker'}/"
# tests/unit/test_layout.py's order, lowest first: run and use are siblings; cli.py and stoker/__init__.py above all
LAYER = {"common": 0, "data": 1, "pipeline": 2, "training": 3, "observe": 4, "run": 5, "use": 5}
RECORDS = "STOKER_SETTINGS_REACH"  # the folder each process appends its records to
VARIABLE_ARGUMENTS = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS


def _stoker_file(path: str) -> str | None:
    return path[len(PACKAGE):] if path.startswith(PACKAGE) else None


def _setting_in(value: Any, sections: tuple[type, ...], values: dict[str, Any], depth: int = 2) -> str | None:
    """What of `value` is a setting: itself (a section), or a field of it (a dataclass), `depth` levels down."""
    if isinstance(value, sections):
        return type(value).__name__
    if isinstance(value, type) or depth == 0:
        return None
    for name in getattr(type(value), "__dataclass_fields__", ()):
        inner = getattr(value, name, None)
        held = "" if _loose_setting(name, inner, values) else _setting_in(inner, sections, values, depth - 1)
        if held is not None:
            return f"{type(value).__name__}.{name}{'.' + held if held else ''}"
    return None


def _kind(value: Any) -> str | None:
    if isinstance(value, bool):
        return "bool"
    return "number" if isinstance(value, int | float) else "str" if isinstance(value, str | os.PathLike) else None


def _loose_setting(name: str, value: Any, values: dict[str, Any]) -> bool:
    """Whether `value`, under the setting's own name, is the run's value of it (a path or a choice as a string)."""
    expected = values.get(name)
    if expected is None or _kind(expected) is None:
        return False
    if _kind(value) == "str":
        return os.fspath(value) == str(expected)
    return _kind(value) == _kind(expected) and value == expected


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


def _make_hook(folder: str, values: dict[str, Any]) -> Callable[[FrameType, str, Any], None]:
    seen: set[tuple[str, str, str]] = set()

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        callee = _stoker_file(frame.f_code.co_filename) if event == "call" else None
        if callee is None or callee == "common/config.py":
            return
        back = frame.f_back
        caller = (_stoker_file(back.f_code.co_filename) if back else None) or "<outside>"
        key = (caller, callee, frame.f_code.co_qualname)
        if key in seen:
            return
        config = sys.modules.get("stoker.common.config")  # a producer never imports it: its values still count
        sections = getattr(config, "SECTIONS", ())
        for name, value in _arguments(frame):
            held = _setting_in(value, sections, values)
            if held or _loose_setting(name, value, values):
                seen.add(key)
                with open(os.path.join(folder, f"{os.getpid()}.tsv"), "a") as out:
                    out.write(f"{caller}\t{callee}\t{frame.f_code.co_qualname}\t{name}\t{held or 'loose'}\n")
                return

    return hook


def install() -> None:
    """The profile hook, in a process started with RECORDS set (from the sitecustomize this tool writes)."""
    import threading

    folder = os.environ.get(RECORDS)
    if folder:
        hook = _make_hook(folder, json.loads(Path(folder, "values.json").read_text()))
        sys.setprofile(hook)
        threading.setprofile(hook)


def _layer(path: str) -> int:
    return LAYER.get(path.split("/")[0], max(LAYER.values()) + 1)


def report(rows: list[list[str]]) -> dict[str, Any]:
    edges = {(caller, callee) for caller, callee, *_ in rows if caller != callee}
    received = {callee for _, callee in edges}
    handed_on = {caller for caller, _ in edges if caller != "<outside>"}
    return {"relays": sorted(received & handed_on),
            "climbs": sorted(f"{a} -> {b}" for a, b in edges if a != "<outside>" and _layer(b) > _layer(a)),
            "reached": sorted(received)}


def _run_values(argv: list[str]) -> dict[str, Any]:
    """The settings `stoker train` takes from `argv`, as the run's config.json records them."""
    sys.path.insert(0, str(ROOT))  # this checkout's stoker; here only, not in every traced process
    from stoker import cli

    return cli.config_from_args(cli.build_parser().parse_args(argv)).as_json()


def main(flags: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="settings-reach-") as scratch:
        hook = f"import sys\nsys.path.insert(0, {str(ROOT / 'tools')!r})\nimport settings_reach\n"
        Path(scratch, "sitecustomize.py").write_text(hook + "settings_reach.install()\n")
        flags = flags or ["--epochs", "1"]
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

"""Where a `module:function` model's code lives, and its SHA-256, found without running it.

A model file names its model as `--model` took it. For `module:function`, importing the module runs whatever
file the import path finds first (the working directory comes first, as in training): a folder holding a
model.pt and a helper.py of the same name would run that helper on `stoker.load`. So the module is located with
`importlib` finders (which read directory entries, never code), its files are hashed, and the import runs those very
bytes, only when their hash equals the one recorded at training time (or when the user, naming the module, accepts
it as it is now). Training and loading use the same function.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class ModuleNotVerified(ValueError):
    """The module was found, but its files are not the ones training recorded (or none were recorded)."""


@dataclass(frozen=True)
class Level:
    """One name of a dotted module path: `pkg`, then `pkg.net`."""

    name: str
    file: Path | None  # None: a namespace package (a folder, no code)
    data: bytes  # the bytes hashed, which import_verified runs
    is_package: bool


@dataclass(frozen=True)
class ModuleSource:
    levels: tuple[Level, ...]
    sha256: str

    @property
    def files(self) -> tuple[Path, ...]:  # what importing the module executes: each __init__.py, then the module
        return tuple(level.file for level in self.levels if level.file is not None)

    @property
    def file(self) -> Path:
        return self.files[-1]


def put_working_directory_on_path() -> None:
    """`--model module:function` is imported from the working directory (then PYTHONPATH), as the README says."""
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))


def locate_module(module_name: str) -> ModuleSource:
    """The files importing `module_name` would execute, located without executing any of them; ValueError when
    a level is not a plain source or extension file found on the import path."""
    put_working_directory_on_path()
    levels: list[Level] = []
    parts = module_name.split(".")
    search: list[str] | None = None
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        # PathFinder (not importlib.util.find_spec) for dotted names: find_spec imports the parent package
        spec = importlib.util.find_spec(name) if depth == 1 else \
            importlib.machinery.PathFinder.find_spec(name, search)
        if spec is None:
            raise ValueError(f"module {module_name!r}: {name!r} is not found on the import path")
        is_package = spec.submodule_search_locations is not None
        if spec.has_location and spec.origin:
            path = Path(spec.origin).resolve()
            levels.append(Level(name, path, path.read_bytes(), is_package))
        elif depth == len(parts) or not is_package:
            raise ValueError(f"module {module_name!r}: {name!r} is not a file on the import path "
                             f"(origin {spec.origin!r})")
        else:
            levels.append(Level(name, None, b"", True))
        search = list(spec.submodule_search_locations or [])
    return ModuleSource(tuple(levels), contents_sha256([level.data for level in levels if level.file]))


def contents_sha256(contents: list[bytes]) -> str:
    """SHA-256 of the file's bytes for one file (what `sha256sum` prints); of the files' digests in import
    order for a package's module (so that no bytes can move from one file to the next unseen)."""
    if len(contents) == 1:
        return hashlib.sha256(contents[0]).hexdigest()
    combined = hashlib.sha256()
    for data in contents:
        combined.update(hashlib.sha256(data).digest())
    return combined.hexdigest()


def import_verified(source: ModuleSource) -> None:
    """Import the module by running exactly the source bytes that were hashed: the import system would run a
    __pycache__ .pyc instead while the source's mtime and size match the ones it records, and a planted .pyc
    can match them. An extension module (.so) is imported as usual (it has no cache)."""
    for level in source.levels:
        if level.name in sys.modules:
            continue
        if level.file is None or level.file.suffix != ".py":
            importlib.import_module(level.name)
            continue
        _run_as_module(level)


def _run_as_module(level: Level) -> None:
    assert level.file is not None
    locations = [str(level.file.parent)] if level.is_package else None
    spec = importlib.util.spec_from_file_location(level.name, level.file, submodule_search_locations=locations)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[level.name] = module
    try:
        exec(compile(level.data, str(level.file), "exec"), module.__dict__)  # noqa: S102 (the bytes just verified)
    except BaseException:
        del sys.modules[level.name]
        raise
    parent, _, child = level.name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


def check_recorded_module(model: str, recorded_sha256: str | None, model_file: Path,
                          accept_changed: bool = False) -> ModuleSource:
    """Before importing the module a model file names: its files hash to what training recorded, or a
    ValueError naming the module's file and what to do instead (the caller prefixes the model file).
    `accept_changed`: the user, who named this module, takes it as it is now (a comment edited since training):
    a warning says what differs, and the weights must still fit what it builds."""
    module_name = model.split(":", 1)[0]
    advice = (f"if you trust that code as it is now, pass --accept-changed-module (stoker eval/predict) or "
              f"accept_changed_module=True (stoker.load), or rebuild the model yourself: "
              f"stoker.load({str(model_file)!r}, model=your_function) (called as your_function(num_classes=K))")
    try:
        source = locate_module(module_name)
    except (ValueError, ImportError, OSError) as error:
        raise ValueError(f"{error} (so it cannot be checked before it is imported); {advice}") from None
    if accept_changed and source.sha256 != recorded_sha256:
        log.warning("module %r: importing %s (SHA-256 %s...), which is not the file %s was trained with "
                    "(recorded %s...): you named it and accepted the change", module_name, source.file,
                    source.sha256[:12], model_file, (recorded_sha256 or "none")[:12])
        return source
    if recorded_sha256 is None:
        raise ModuleNotVerified(f"its card records no SHA-256 of module {module_name!r}, so "
                         f"{source.file} is not imported (a model file must not choose what code runs); {advice}")
    if source.sha256 != recorded_sha256:
        raise ModuleNotVerified(f"module {module_name!r} would load {source.file}, which differs from "
                         f"the file the model was trained with (SHA-256 {source.sha256[:12]}... vs recorded "
                         f"{recorded_sha256[:12]}...); it is not imported; {advice}")
    return source

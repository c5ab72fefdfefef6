"""Where a `module:function` model's code lives, and its SHA-256, found without running it.

A model file names its model as `--model` took it. For `module:function`, importing the module runs whatever
file the import path finds first (the working directory comes first, as in training): a folder holding a
model.pt and a helper.py of the same name would run that helper on `stoker.load`. So the module is located with
`importlib` finders (which read directory entries, never code), its files are hashed, and the import happens
only when the hash equals the one recorded at training time. Training and loading use the same function.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModuleSource:
    files: tuple[Path, ...]  # what importing the module executes: each package's __init__.py, then the module
    sha256: str

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
    files: list[Path] = []
    parts = module_name.split(".")
    search: list[str] | None = None
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        # PathFinder (not importlib.util.find_spec) for dotted names: find_spec imports the parent package
        spec = importlib.util.find_spec(name) if depth == 1 else \
            importlib.machinery.PathFinder.find_spec(name, search)
        if spec is None:
            raise ValueError(f"module {module_name!r}: {name!r} is not found on the import path")
        if spec.has_location and spec.origin:
            files.append(Path(spec.origin).resolve())
        elif depth == len(parts) or spec.submodule_search_locations is None:
            raise ValueError(f"module {module_name!r}: {name!r} is not a file on the import path "
                             f"(origin {spec.origin!r})")
        search = list(spec.submodule_search_locations or [])
    return ModuleSource(tuple(files), files_sha256(files))


def files_sha256(files: list[Path]) -> str:
    """SHA-256 of the file's bytes for one file (what `sha256sum` prints); of the files' digests in import
    order for a package's module (so that no bytes can move from one file to the next unseen)."""
    if len(files) == 1:
        return hashlib.sha256(files[0].read_bytes()).hexdigest()
    combined = hashlib.sha256()
    for path in files:
        combined.update(hashlib.sha256(path.read_bytes()).digest())
    return combined.hexdigest()


def check_recorded_module(model: str, recorded_sha256: str | None, model_file: Path) -> None:
    """Before importing the module a model file names: its files hash to what training recorded, or a
    ValueError naming the module's file and what to do instead (the caller prefixes the model file)."""
    module_name = model.split(":", 1)[0]
    advice = (f"if you trust that code, rebuild the model yourself: stoker.load({str(model_file)!r}, "
              f"model=your_function) (it is called as your_function(num_classes=K))")
    try:
        source = locate_module(module_name)
    except (ValueError, ImportError, OSError) as error:
        raise ValueError(f"{error} (so it cannot be checked before it is imported); {advice}") from None
    if recorded_sha256 is None:
        raise ValueError(f"its card records no SHA-256 of module {module_name!r}, so "
                         f"{source.file} is not imported (a model file must not choose what code runs); {advice}")
    if source.sha256 != recorded_sha256:
        raise ValueError(f"module {module_name!r} would load {source.file}, which differs from "
                         f"the file the model was trained with (SHA-256 {source.sha256[:12]}... vs recorded "
                         f"{recorded_sha256[:12]}...); it is not imported; {advice}")

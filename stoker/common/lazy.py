"""A module imported the first time one of its names is used.

obstore and pycurl are needed only where a remote source is read; a machine that trains on local files (a GPU
image built for that) may not have them, and must still import and run every local path."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    def __init__(self, name: str, needed_for: str) -> None:
        self._name = name
        self._needed_for = needed_for
        self._module: ModuleType | None = None

    def __getattr__(self, attribute: str) -> Any:  # only names the instance lacks: the module's
        if self._module is None:
            try:
                self._module = importlib.import_module(self._name)
            except ImportError as error:
                raise ImportError(f"{self._needed_for} needs the Python package {self._name.split('.')[0]!r}, "
                                  f"which does not import here ({error}): pip install stoker's dependencies "
                                  f"(pip install -e .)") from error
        return getattr(self._module, attribute)

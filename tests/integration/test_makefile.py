"""`make` on a machine whose interpreter already has torch (a GPU image, often offline): .venv uses that torch and
installs only stoker's other dependencies, from nothing but what is there (PIP_NO_INDEX)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_uses_the_torch_the_interpreter_already_has_offline(tmp_path):
    venv, wheels = tmp_path / "venv", tmp_path / "wheels"
    wheels.mkdir()
    environment = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}
    result = subprocess.run(["make", "install", f"PYTHON={sys.executable}", f"VENV={venv}"], cwd=ROOT,
                            env=environment, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    probe = "import torch, stoker.cli; print(torch.__file__)"
    used = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert Path(used) == Path(torch.__file__)  # the interpreter's own torch, not a second copy
    assert not list(venv.glob("lib/python*/site-packages/torch"))

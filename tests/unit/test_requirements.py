"""What the project requires of its environment, where a requirement is a security boundary."""

from __future__ import annotations

import re
import tomllib

import torch
from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import ROOT

# Below 2.6, torch.load(weights_only=True) can be made to run code (CVE-2025-32434, fixed in 2.6.0); every
# checkpoint stoker loads relies on it.
SAFE_TORCH = Version("2.6.0")


def _requirement(name: str) -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    [found] = [Requirement(line) for line in project["dependencies"] if Requirement(line).name == name]
    return found


def test_torch_whose_weights_only_can_be_bypassed_is_not_accepted():
    requirement = _requirement("torch")
    assert not requirement.specifier.contains("2.5.1")
    assert requirement.specifier.contains(str(SAFE_TORCH))


def test_the_makefile_installs_no_older_torch_than_the_project_requires():
    pins = re.findall(r'torch(?:>=|==)([0-9.]+)', (ROOT / "Makefile").read_text())
    assert pins and all(Version(pin) >= SAFE_TORCH for pin in pins)


def test_the_installed_torch_meets_it():
    assert Version(torch.__version__.split("+")[0]) >= SAFE_TORCH

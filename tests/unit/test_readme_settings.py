"""The README's settings table is the settings: one row per `stoker train` flag, each default as the field has it,
and every figure the README keeps links to docs/benchmarks.md."""

from __future__ import annotations

import re
from pathlib import Path

from stoker.cli import setting_defaults
from stoker.common.config import FIELD_NAMES

README = Path(__file__).parents[2] / "README.md"
ROW = re.compile(r"^\| `(--[a-z-]+)` \| ([^|]*) \|", re.MULTILINE)
COMMAND_FLAGS = {"--config", "--quiet", "--json"}  # the command's own, not settings


def _rows() -> dict[str, str]:
    rows: dict[str, str] = {}
    for flag, default in ROW.findall(README.read_text()):
        assert flag not in rows, f"{flag} has two rows"
        rows[flag] = default.strip()
    return rows


def test_every_setting_has_one_row_and_nothing_else_does():
    flags = {"--" + name.replace("_", "-") for name in FIELD_NAMES}
    assert set(_rows()) - COMMAND_FLAGS == flags


def test_each_default_in_the_table_is_the_fields():
    rows = _rows()
    for name, default in setting_defaults().items():
        if default is not None:  # no default: the row says in words what happens
            assert rows["--" + name.replace("_", "-")] == f"`{default}`", name


def test_the_readme_is_at_most_550_lines():
    assert len(README.read_text().splitlines()) <= 550

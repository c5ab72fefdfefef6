"""`stoker train --help`: the flags in their groups, in the order declared, each with its default as TrainConfig
has it."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from stoker.cli import main
from stoker.common.config import FIELD_NAMES, GROUPS, TrainConfig, help_group


@pytest.fixture(scope="module")
def help_text() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["train", "--help"])
    return out.getvalue()


def _sections(text: str) -> dict[str, str]:
    """Title -> body of each argparse group (a title is an unindented line ending in ':')."""
    parts = re.split(r"^(\S[^\n]*):\n", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_the_groups_come_in_order_and_hold_their_flags(help_text):
    sections = _sections(help_text)
    assert [title for title in sections if title in GROUPS] == list(GROUPS)
    for name in FIELD_NAMES:
        group = help_group(name)
        assert re.search(rf"^  --{name.replace('_', '-')}\b", sections[group], re.MULTILINE), (name, group)
    assert "--quiet" in sections["output"] and "--json" in sections["output"]


def test_every_default_shown_is_the_configs(help_text):
    flat = " ".join(help_text.split())  # argparse wraps lines, and may break a word at a hyphen
    defaults = TrainConfig()
    for name in ("val_fraction", "augment", "model", "batch_size", "epochs", "lr", "weight_decay", "devices",
                 "sync_every", "slots_per_consumer", "collective_timeout_s", "precision"):
        value = getattr(defaults, name)
        assert f"(default: {value})" in flat, name
    for name in ("report", "channels_last", "compile", "tensorboard"):
        assert f"(default: {str(getattr(defaults, name)).lower()})" in flat, name


def test_weight_decay_is_not_described_as_sgd_only(help_text):
    flat = " ".join(help_text.split())
    assert "SGD weight decay" not in flat and "AdamW" in flat.rsplit("--weight-decay WD", 1)[1][:120]


def test_version_is_the_projects_with_torchs():
    import importlib.metadata
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert out.getvalue().startswith(f"stoker {project['version']} (torch {importlib.metadata.version('torch')}")

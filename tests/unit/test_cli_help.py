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


def _usage_error(capsys, *argv: str) -> list[str]:
    with pytest.raises(SystemExit) as stopped:
        main(list(argv))
    assert stopped.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("argv,usage,message", [
    (["train", "--epoch", "3"], "usage: stoker train",
     "stoker train: error: unrecognized arguments: --epoch 3 (did you mean --epochs?)"),
    (["train", "--image-sise", "64"], "usage: stoker train",
     "stoker train: error: unrecognized arguments: --image-sise 64 (did you mean --image-size?)"),
    (["train", "--zzz"], "usage: stoker train", "stoker train: error: unrecognized arguments: --zzz"),
    (["bench", "loader", "--step", "3"], "usage: stoker bench loader",
     "stoker bench loader: error: unrecognized arguments: --step 3 (did you mean --steps?)"),
    (["eval", "m.pt", "--data", "d", "--batch", "8"], "usage: stoker eval",
     "stoker eval: error: unrecognized arguments: --batch 8 (did you mean --batch-size?)"),
])
def test_a_flag_is_spelled_in_full_and_an_unknown_one_is_the_commands_error(capsys, argv, usage, message):
    """argparse's abbreviations took `--epoch 3` for `--epochs 3`; an unknown flag printed the top level's usage."""
    lines = _usage_error(capsys, *argv)
    assert lines[0].startswith(usage) and lines[-1] == message


def test_the_train_api_takes_quiet_as_the_cli_does(monkeypatch):
    import stoker
    import stoker.run.controller as controller

    seen: list[bool] = []

    class Recording:
        def __init__(self, config, show_progress):
            seen.append(show_progress)

        def run(self):
            return {}

    monkeypatch.setattr(controller, "Controller", Recording)
    stoker.train(quiet=True, epochs=1)
    stoker.train(epochs=1)
    assert seen == [False, True]


def test_no_pydantic_wording_reaches_a_message():
    from stoker.common.config import ConfigError, make_config

    for values in ({"min_producers": 5, "max_producers": 2}, {"epochs": 1, "warmup_epochs": 3},
                   {"producers": "many"}, {"batch_size": "x"}, {"lr": "fast"}):
        with pytest.raises(ConfigError) as refused:
            make_config(values)
        assert "Value error" not in str(refused.value) and not str(refused.value).startswith("config")

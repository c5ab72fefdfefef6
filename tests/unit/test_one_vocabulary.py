"""A setting means and checks the same everywhere: the same bad value given to `stoker train`, `stoker.Loader`,
`stoker eval` and `stoker predict` is refused with the same message, before anything starts; and every name the
settings' properties are read from is a field."""

from __future__ import annotations

import pytest

import stoker
from stoker.cli import main
from stoker.common import config
from stoker.common.config import FIELD_NAMES, SECTIONS, TrainConfig, about, make_config, setting_names


def _cli_error(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stoker: error: "), lines
    return lines[0].removeprefix("stoker: error: ")


@pytest.mark.parametrize("setting,value,expected", [
    ("producers", "0", "producers='0': expected 'auto' or a number of producer processes from 1 to"),
    ("producers", "lots", "producers='lots': "),
    ("batch_size", "0", "batch_size='0': Input should be greater than or equal to 1"),
    ("batch_size", "1.5", "batch_size='1.5': "),
])
def test_the_same_bad_value_gets_the_same_message_from_train_loader_eval_and_predict(
        tmp_path, capsys, textures, setting, value, expected):
    flag = "--" + setting.replace("_", "-")
    absent = str(tmp_path / "absent.pt")  # never opened: the settings are refused first
    messages = {
        "train": _cli_error(capsys, "train", "--data", str(textures[0]), flag, value),
        "eval": _cli_error(capsys, "eval", absent, "--data", str(textures[0]), flag, value),
        "predict": _cli_error(capsys, "predict", absent, str(textures[0]), flag, value),
    }
    loader_settings = {"batch_size": 8, setting: value}  # the same string a flag gives
    with pytest.raises(ValueError) as refused:
        stoker.Loader(textures[0], **loader_settings)
    train_api = pytest.raises(ValueError, make_config, {setting: value}).value
    messages |= {"Loader": str(refused.value), "stoker.train's config": str(train_api)}
    assert all(message.startswith(expected) for message in messages.values()), messages
    assert len({message for message in messages.values()}) == 1, messages


def test_every_setting_is_declared_once_with_its_properties():
    assert sorted(FIELD_NAMES) == sorted(name for section in SECTIONS for name in setting_names(section))
    for name in FIELD_NAMES:
        setting = about(TrainConfig, name)
        assert setting.help and setting.metavar, name
        assert setting.group is None or setting.group in config.GROUPS, name


def test_no_module_keeps_a_hand_written_list_of_setting_names():
    """The properties are read off the fields: a list of names elsewhere would drift from them."""
    import ast
    from pathlib import Path

    names = set(FIELD_NAMES)
    lists = []
    package = Path(stoker.__file__).parent
    for module in package.rglob("*.py"):
        if module.is_relative_to(package / "bench"):  # a benchmark's own flags, of which some share a name
            continue
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, (ast.Set, ast.List, ast.Tuple)):
                strings = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                if len(strings & names) >= 4:
                    lists.append(f"{module.name}:{node.lineno}")
    assert lists == []

"""--init: a state_dict saved by another process with another key prefix and another head; files that are not
state_dicts; a tampered file; missing keys."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from stoker.training.init import InitError, apply_init, plan_init
from stoker.training.models import build_model

SAVE_ELSEWHERE = textwrap.dedent("""
    import sys, torch
    from stoker.training.models import build_model
    torch.manual_seed(1)
    model = build_model("resnet8", 7)  # another head: 7 classes
    state = {"module." + k: v for k, v in model.state_dict().items()}  # as DDP saves it
    torch.save({"state_dict": state, "epoch": 3}, sys.argv[1])
""")


def _saved_elsewhere(path: Path) -> Path:
    subprocess.run([sys.executable, "-c", SAVE_ELSEWHERE, str(path)], check=True, timeout=120)
    return path


def test_other_prefix_and_head_load_by_name(tmp_path: Path) -> None:
    path = _saved_elsewhere(tmp_path / "pretrained.pt")
    source = torch.load(path, weights_only=True)["state_dict"]
    model = build_model("resnet8", 10)
    own_head = model.head.weight.clone()
    plan = plan_init(path, model)
    assert plan.prefix == "module."
    assert plan.reinitialized == ("head.bias", "head.weight")
    apply_init(plan, model)
    for key, value in model.state_dict().items():
        if key.startswith("head."):
            continue
        assert torch.equal(value, source["module." + key]), key
    assert torch.equal(model.head.weight, own_head)  # kept at the model's own initialization


def test_not_a_state_dict(tmp_path: Path) -> None:
    path = tmp_path / "list.pt"
    torch.save([torch.zeros(3)], path)
    with pytest.raises(InitError, match="expected a state_dict"):
        plan_init(path, build_model("resnet8", 10))
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint at all")
    with pytest.raises(InitError, match="not a state_dict file \\(not the zip archive torch.save writes"):
        plan_init(text, build_model("resnet8", 10))


@pytest.mark.parametrize("content", ["hello\n", "abc"])  # torch's legacy reader: KeyError 101, IndexError
def test_a_file_that_is_not_an_archive_is_one_line_naming_it_and_exit_2(textures, tmp_path, capsys, content):
    from stoker.cli import main

    train, val = textures
    path = tmp_path / "t.txt"
    path.write_text(content)
    code = main(["train", "--data", str(train), "--val", str(val), "--init", str(path), "--devices", "cpu:1",
                 "--out", str(tmp_path / "run")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("stoker: error: ") and f"init={str(path)!r}: not a state_dict file" in lines[0]


def test_tampered_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save(build_model("resnet8", 10).state_dict(), path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = b"\x00" * 64
    path.write_bytes(bytes(data))
    with pytest.raises(InitError, match=str(path.name)):
        plan_init(path, build_model("resnet8", 10))


def test_pickle_with_code_is_refused(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    path = tmp_path / "evil.pt"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "x": Evil()}, path)
    with pytest.raises(InitError, match="not a state_dict torch can load safely") as refused:
        plan_init(path, build_model("resnet8", 10))
    # The message names what the file asked for, not torch's first line on how to load it unsafely.
    assert "GLOBAL print" in str(refused.value) and "weights_only` set to `False" not in str(refused.value)


def test_missing_unexpected_and_misshapen_keys_are_listed(tmp_path: Path) -> None:
    state = build_model("resnet8", 10).state_dict()
    del state["stem.0.weight"]
    state["extra.weight"] = torch.zeros(2)
    state["stages.0.conv1.weight"] = torch.zeros(1, 1, 1, 1)
    path = tmp_path / "broken.pt"
    torch.save(state, path)
    with pytest.raises(InitError) as caught:
        plan_init(path, build_model("resnet8", 10))
    message = str(caught.value)
    assert "1 missing: stem.0.weight" in message
    assert "1 unexpected: extra.weight" in message
    assert "stages.0.conv1.weight (1, 1, 1, 1) vs (16, 16, 3, 3)" in message

"""model.pt and `stoker.load`: the card travels with the weights in a file `torch.load(weights_only=True)` reads;
a foreign, plain or modified file is refused with its name; `preprocess` gives exactly the tensor stoker's
validation path (producers into a slot, the consumer's feed) gives the same file."""

from __future__ import annotations

import io
import logging
import os
import re
import struct
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import stoker
from stoker.training.model_file import ModelCard, ModelFileError, model_card, read_model, save_model
from stoker.training.models import build_model
from stoker.use.loader import Loader
from tests.conftest import HELPERS, photograph_jpeg

CLASSES = ("cat", "dog", "eel")


def saved_model(path: Path, name: str = "resnet8", image_size: int = 32) -> tuple[torch.nn.Module, ModelCard]:
    torch.manual_seed(0)
    model = build_model(name, len(CLASSES))
    card = model_card(name, CLASSES, image_size)
    save_model(path, model.state_dict(), card)
    return model, card


def test_the_file_is_plain_weights_and_a_card_that_weights_only_reads(tmp_path):
    model, _ = saved_model(tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    # what `--init` and a plain load_state_dict read: the weights under 'state_dict'
    fresh = build_model("resnet8", len(CLASSES))
    fresh.load_state_dict(loaded["state_dict"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    card = loaded["card"]
    assert (card["model"], card["classes"], card["image_size"]) == ("resnet8", list(CLASSES), 32)
    # torchvision's ImageNet normalization and validation crop (its references: Resize(256), CenterCrop(224))
    assert card["mean"] == [0.485, 0.456, 0.406] and card["std"] == [0.229, 0.224, 0.225]
    assert card["crop_fraction"] == 224 / 256


def test_init_reads_the_weights_of_a_model_file(tmp_path):
    from stoker.training.init import read_state_dict

    model, _ = saved_model(tmp_path / "model.pt")
    state = read_state_dict(tmp_path / "model.pt")  # what --init model.pt loads
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_load_gives_the_model_in_eval_mode_with_its_classes(tmp_path):
    model, _ = saved_model(tmp_path / "model.pt")
    loaded = stoker.load(tmp_path)  # a run folder: its model.pt
    assert loaded.classes == CLASSES and loaded.image_size == 32 and not loaded.model.training
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(loaded(x), model.eval()(x))


def test_a_module_function_model_is_rebuilt_from_its_recorded_spec(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HELPERS))
    model, card = saved_model(tmp_path / "user.pt", name="nobn:small_cnn")
    assert card.module_file == str((HELPERS / "nobn.py").resolve()) and card.module_sha256
    loaded = stoker.load(tmp_path / "user.pt", model="nobn:small_cnn")  # the caller names the card's module
    x = torch.randn(1, 3, 32, 32)
    assert torch.equal(loaded(x), model.eval()(x))


def test_a_module_changed_since_training_is_refused_before_it_runs(tmp_path, monkeypatch):
    (tmp_path / "changing_model.py").write_text((HELPERS / "nobn.py").read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    saved_model(tmp_path / "user.pt", name="changing_model:small_cnn")
    monkeypatch.delitem(sys.modules, "changing_model")
    stoker.load(tmp_path / "user.pt", model="changing_model:small_cnn")  # unchanged: imported
    monkeypatch.delitem(sys.modules, "changing_model")
    marker = tmp_path / "ran"
    with open(tmp_path / "changing_model.py", "a") as module:
        module.write(f"open({str(marker)!r}, 'w').close()  # edited after training\n")
    with pytest.raises(ValueError, match=r"user.pt: cannot rebuild its model: module 'changing_model' would "
                                         r"load .*changing_model.py, which differs from the file the model was "
                                         r"trained with.*model="):
        stoker.load(tmp_path / "user.pt", model="changing_model:small_cnn")
    assert not marker.exists() and "changing_model" not in sys.modules


def _planted_model_file(folder: Path, module_sha256: str | None) -> Path:
    """What the reviewer built: a folder holding a model.pt whose card names helper:f, and a helper.py that
    leaves a marker when it runs."""
    (folder / "helper.py").write_text(f"open({str(folder / 'ran')!r}, 'w').close()\n"
                                      "from nobn import small_cnn as f\n")
    torch.manual_seed(0)
    sys.path.insert(0, str(HELPERS))
    try:
        state = build_model("nobn:small_cnn", len(CLASSES)).state_dict()
    finally:
        sys.path.remove(str(HELPERS))
    card = ModelCard("helper:f", CLASSES, 32, module_file="/elsewhere/helper.py", module_sha256=module_sha256)
    save_model(folder / "model.pt", state, card)
    return folder / "model.pt"


@pytest.mark.parametrize("recorded", [None, "0" * 64])  # no digest; a digest of some other file
def test_a_model_file_beside_a_planted_module_runs_no_code(tmp_path, monkeypatch, recorded):
    _planted_model_file(tmp_path, recorded)
    monkeypatch.chdir(tmp_path)  # the working directory comes first on the import path
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(ValueError, match=r"model.pt: its model is 'helper:f', code of your own, which stoker "
                                         r"imports only when you name it"):
        stoker.load("model.pt")  # not named by the caller: not even looked up
    with pytest.raises(ValueError, match=r"model.pt: .*helper.py.*stoker.load\(.*model=your_function\)"):
        stoker.load("model.pt", model="helper:f")  # named, but not the module the card records
    assert not (tmp_path / "ran").exists() and "helper" not in sys.modules
    monkeypatch.syspath_prepend(str(HELPERS))
    from nobn import small_cnn  # the caller's own builder: the card's module is not looked at

    loaded = stoker.load("model.pt", model=small_cnn)
    assert loaded.classes == CLASSES and not (tmp_path / "ran").exists()


def test_a_card_naming_a_module_whose_bytes_it_knows_runs_it_only_when_the_caller_names_it(tmp_path, monkeypatch):
    """The reviewer's file: a card naming a module on the import path with that module's true SHA-256 (this:nothing,
    the stdlib's this.py, printed the Zen of Python): the digest matches, so only the caller's naming it may let it
    run. Here the module leaves a marker when it runs."""
    marker = tmp_path / "ran"
    (tmp_path / "known_bytes.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                             + (HELPERS / "nobn.py").read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    card = model_card("known_bytes:small_cnn", CLASSES, 32)  # located and hashed, not run
    assert card.module_sha256 and not marker.exists()
    save_model(tmp_path / "crafted.pt", build_model("resnet8", len(CLASSES)).state_dict(), card)
    for named in (None, "resnet8", "known_bytes:other"):
        with pytest.raises(ValueError, match=r"crafted.pt: its model is 'known_bytes:small_cnn'"):
            stoker.load(tmp_path / "crafted.pt", model=named)
    assert not marker.exists() and "known_bytes" not in sys.modules
    with pytest.raises(ValueError, match="its weights do not fit"):  # named: checked, imported, built
        stoker.load(tmp_path / "crafted.pt", model="known_bytes:small_cnn")
    assert marker.exists()
    sys.modules.pop("known_bytes")  # (monkeypatch.delitem would put it back at teardown)


def test_a_planted_pyc_beside_the_verified_module_does_not_run(tmp_path, monkeypatch):
    """Python runs __pycache__/M.cpython-*.pyc instead of M.py while the mtime and size it records match the
    source's: a .pyc forged with those runs other code than the bytes that were hashed."""
    import importlib.util
    from importlib._bootstrap_external import _code_to_timestamp_pyc

    source = tmp_path / "pyc_model.py"
    source.write_text((HELPERS / "nobn.py").read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    saved_model(tmp_path / "user.pt", name="pyc_model:small_cnn")
    monkeypatch.delitem(sys.modules, "pyc_model")
    forged = compile(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n" + source.read_text(), str(source), "exec")
    stat = source.stat()
    cached = Path(importlib.util.cache_from_source(str(source)))
    cached.parent.mkdir(exist_ok=True)
    cached.write_bytes(_code_to_timestamp_pyc(forged, int(stat.st_mtime), stat.st_size))
    stoker.load(tmp_path / "user.pt", model="pyc_model:small_cnn")
    assert not (tmp_path / "ran").exists()
    monkeypatch.delitem(sys.modules, "pyc_model")


def test_the_recorded_digest_is_sha256_of_the_module_file_and_a_package_module_is_located_unrun(tmp_path,
                                                                                               monkeypatch):
    import hashlib

    from stoker.training.model_source import locate_module

    monkeypatch.syspath_prepend(str(HELPERS))
    card = model_card("nobn:small_cnn", CLASSES, 32)
    assert card.module_sha256 == hashlib.sha256((HELPERS / "nobn.py").read_bytes()).hexdigest()
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    (package / "net.py").write_text((HELPERS / "nobn.py").read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    source = locate_module("pkg.net")
    assert source.files == ((package / "__init__.py").resolve(), (package / "net.py").resolve())
    assert not (tmp_path / "ran").exists() and "pkg" not in sys.modules
    with pytest.raises(ValueError, match="'pkg.absent' is not found"):
        locate_module("pkg.absent")
    model, _ = saved_model(tmp_path / "user.pt", name="pkg.net:small_cnn")  # imports pkg, as training does
    for name in ("pkg", "pkg.net"):
        monkeypatch.delitem(sys.modules, name)
    x = torch.randn(1, 3, 32, 32)
    assert torch.equal(stoker.load(tmp_path / "user.pt", model="pkg.net:small_cnn")(x), model.eval()(x))  # verified
    assert sys.modules["pkg"].net is sys.modules["pkg.net"]
    for name in ("pkg", "pkg.net"):
        monkeypatch.delitem(sys.modules, name)


def test_a_module_that_cannot_be_imported_names_the_file_and_where_it_was_trained_from(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HELPERS))
    saved_model(tmp_path / "user.pt", name="nobn:small_cnn")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(HELPERS)])
    monkeypatch.delitem(sys.modules, "nobn")
    with pytest.raises(ValueError, match=f"{tmp_path / 'user.pt'}: cannot rebuild its model.*trained from "
                                         f".*nobn.py: run from its folder or put that on PYTHONPATH"):
        stoker.load(tmp_path / "user.pt", model="nobn:small_cnn")


def _record_data_offset(path: Path, suffix: str) -> int:
    """Where the bytes of the archive's first record ending in `suffix` start (after its local header)."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix) and i.file_size > 64)
    with open(path, "rb") as handle:
        handle.seek(info.header_offset)
        header = handle.read(30)
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_length + extra_length


@pytest.mark.parametrize("record", ["/data/0", "data.pkl"])  # a weight's bytes; the card (pickled) itself
def test_a_modified_file_is_refused_with_its_name(tmp_path, record):
    path = tmp_path / "model.pt"
    saved_model(path)
    data = bytearray(path.read_bytes())
    data[_record_data_offset(path, record) + 40] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match=f"{path}: tampered or damaged"):
        stoker.load(path)


def test_foreign_and_plain_files_are_refused_with_their_names(tmp_path):
    plain = tmp_path / "plain.pt"
    torch.save(build_model("resnet8", 3).state_dict(), plain)
    with pytest.raises(ModelFileError, match=f"{plain}: a plain state_dict, without the card"):
        read_model(plain)
    text = tmp_path / "notes.pt"
    text.write_text("not a model")
    with pytest.raises(ModelFileError, match=f"{text}: not a model file"):
        stoker.load(text)
    other = tmp_path / "other.pt"
    torch.save({"epoch": 3, "weights": [1, 2]}, other)
    with pytest.raises(ModelFileError, match=f"{other}: not a stoker model file"):
        stoker.load(other)
    with pytest.raises(ModelFileError, match=f"{tmp_path / 'model.pt'}: no such file"):
        stoker.load(tmp_path)


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['EXPLOIT_MARKER']}",))


def test_a_pickle_that_would_run_code_is_refused_and_runs_none(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    monkeypatch.setenv("EXPLOIT_MARKER", str(marker))
    path = tmp_path / "model.pt"
    torch.save({"stoker_model": 1, "state_dict": {"w": torch.zeros(1)}, "card": _Exploit()}, path)
    with pytest.raises(ModelFileError, match=f"{path}: not a model file torch can load safely"):
        stoker.load(path)
    assert not marker.exists()


def test_a_card_whose_weights_do_not_fit_its_model_is_refused(tmp_path):
    card = model_card("resnet8", CLASSES, 32)
    save_model(tmp_path / "model.pt", build_model("resnet14", 3).state_dict(), card)
    with pytest.raises(ModelFileError, match="model.pt: its weights do not fit 'resnet8' with 3 classes"):
        stoker.load(tmp_path / "model.pt")


def _images(folder: Path) -> None:
    """One file per decoder path: baseline and progressive JPEG photos (427x640: a non-square crop, a reduced
    decode), a CMYK JPEG (Pillow), RGB and grey PNGs (libpng), RGBA and 16-bit PNGs (Pillow), a BMP."""
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)
    (folder / "a").mkdir(parents=True)
    (folder / "b").mkdir()
    (folder / "a" / "photo.jpg").write_bytes(photograph_jpeg(0, progressive=False))
    (folder / "a" / "progressive.jpg").write_bytes(photograph_jpeg(1, progressive=True))
    Image.fromarray(noise).convert("CMYK").save(folder / "a" / "cmyk.jpg", quality=90)
    Image.fromarray(noise).save(folder / "b" / "rgb.png")
    Image.fromarray(noise[:, :, 0]).save(folder / "b" / "grey.png")
    Image.fromarray(np.dstack([noise, noise[:, :, :1]])).save(folder / "b" / "rgba.png")
    Image.fromarray(noise[:, :, 1].astype(np.uint16) * 257).save(folder / "b" / "wide.png")
    Image.fromarray(noise).save(folder / "b" / "plain.bmp")


def test_preprocess_equals_the_validation_batch_bit_for_bit(tmp_path):
    data = tmp_path / "data"
    _images(data)
    saved_model(tmp_path / "model.pt", image_size=48)
    model = stoker.load(tmp_path / "model.pt")
    seen = 0
    with Loader(data, batch_size=3, image_size=48, augment="none", producers=2, device="cpu") as loader:
        for images, _ in loader:
            for image, sample in zip(images, loader.batch_ids):
                path = loader.source.paths[int(sample)]
                assert torch.equal(model.preprocess(path), image), path
                assert torch.equal(model.preprocess(Path(path).read_bytes()), image), path
                seen += 1
    assert seen == 8
    # With another thread alive stoker decodes PNGs with Pillow instead of libpng (descriptor 2 is the process's):
    # the same pixels, so a user's threaded program gets the same tensors.
    alone = {path: model.preprocess(path) for path in sorted(data.glob("*/*"))}
    release = threading.Event()
    other = threading.Thread(target=release.wait, args=(30,))
    other.start()
    try:
        assert all(torch.equal(model.preprocess(path), tensor) for path, tensor in alone.items())
    finally:
        release.set()
        other.join()
    with Image.open(data / "b" / "rgb.png") as opened:  # a decoded image: the same crop, resize and normalization
        assert torch.equal(model.preprocess(opened), model.preprocess(data / "b" / "rgb.png"))


def test_preprocess_names_a_file_it_cannot_use(tmp_path):
    saved_model(tmp_path / "model.pt")
    model = stoker.load(tmp_path)
    bad = tmp_path / "cut.jpg"
    bad.write_bytes(photograph_jpeg(0, progressive=False)[:5000])
    with pytest.raises(ValueError, match=f"{bad}: truncated"):
        model.preprocess(bad)
    with pytest.raises(ValueError, match=f"{tmp_path / 'absent.png'}: cannot read it"):
        model.preprocess(tmp_path / "absent.png")
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(buffer, "GIF")
    with pytest.raises(ValueError, match="the image bytes: not an image in a supported format"):
        model.preprocess(buffer.getvalue())


def test_model_best_is_replaced_only_by_a_better_validation_also_after_a_resume(tmp_path, caplog):
    from stoker.training.consumer import _BestModel

    path = tmp_path / "model_best.pt"
    card = model_card("resnet8", CLASSES, 32)
    model = build_model("resnet8", len(CLASSES))
    best = _BestModel(path, card, resumed=False)
    for epoch, accuracy in ((1, 0.5), (2, 0.7), (3, 0.7), (4, 0.6)):  # a tie keeps the earlier epoch
        with torch.no_grad():
            model.head.bias.fill_(epoch)
        best.offer(model, epoch, accuracy)
    card_2, state = read_model(path)
    assert (card_2.kind, card_2.epoch, card_2.val_accuracy) == ("best", 2, 0.7)
    assert torch.equal(state["head.bias"], torch.full((3,), 2.0))
    resumed = _BestModel(path, card, resumed=True)  # a resumed run's rank 0 starts from what the file records
    resumed.offer(model, 5, 0.65)
    assert read_model(path)[0].epoch == 2
    resumed.offer(model, 6, 0.75)
    assert read_model(path)[0].epoch == 6
    path.write_bytes(b"damaged")
    with caplog.at_level(logging.WARNING):
        assert _BestModel(path, card, resumed=True).accuracy is None  # replaced next, with a warning
    assert "model_best.pt: not a model file" in caplog.text


def test_a_new_run_replaces_a_stale_model_best_at_its_first_validation(tmp_path):
    from stoker.training.consumer import _BestModel

    path = tmp_path / "model_best.pt"
    card = model_card("resnet8", CLASSES, 32)
    model = build_model("resnet8", len(CLASSES))
    _BestModel(path, card, resumed=False).offer(model, 7, 0.9)  # an earlier run's, left in the folder
    fresh = _BestModel(path, card, resumed=False)
    assert fresh.accuracy is None
    fresh.offer(model, 1, 0.5)
    assert (read_model(path)[0].epoch, read_model(path)[0].val_accuracy) == (1, 0.5)


def test_the_ending_says_which_epoch_model_best_is_from(tmp_path):
    from stoker.observe.report import run_files

    summary = {"status": "completed", "checkpoint": None, "model_best": str(tmp_path / "model_best.pt"),
               "best_epoch": 2, "best_val_accuracy": 0.875}
    assert ("model_best.pt", "the best validation accuracy, 87.50%, at epoch 2") in run_files(summary, tmp_path)
    assert all(name != "model_best.pt" for name, _ in run_files({**summary, "model_best": None, "best_epoch": None},
                                                                  tmp_path))


def _forged_card(path: Path, **card_fields) -> Path:
    """A model file whose card was edited after training: the archive is whole, only the card lies."""
    saved_model(path)
    loaded = torch.load(path, weights_only=True)
    loaded["card"].update(card_fields)
    torch.save(loaded, path)
    return path


def test_a_card_listing_more_classes_than_its_head_is_refused_before_a_model_that_size_is_built(tmp_path,
                                                                                                 monkeypatch):
    import stoker.use.inference as inference

    path = _forged_card(tmp_path / "model.pt", classes=[f"c{k}" for k in range(500_000)])
    built: list[int] = []
    monkeypatch.setattr(inference, "build_model", lambda name, k: built.append(k) or build_model(name, k))
    with pytest.raises(ModelFileError, match="lists 500000 classes, but no weight in its state_dict has 500000 "
                                             r"outputs \(the last weight is head.weight \(3, "):
        stoker.load(path)
    with pytest.raises(ModelFileError, match="500000 classes"):
        stoker.load(path, model=lambda num_classes: built.append(num_classes) or build_model("resnet8", 3))
    assert built == []  # refused from the file alone: nothing of 500,000 outputs was ever allocated


@pytest.mark.parametrize("field,value,expected", [
    ("val_accuracy", "x", "val_accuracy 'x' (expected a fraction from 0 to 1)"),
    ("val_accuracy", 5.0, "val_accuracy 5.0"),
    ("val_accuracy", float("nan"), "val_accuracy nan"),
    ("epoch", -2, "epoch -2 (expected an integer from 1)"),
    ("kind", "weights", "kind 'weights'"),
    ("mean", [0.5, float("nan"), 0.5], "mean (0.5, nan, 0.5), std"),
    ("std", [0.2, float("inf"), 0.2], "std (0.2, inf, 0.2) or"),
])
def test_a_card_value_out_of_range_is_refused_with_the_file_and_the_value(tmp_path, field, value, expected):
    path = _forged_card(tmp_path / "model_best.pt", **{"kind": "best", "epoch": 1, "val_accuracy": 0.5, field: value})
    with pytest.raises(ModelFileError, match=f"model_best.pt: its card has .*{re.escape(expected)}"):
        read_model(path)


def test_a_resume_does_not_trust_a_forged_best_accuracy(tmp_path, caplog):
    from stoker.run.outcome import best_model_fields
    from stoker.training.consumer import _BestModel

    card = model_card("resnet8", CLASSES, 32)
    for forged in ("x", 5.0):
        path = _forged_card(tmp_path / "model_best.pt", kind="best", epoch=1, val_accuracy=forged)
        with caplog.at_level(logging.WARNING):
            best = _BestModel(path, card, resumed=True)
        assert best.accuracy is None and "the next validation replaces it" in caplog.text
        best.offer(build_model("resnet8", 3), 2, 0.4)  # an honest 40% replaces the forged 500%
        assert read_model(path)[0].val_accuracy == 0.4
        assert best_model_fields(path)["best_val_accuracy"] == 0.4


def test_a_resume_from_an_older_checkpoint_sets_aside_the_best_model_of_the_discarded_epochs(tmp_path):
    from stoker.run.resume import DISCARDED_BEST_FILE, set_aside_later_best
    from stoker.training.model_file import save_best

    card = model_card("resnet8", CLASSES, 32)
    save_best(tmp_path / "model_best.pt", build_model("resnet8", 3).state_dict(), card, 3, 0.9)
    assert set_aside_later_best(tmp_path, epochs_done=3) is None  # epoch 3 was validated before the checkpoint
    assert (tmp_path / "model_best.pt").exists()
    assert set_aside_later_best(tmp_path, epochs_done=2) == tmp_path / DISCARDED_BEST_FILE
    assert not (tmp_path / "model_best.pt").exists()
    assert read_model(tmp_path / DISCARDED_BEST_FILE)[0].epoch == 3  # kept, not deleted


def test_a_module_edited_since_training_is_taken_when_the_user_accepts_it_and_the_warning_says_what_changed(
        tmp_path, monkeypatch, caplog):
    (tmp_path / "edited_model.py").write_text((HELPERS / "nobn.py").read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    model, _ = saved_model(tmp_path / "user.pt", name="edited_model:small_cnn")
    monkeypatch.delitem(sys.modules, "edited_model")
    with open(tmp_path / "edited_model.py", "a") as module:
        module.write("# a comment added after training\n")
    with pytest.raises(ValueError, match="--accept-changed-module"):  # the refusal names the way on
        stoker.load(tmp_path / "user.pt", model="edited_model:small_cnn")
    with caplog.at_level(logging.WARNING):
        loaded = stoker.load(tmp_path / "user.pt", model="edited_model:small_cnn", accept_changed_module=True)
    x = torch.randn(1, 3, 32, 32)
    assert torch.equal(loaded(x), model.eval()(x))
    assert "edited_model.py" in caplog.text and "not the file" in caplog.text and "recorded" in caplog.text
    monkeypatch.delitem(sys.modules, "edited_model")
    with pytest.raises(ValueError, match="its model is 'edited_model:small_cnn'"):  # never without naming it
        stoker.load(tmp_path / "user.pt", accept_changed_module=True)


def test_the_cli_has_the_same_switch(tmp_path, monkeypatch, capsys):
    from stoker.cli import main

    (tmp_path / "edited_cli_model.py").write_text((HELPERS / "nobn.py").read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    saved_model(tmp_path / "user.pt", name="edited_cli_model:small_cnn")
    monkeypatch.delitem(sys.modules, "edited_cli_model")
    with open(tmp_path / "edited_cli_model.py", "a") as module:
        module.write("# edited\n")
    _images(tmp_path / "photos")
    argv = ["predict", str(tmp_path / "user.pt"), str(tmp_path / "photos"), "--model", "edited_cli_model:small_cnn",
            "--devices", "cpu", "--producers", "1"]
    assert main(argv) == 2 and "--accept-changed-module" in capsys.readouterr().err
    assert main([*argv, "--accept-changed-module"]) == 0
    assert capsys.readouterr().out.count("\n") >= 2
    sys.modules.pop("edited_cli_model", None)

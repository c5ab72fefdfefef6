"""Parquet image datasets in Hugging Face's layout (and `datasets.save_to_disk` folders): a Parquet copy of the
texture set trains bitwise like the ImageFolder it was made from; a save_to_disk copy, one written by Hugging Face's
own `datasets`, and one served over HTTP index the same rows, labels and bytes; the index and the image copy are
made once per file version; and every refusal (a file that is not Parquet, a missing column, a null image, too
many unnamed classes, a footer or a chunk claiming absurd sizes, a folder of several splits) is named."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest

from stoker.bench import servers
from stoker.data.formats import parquet
from stoker.data.formats.folders import list_image_folder
from stoker.data.formats.parquet import Columns, parquet_files
from stoker.data.sources import load_source
from tests.conftest import assert_same_weights, read_summary, run_cli

SETTINGS = ("--devices", "cpu:1", "--epochs", "1", "--batch-size", "8", "--image-size", "32", "--producers", "1",
            "--seed", "5", "--quiet")
ROW_GROUP = 16
IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # Hugging Face's Image
AN_HOUR_AGO_NS = (int(time.time()) - 3600) * 1_000_000_000


def hf_schema(names: list[str] | None) -> pa.Schema:
    """Hugging Face's schema for an Image and a ClassLabel (a plain int64 Value without names)."""
    label = {"names": names, "_type": "ClassLabel"} if names is not None else {"dtype": "int64", "_type": "Value"}
    features = {"image": {"_type": "Image"}, "label": label}
    return pa.schema([("image", IMAGE_TYPE), ("label", pa.int64())],
                     metadata={"huggingface": json.dumps({"info": {"features": features}})})


def hf_table(images: list[bytes | None], labels: list[int | None], names: list[str] | None,
             paths: list[str | None] | None = None) -> pa.Table:
    paths = paths or [None] * len(images)
    column = [None if data is None and path is None else {"bytes": data, "path": path}
              for data, path in zip(images, paths)]
    return pa.table({"image": column, "label": labels}, schema=hf_schema(names))


def folder_rows(root: Path) -> tuple[list[str], list[bytes], list[int]]:
    """The ImageFolder's classes, and its images' bytes and labels in the order stoker lists them: class folders
    sorted, then files sorted."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    files = [(path, label) for label, name in enumerate(classes) for path in sorted((root / name).iterdir())]
    assert [str(path) for path, _ in files] == list_image_folder(root).paths
    return classes, [path.read_bytes() for path, _ in files], [label for _, label in files]


def write_saved_dataset(folder: Path, table: pa.Table, files: int) -> None:
    """What `Dataset.save_to_disk` writes: Arrow stream files, state.json naming them, dataset_info.json."""
    folder.mkdir(parents=True)
    per_file = -(-table.num_rows // files)
    names = [f"data-{i:05d}-of-{files:05d}.arrow" for i in range(files)]
    for i, name in enumerate(names):
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(i * per_file, per_file), max_chunksize=10)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                   "_fingerprint": "0", "_split": None}))
    features = json.loads(table.schema.metadata[b"huggingface"])["info"]["features"]
    (folder / "dataset_info.json").write_text(json.dumps({"features": features}))


def settle(*paths: Path) -> None:
    """Files written an hour ago: a file changed in the last seconds is indexed but never trusted from the cache."""
    for path in paths:
        os.utime(path, ns=(AN_HOUR_AGO_NS, AN_HOUR_AGO_NS))


@pytest.fixture(scope="module")
def hf_data(textures, tmp_path_factory):
    """The texture train set as one Parquet file of several row groups and as a save_to_disk folder of two files,
    both in Hugging Face's layout."""
    train, _ = textures
    classes, images, labels = folder_rows(train)
    root = tmp_path_factory.mktemp("parquet")
    table = hf_table(images, labels, classes, [f"{i:05d}.jpg" for i in range(len(images))])
    pq.write_table(table, root / "train.parquet", row_group_size=ROW_GROUP)
    write_saved_dataset(root / "saved", table, files=2)
    return root


def assert_same_rows(index, folder: Path) -> None:
    classes, images, labels = folder_rows(folder)
    assert index.classes == tuple(classes) and index.labels.tolist() == labels
    assert [index.read(i) for i in range(len(index))] == images
    assert index.skipped == ()


def test_a_parquet_file_trains_bitwise_like_the_image_folder_it_holds(textures, hf_data, tmp_path):
    train, val = textures
    assert pq.ParquetFile(hf_data / "train.parquet").metadata.num_row_groups == 120 // ROW_GROUP + 1
    env = {"STOKER_CACHE": str(tmp_path / "cache")}
    run_cli("train", "--data", str(train), "--val", str(val), "--out", str(tmp_path / "folder"), *SETTINGS, env=env)
    run_cli("train", "--data", str(hf_data / "train.parquet"), "--val", str(val), "--out", str(tmp_path / "parquet"),
            *SETTINGS, env=env)
    summary = read_summary(tmp_path / "parquet")
    assert summary["status"] == "completed" and summary["skipped_files"] == []
    assert summary["duplicate_samples"] == 0 and summary["missing_samples"] == 0
    assert summary["val_accuracy"] == read_summary(tmp_path / "folder")["val_accuracy"]
    assert_same_weights(tmp_path / "folder", tmp_path / "parquet")


def test_a_save_to_disk_folder_indexes_the_rows_labels_and_bytes_of_the_folder(textures, hf_data, tmp_path):
    assert parquet_files(hf_data / "saved") == [str(hf_data / "saved" / f"data-0000{i}-of-00002.arrow")
                                                for i in range(2)]
    assert_same_rows(load_source(hf_data / "saved", cache=tmp_path / "cache"), textures[0])


def test_what_hugging_face_datasets_writes_is_read_alike(textures, tmp_path):
    datasets = pytest.importorskip("datasets")
    classes, images, labels = folder_rows(textures[0])
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
    rows = {"image": [{"bytes": data, "path": f"{i}.jpg"} for i, data in enumerate(images)], "label": labels}
    dataset = datasets.Dataset.from_dict(rows, features=features)
    dataset.to_parquet(str(tmp_path / "hf.parquet"), batch_size=ROW_GROUP)
    dataset.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(train=dataset, test=dataset).save_to_disk(str(tmp_path / "both"))
    for spec in (tmp_path / "hf.parquet", tmp_path / "saved"):
        assert_same_rows(load_source(spec, cache=tmp_path / "cache"), textures[0])
    with pytest.raises(ValueError, match=r"splits train, test .* --data \S+both/train --val \S+both/test"):
        load_source(tmp_path / "both", cache=tmp_path / "cache")


def test_parquet_over_http_indexes_the_same_rows(textures, hf_data, tmp_path):
    if not os.path.exists(servers.NGINX):
        pytest.skip("nginx is not installed and could not be (make test installs Debian's nginx-light as root)")
    whole = pq.read_table(hf_data / "train.parquet")
    served = tmp_path / "served"
    served.mkdir()
    for i in range(2):
        pq.write_table(whole.slice(60 * i, 60), served / f"part-{i}.parquet", row_group_size=ROW_GROUP)
    with servers.nginx(served) as server:
        index = load_source(f"{server.url}/part-{{0..1}}.parquet", cache=tmp_path / "cache")
        assert_same_rows(index, textures[0])
        assert load_source(f"{server.url}/part-{{0..1}}.parquet", cache=tmp_path / "cache").folder == index.folder


def test_the_image_copy_is_made_once_per_version_of_a_file(tmp_path):
    file = tmp_path / "d.parquet"
    pq.write_table(hf_table([b"one", b"two"], [0, 1], ["a", "b"]), file)
    settle(file)
    first = load_source(file, cache=tmp_path / "cache")
    blob = Path(first.shards[0])
    made = blob.stat().st_mtime_ns
    again = load_source(file, cache=tmp_path / "cache")
    assert again.folder == first.folder and blob.stat().st_mtime_ns == made
    assert load_source(file, classes=("b", "a"), cache=tmp_path / "cache").shards == first.shards  # same copy
    pq.write_table(hf_table([b"three", b"two"], [0, 1], ["a", "b"]), file)
    settle(file)
    changed = load_source(file, cache=tmp_path / "cache")
    assert changed.shards != first.shards and changed.read(0) == b"three"
    assert first.read(0) == b"one"  # a run indexed before the change still reads its own copy


def test_recognised_layouts_and_patterns(textures, tmp_path):
    hub = tmp_path / "hub" / "data"
    hub.mkdir(parents=True)
    for i in range(3):
        pq.write_table(hf_table([b"x"], [0], ["a"]), hub / f"train-{i:05d}-of-00003.parquet")
    expected = [str(hub / f"train-{i:05d}-of-00003.parquet") for i in range(3)]
    assert parquet_files(tmp_path / "hub") == expected and parquet_files(hub) == expected
    assert parquet_files(hub / "train-*.parquet") == expected
    assert parquet_files(hub / "train-{00000..00002}-of-00003.parquet") == expected
    assert parquet_files(textures[0]) is None and parquet_files(tmp_path / "s-{0..3}.tar") is None
    pq.write_table(hf_table([b"x"], [0], ["a"]), hub / "test-00000-of-00001.parquet")
    meant = f"--data {hub}/train-{{00000..00002}}-of-00003.parquet --val {hub}/test-00000-of-00001.parquet"
    with pytest.raises(ValueError, match="holds the splits test, train; name one: " + meant.replace("{", r"\{")
                       .replace("}", r"\}").replace(".", r"\.")):
        parquet_files(tmp_path / "hub")
    (hub / "test-00000-of-00001.parquet").unlink()
    (hub / "train-00001-of-00003.parquet").unlink()
    with pytest.raises(ValueError, match=r"holds 2 of the 3 files of the split 'train' \(number 1 is missing\)"):
        parquet_files(hub)
    with pytest.raises(ValueError, match="no such Parquet file"):
        parquet_files(tmp_path / "nope.parquet")
    with pytest.raises(ValueError, match="no file matches"):
        parquet_files(hub / "val-*.parquet")


def test_validation_rows_take_the_training_classes_by_name(tmp_path):
    file = tmp_path / "val.parquet"
    pq.write_table(hf_table([b"1", b"2", b"3"], [0, 1, 2], ["dog", "cat", "bird"]), file)
    index = load_source(file, classes=("cat", "dog"), cache=tmp_path / "cache")
    assert index.classes == ("cat", "dog") and index.labels.tolist() == [1, 0]
    assert [s.reason for s in index.skipped] == ["class 'bird' is not a class of the training data"]
    assert index.skipped[0].path == f"{file}:row 2"


def test_rows_without_an_image_or_a_class_are_listed_and_left_out(tmp_path):
    file = tmp_path / "holes.parquet"
    images = [b"a", None, None, b"d", b"", b"f", b"g"]
    pq.write_table(hf_table(images, [0, 1, 1, None, 1, -1, 5], ["x", "y"], [None, None, "lost.jpg", None, None,
                                                                          None, None]), file, row_group_size=3)
    index = load_source(file, cache=tmp_path / "cache")
    assert len(index) == 1 and index.read(0) == b"a"
    listed = {s.path: s.reason for s in index.skipped}
    assert listed == {f"{file}:row 1": "no image (null)",
                      f"{file}:row 2": "no image bytes, and the file the row names, 'lost.jpg', cannot be read (No "
                                       "such file or directory)",
                      f"{file}:row 3": "no label (null)",
                      f"{file}:row 4": "an empty image (0 bytes)",
                      f"{file}:row 5": "label -1 is negative: no class (-1 marks an unlabelled row)",
                      f"{file}:row 6": "label 5 is outside the 2 classes the file's ClassLabel names"}


def test_rows_that_name_a_file_are_read_from_it_under_the_parquet_files_folder(textures, tmp_path):
    """What `datasets` writes for an Image column made from paths (bytes null, a path): a file under the Parquet
    file's folder is read, named relative to it or absolute inside it; one outside it (absolute, or through '..')
    is refused saying why and how to embed the images. A sample is named by the user's file and row, never by the
    copy stoker keeps in its cache."""
    photos = sorted((textures[0] / "0_horizontal").iterdir())[:4]
    data = tmp_path / "set" / "data"
    (data / "images").mkdir(parents=True)
    for i, photo in enumerate(photos[:2]):
        (data / "images" / f"{i}.jpg").write_bytes(photo.read_bytes())
    (tmp_path / "set" / "outside.jpg").write_bytes(photos[2].read_bytes())
    file = data / "train.parquet"
    paths = ["images/0.jpg", str(data / "images" / "1.jpg"), str(tmp_path / "set" / "outside.jpg"),
             "../outside.jpg", "images/../images/0.jpg", None]
    images = [None] * 5 + [photos[3].read_bytes()]
    pq.write_table(hf_table(images, [0, 1, 0, 1, 0, 1], ["a", "b"], paths), file)
    index = load_source(file, cache=tmp_path / "cache")
    assert [index.read(i) for i in range(len(index))] == [photos[0].read_bytes(), photos[1].read_bytes(),
                                                          photos[3].read_bytes()]
    assert index.labels.tolist() == [0, 1, 1]
    assert list(index.paths) == [f"{file}:row 0", f"{file}:row 1", f"{file}:row 5"]
    refused = {s.path: s.reason for s in index.skipped}
    assert sorted(refused) == [f"{file}:row 2", f"{file}:row 3", f"{file}:row 4"]
    for row, path in ((2, paths[2]), (3, "../outside.jpg"), (4, "images/../images/0.jpg")):
        assert refused[f"{file}:row {row}"].startswith(
            f"no image bytes, and the file the row names, {path!r}, is not under the Parquet file's folder {data} ")
        assert "embed_table_storage" in refused[f"{file}:row {row}"]


def test_unnamed_classes_are_numbered_and_bounded(tmp_path):
    file = tmp_path / "unnamed.parquet"
    pq.write_table(pa.table({"img": [b"a", b"b", b"c"], "labels": pa.array([2, 0, 12345], pa.int32())}), file)
    index = load_source(file, cache=tmp_path / "cache")
    assert index.classes == ("0", "1", "2") and index.labels.tolist() == [2, 0]
    [refused] = index.skipped
    assert refused.path == f"{file}:row 2" and "label 12345 is not below 10000" in refused.reason


def test_columns_named_by_the_settings(tmp_path):
    file = tmp_path / "named.parquet"
    pq.write_table(pa.table({"photo": [b"a", b"b"], "thumb": [b"c", b"d"], "y": [1, 0], "label": ["p", "q"]}), file)
    with pytest.raises(ValueError, match=r"named\.parquet: no image column .*photo \(binary\), thumb \(binary\)"):
        load_source(file, cache=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"the label column 'label' holds string \(expected integer"):
        load_source(file, cache=tmp_path / "cache", columns=Columns(image="thumb"))
    index = load_source(file, cache=tmp_path / "cache", columns=Columns(image="thumb", label="y"))
    assert [index.read(i) for i in range(2)] == [b"c", b"d"] and index.labels.tolist() == [1, 0]


def test_files_that_cannot_be_used_are_named(textures, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    jpeg = tmp_path / "photo.parquet"
    jpeg.write_bytes(next((textures[0] / "0_horizontal").iterdir()).read_bytes())
    with pytest.raises(ValueError, match=r"photo\.parquet: not a Parquet file"):
        load_source(jpeg, cache=cache)
    no_label = tmp_path / "no_label.parquet"
    pq.write_table(pa.table({"image": [b"a"]}), no_label)
    with pytest.raises(ValueError, match=r"no_label\.parquet: no label column \(expected integer class indices"):
        load_source(no_label, cache=cache)
    good = tmp_path / "good.parquet"
    pq.write_table(hf_table([b"a", b"b"], [0, 1], ["x", "y"]), good)
    footer = tmp_path / "footer.parquet"
    data = bytearray(good.read_bytes())
    data[-8:-4] = (3 << 30).to_bytes(4, "little")
    footer.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"footer\.parquet: its footer claims 3221225472 bytes of metadata"):
        load_source(footer, cache=cache)
    monkeypatch.setattr(parquet, "MAX_METADATA_BYTES", 64)
    with pytest.raises(ValueError, match=r"good\.parquet: its Hugging Face metadata holds \d+ bytes, more than the 64"):
        load_source(good, cache=cache)
    monkeypatch.undo()
    monkeypatch.setattr(parquet, "EXPANSION_SLACK", 0)
    monkeypatch.setattr(parquet, "MAX_EXPANSION", 0)
    with pytest.raises(ValueError, match=r"good\.parquet: row group 0's column image\.bytes claims to expand"):
        load_source(good, cache=cache)


DICTIONARY_LOAD = """
import sys
from pathlib import Path
import pyarrow
from stoker.data.sources import load_source
try:
    load_source(Path(sys.argv[1]), cache=Path(sys.argv[2]))
except ValueError as error:
    print(error)
print(pyarrow.default_memory_pool().max_memory() >> 20)
"""


def test_a_dictionary_encoded_image_repeated_is_refused_within_bounded_memory(tmp_path):
    """One 2 MiB image in a column's dictionary, 300 rows naming it: the file stores 2 MiB and claims 600 MiB of
    images. It is refused as a bomb, pyarrow's peak allocation in the reading process bounded (reading 256 rows
    before any check took 1 GiB of it; a 4 MiB image, 2 GiB)."""
    import subprocess
    import sys

    file = tmp_path / "repeated.parquet"
    image = pa.DictionaryArray.from_arrays(pa.array([0] * 300, pa.int32()), pa.array([os.urandom(2 << 20)]))
    pq.write_table(pa.table({"image": image, "label": [0] * 300}), file, dictionary_pagesize_limit=16 << 20,
                   store_schema=False)  # read back as binary, as most writers leave it
    assert file.stat().st_size < 3 << 20 and pq.ParquetFile(file).metadata.row_group(0).column(0).has_dictionary_page
    result = subprocess.run([sys.executable, "-c", DICTIONARY_LOAD, str(file), str(tmp_path / "cache")],
                            capture_output=True, text=True, timeout=120, check=True)
    refusal, peak_mib = result.stdout.strip().splitlines()
    assert f"{file}: holds more image bytes than" in refusal and "decompression bomb" in refusal
    assert int(peak_mib) <= 160, peak_mib  # a batch of 32 rows (64 MiB) decoded, and its copy as large_binary


def test_a_bad_file_stops_the_cli_before_any_process_starts(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    result = run_cli("train", "--data", str(bad), "--out", str(tmp_path / "run"), "--quiet", check=False,
                     env={"STOKER_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 2 and f"{bad}: not a Parquet file" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

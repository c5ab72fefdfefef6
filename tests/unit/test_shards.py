"""WebDataset-layout shards: which files a --data value names, labels from .cls, bad members and truncated shards
listed, and `stoker pack` writing the folder's samples in the folder's order, the same bytes every time."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import simplejpeg

from stoker.common.sizes import parse_size
from stoker.data.formats.folders import scan_image_folder
from stoker.data.formats.pack import Shrink, pack
from stoker.data.formats.shards import expand_braces, load_shards, shard_paths
from stoker.data.pixels.imaging import seal_intact


def write_tar(path, members: list[tuple[str, bytes]], format: int = tarfile.DEFAULT_FORMAT) -> None:
    with tarfile.open(path, "w", format=format) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def test_brace_patterns_expand_in_order_with_their_zero_padding():
    assert expand_braces("train-{000008..000011}.tar") == [f"train-0000{n:02d}.tar" for n in (8, 9, 10, 11)]
    assert expand_braces("{a,b}/s-{1..2}.tar") == ["a/s-1.tar", "a/s-2.tar", "b/s-1.tar", "b/s-2.tar"]
    assert expand_braces("plain.tar") == ["plain.tar"]
    with pytest.raises(ValueError, match="counts down"):
        expand_braces("s-{3..1}.tar")


def test_brace_pattern_folder_and_list_file_name_the_same_shards(tmp_path):
    for n in range(3):
        write_tar(tmp_path / f"s-{n:03d}.tar", [(f"k{n}.jpg", b"x"), (f"k{n}.cls", b"0")])
    expected = [str(tmp_path / f"s-{n:03d}.tar") for n in range(3)]
    (tmp_path / "shards.txt").write_text("# train shards\ns-000.tar\ns-001.tar\n\ns-002.tar\n")
    assert shard_paths(tmp_path / "s-{000..002}.tar") == expected
    assert shard_paths(tmp_path) == expected
    assert [os.path.normpath(p) for p in shard_paths(tmp_path / "shards.txt")] == expected
    with pytest.raises(ValueError, match="1 of 4 shards do not exist"):
        shard_paths(tmp_path / "s-{000..003}.tar")


def test_labels_come_from_cls_members_and_bytes_by_offset(tmp_path):
    members = []
    for n, label in enumerate((3, 0, 7)):
        members += [(f"dir/img{n}.jpg", f"jpeg bytes {n}".encode() * (n + 1)),
                    (f"dir/img{n}.cls", f"{label}\n".encode())]
    write_tar(tmp_path / "a.tar", members)
    index = load_shards([str(tmp_path / "a.tar")], cache=tmp_path / "cache")
    assert index.labels.tolist() == [3, 0, 7]
    assert index.classes == tuple(str(i) for i in range(8))  # no classes.json: 0..the largest label
    assert [index.read(i) for i in range(3)] == [f"jpeg bytes {n}".encode() * (n + 1) for n in range(3)]
    assert index.paths[1] == f"{tmp_path / 'a.tar'}:dir/img1"


@pytest.mark.parametrize("format", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_long_member_names_in_every_tar_format(tmp_path, format):
    """Paths over 100 bytes take a prefix field (ustar), a long-name member (GNU) or a pax header."""
    folder = "class_" + "x" * 120 if format != tarfile.USTAR_FORMAT else "p" * 90 + "/" + "q" * 40
    write_tar(tmp_path / "a.tar", [(f"{folder}/img.jpg", b"pixels"), (f"{folder}/img.cls", b"4"),
                                   ("short.png", b"png"), ("short.cls", b"1")], format)
    index = load_shards([str(tmp_path / "a.tar")], cache=tmp_path / "cache")
    assert list(index.paths) == [f"{tmp_path / 'a.tar'}:{folder}/img", f"{tmp_path / 'a.tar'}:short"]
    assert index.labels.tolist() == [4, 1] and [index.read(0), index.read(1)] == [b"pixels", b"png"]
    assert not index.skipped


def test_bad_members_are_skipped_and_listed_as_shard_and_key(tmp_path):
    write_tar(tmp_path / "a.tar", [("good.jpg", b"g"), ("good.cls", b"1"),
                                   ("nolabel.jpg", b"n"),
                                   ("badlabel.png", b"b"), ("badlabel.cls", b"cat"),
                                   ("noimage.cls", b"2"), ("noimage.txt", b"t")])
    (tmp_path / "classes.json").write_text(json.dumps(["zero", "one"]))
    index = load_shards([str(tmp_path / "a.tar")], cache=tmp_path / "cache")
    shard = str(tmp_path / "a.tar")
    reasons = {s.path: s.reason for s in index.skipped}
    assert len(index) == 1 and index.classes == ("zero", "one")
    assert "no .cls" in reasons[f"{shard}:nolabel"]
    assert "not an integer" in reasons[f"{shard}:badlabel"]
    assert "no image" in reasons[f"{shard}:noimage"]


def test_labels_outside_the_classes_are_listed(tmp_path):
    write_tar(tmp_path / "a.tar", [("a.jpg", b"a"), ("a.cls", b"1"), ("b.jpg", b"b"), ("b.cls", b"5")])
    index = load_shards([str(tmp_path / "a.tar")], classes=("x", "y"), cache=tmp_path / "cache")
    assert index.labels.tolist() == [1]
    assert [(s.path, s.reason) for s in index.skipped] == [(f"{tmp_path / 'a.tar'}:b", "label outside the 2 classes")]


def test_truncated_shard_is_indexed_up_to_its_last_whole_member(tmp_path):
    members = [(f"k{n}.{ext}", (b"%d" % n) * 700 if ext == "jpg" else b"1") for n in range(4) for ext in ("jpg", "cls")]
    write_tar(tmp_path / "a.tar", members)
    data = (tmp_path / "a.tar").read_bytes()
    cut = data.index(b"3" * 700) + 300  # inside the last image's bytes
    (tmp_path / "a.tar").write_bytes(data[:cut])
    index = load_shards([str(tmp_path / "a.tar")], cache=tmp_path / "cache")
    assert len(index) == 3 and index.read(2) == b"2" * 700
    assert any(s.path == str(tmp_path / "a.tar") and "truncated" in s.reason for s in index.skipped)


def test_pax_shard_cut_inside_a_header_is_listed_as_truncated(tmp_path):
    """Long names make pax headers, which Python's tarfile reads; it ends a cut archive as if it were whole."""
    folder = "class_" + "x" * 120
    members = [(f"{folder}/k{n}.{ext}", b"%d" % n if ext == "cls" else b"img")
               for n in range(3) for ext in ("jpg", "cls")]
    write_tar(tmp_path / "a.tar", members, tarfile.PAX_FORMAT)
    with tarfile.open(tmp_path / "a.tar") as archive:
        last = archive.getmembers()[-1]
    data = (tmp_path / "a.tar").read_bytes()
    (tmp_path / "a.tar").write_bytes(data[:last.offset + 100])  # inside the pax header of the last member
    index = load_shards([str(tmp_path / "a.tar")], cache=tmp_path / "cache")
    assert len(index) == 2
    assert any(s.path == str(tmp_path / "a.tar") and "truncated" in s.reason for s in index.skipped), index.skipped


def test_shard_index_is_cached_until_a_shard_changes(tmp_path):
    shard = tmp_path / "a.tar"
    write_tar(shard, [("k.jpg", b"x"), ("k.cls", b"0")])
    os.utime(shard, (1e9, 1e9))
    first = load_shards([str(shard)], cache=tmp_path / "cache")
    assert load_shards([str(shard)], cache=tmp_path / "cache").folder == first.folder
    write_tar(shard, [("k.jpg", b"x"), ("k.cls", b"0"), ("m.jpg", b"y"), ("m.cls", b"0")])
    os.utime(shard, (1e9 + 5, 1e9 + 5))
    assert len(load_shards([str(shard)], cache=tmp_path / "cache")) == 2


def test_parse_size():
    assert parse_size("s", "1GB") == 10**9 and parse_size("s", "500M") == 5 * 10**8 and parse_size("s", "4096") == 4096
    with pytest.raises(ValueError, match="shard_size='big'"):
        parse_size("shard_size", "big")


def test_pack_keeps_the_folder_order_labels_and_pixels_and_is_deterministic(textures, tmp_path):
    """The same shards whatever the workers; each member the folder's image at its place, with its label: the same
    pixels by default (each JPEG rewritten with restart markers), the same bytes with keep_bytes."""
    train, _ = textures
    one = pack(train, tmp_path / "one", shard_size=40_000, workers=1)
    two = pack(train, tmp_path / "two", shard_size=40_000, workers=2)
    kept = pack(train, tmp_path / "kept", shard_size=40_000, workers=2, shrink=Shrink(keep_bytes=True))
    assert len(one) > 2
    assert [p.read_bytes() for p in one] == [p.read_bytes() for p in two]
    folder = scan_image_folder(train)
    for shards_written in (one, kept):
        shards = load_shards([str(p) for p in shards_written], cache=tmp_path / "cache")
        assert shards.classes == folder.classes
        assert shards.labels.tolist() == folder.labels.tolist()
    originals = [open(path, "rb").read() for path in folder.paths]
    assert [shards.read(i) for i in range(len(folder))] == originals  # the last loaded: kept
    rewritten = load_shards([str(p) for p in one], cache=tmp_path / "cache")
    for i, original in enumerate(originals):
        assert rewritten.read(i) != original and seal_intact(rewritten.read(i))  # its first load is cut to the box
        assert np.array_equal(simplejpeg.decode_jpeg(rewritten.read(i)), simplejpeg.decode_jpeg(original))


def test_damaged_header_ends_the_shard_there_and_is_listed(tmp_path):
    members = [(f"k{n}.{ext}", (b"%d" % n) * 700 if ext == "jpg" else b"1") for n in range(3) for ext in ("jpg", "cls")]
    write_tar(tmp_path / "a.tar", members)
    data = bytearray((tmp_path / "a.tar").read_bytes())
    second_image_header = data.index(b"k1.jpg")
    data[second_image_header + 1] ^= 0xFF  # the name changes, the stored checksum does not
    (tmp_path / "a.tar").write_bytes(bytes(data))
    index = load_shards([str(tmp_path / "a.tar")], cache=tmp_path / "cache")
    assert list(index.paths) == [f"{tmp_path / 'a.tar'}:k0"]
    assert any("checksum" in s.reason for s in index.skipped)


def test_a_changed_shard_is_read_again_alone(tmp_path):
    """Each shard's members are kept: adding a shard to the set, or changing one, reads only that one again."""
    for name in ("a", "b"):
        write_tar(tmp_path / f"{name}.tar", [(f"{name}1.jpg", b"x"), (f"{name}1.cls", b"0")])
        os.utime(tmp_path / f"{name}.tar", (1e9, 1e9))
    load_shards([str(tmp_path / "a.tar")], cache=tmp_path / "cache")
    kept = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache" / "shards").iterdir()}
    assert len(kept) == 1
    write_tar(tmp_path / "a.tar", [("a1.jpg", b"x"), ("a1.cls", b"0"), ("a2.jpg", b"y"), ("a2.cls", b"1")])
    os.utime(tmp_path / "a.tar", (1e9 + 7, 1e9 + 7))
    both = load_shards([str(tmp_path / "a.tar"), str(tmp_path / "b.tar")], cache=tmp_path / "cache")
    assert list(both.labels) == [0, 1, 0] and both.read(2) == b"x"
    files = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache" / "shards").iterdir()}
    assert len(files) == 3 and all(files[name] == mtime for name, mtime in kept.items())  # old a.tar's untouched
    b_only = load_shards([str(tmp_path / "b.tar")], cache=tmp_path / "cache")
    assert len(b_only) == 1  # a set of its own, built from b.tar's kept members: nothing written again
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache" / "shards").iterdir()} == files


# ---- crafted headers, strict labels, repeated keys, stamps that see a replaced shard, messages -------

INDEX_ONE_SHARD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a runaway index fails here, not the machine
from stoker.data.formats.shards import index_one_shard
members = index_one_shard(sys.argv[1])
print(len(members.keys), "|".join(s.reason for s in members.skipped))
"""


def with_size_field(data: bytes, header_at: int, size: bytes) -> bytes:
    """The tar with one header's size field replaced and its checksum made to add up again."""
    header = bytearray(data[header_at:header_at + 512])
    header[124:136] = size.ljust(11, b"\0")[:11] + b"\0"
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return data[:header_at] + bytes(header) + data[header_at + 512:]


@pytest.mark.parametrize("size", [b"-1750", b"-0000001", b"00000009999", b"+17", b"1_0"])
def test_a_header_with_a_negative_or_non_octal_size_ends_the_shard_there(tmp_path, size):
    """size -1000 (octal -1750) with a valid checksum read the same header again forever (1.36 GB in 20 s)."""
    members = [(f"k{n}.{ext}", b"%d" % n * 600 if ext == "jpg" else b"1") for n in range(3) for ext in ("jpg", "cls")]
    write_tar(tmp_path / "a.tar", members, tarfile.USTAR_FORMAT)
    data = (tmp_path / "a.tar").read_bytes()
    (tmp_path / "a.tar").write_bytes(with_size_field(data, data.index(b"k1.jpg"), size))
    result = subprocess.run([sys.executable, "-c", INDEX_ONE_SHARD, str(tmp_path / "a.tar")], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr[-2000:]
    count, reasons = result.stdout.split(" ", 1)
    assert count == "1" and "damaged header" in reasons and "not an octal number" in reasons


def tar_without_its_end(members: list[tuple[str, bytes]]) -> bytes:
    """A tar's members, without the end-of-archive blocks: more headers can follow."""
    buffer = io.BytesIO()
    archive = tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT)
    for name, data in members:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()  # tarfile writes the end only at close


# A 3 GiB shard's memory map takes 3 GiB of address space, so the limit is on the process's own memory (a file's
# shared map is not counted in RLIMIT_DATA; a 3 GiB read into memory is).
INDEX_ONE_BIG_SHARD = INDEX_ONE_SHARD.replace("RLIMIT_AS", "RLIMIT_DATA").replace("3 << 30", "1 << 30")


def run_index_one_shard(path, script: str = INDEX_ONE_SHARD) -> tuple[str, str]:
    result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr[-2000:]
    count, reasons = result.stdout.split(" ", 1)
    return count, reasons


@pytest.mark.parametrize("kind,what", [(b"x", "a pax header"), (b"g", "a pax global header"),
                                       (b"L", "a GNU long name"), (b"K", "a GNU long link name")])
def test_a_pax_header_or_long_name_claiming_gigabytes_is_refused_unread(tmp_path, kind, what):
    """A 3 GiB sparse shard whose pax header (or GNU long name) claims 3 GiB: tarfile read it all into memory
    (3.3 GB and minutes) before ending with 'not a readable tar file'. Here with 1 GiB of memory at most."""
    good = tar_without_its_end([("k0.jpg", b"j" * 700), ("k0.cls", b"1")])
    assert len(good) == 5 * 512  # two headers, members of 2 blocks and 1
    header = tarfile.TarInfo("././@LongLink")
    header.type, header.size = kind, 3 << 30
    path = tmp_path / "a.tar"
    with open(path, "wb") as handle:
        handle.write(good + header.tobuf(tarfile.GNU_FORMAT))
        handle.truncate(len(good) + 512 + (3 << 30) + 1024)  # sparse: the claimed body is there, as holes
    count, reasons = run_index_one_shard(path, INDEX_ONE_BIG_SHARD)
    assert count == "1", reasons
    assert f"indexed its first 2 members, then a damaged header at byte 2560 ({what} of 3221225472 bytes" in reasons


def test_a_pax_header_giving_a_negative_size_or_a_long_chain_of_them_ends_the_shard(tmp_path):
    """pax 'size=-1000' stepped tarfile back onto headers it had read; 2000 chained pax headers overflowed its
    recursion (RecursionError out of the indexer)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, data, pax in [("k0.jpg", b"j", {}), ("k0.cls", b"1", {}), ("k1.jpg", b"j" * 600, {"size": "-1000"}),
                                ("k1.cls", b"1", {})]:
            info = tarfile.TarInfo(name)
            info.size, info.pax_headers = len(data), pax
            archive.addfile(info, io.BytesIO(data))
    (tmp_path / "negative.tar").write_bytes(buffer.getvalue())
    count, reasons = run_index_one_shard(tmp_path / "negative.tar")
    assert count == "1" and "indexed its first 2 members, then a damaged header" in reasons
    assert "size -1000 is negative" in reasons

    comment = tarfile.TarInfo("././@PaxHeader")
    comment.type, comment.size = tarfile.XHDTYPE, 12
    chain = (comment.tobuf(tarfile.USTAR_FORMAT) + b"12 comment=\n".ljust(512, b"\0")) * 2000
    (tmp_path / "chain.tar").write_bytes(tar_without_its_end([("k0.jpg", b"j"), ("k0.cls", b"1")]) + chain
                                         + tar_without_its_end([("k1.jpg", b"j"), ("k1.cls", b"1")]) + bytes(1024))
    count, reasons = run_index_one_shard(tmp_path / "chain.tar")
    assert count == "1" and "then a damaged header at byte 2048 (more than 16 pax headers" in reasons


@pytest.mark.parametrize("text,reason", [
    (b"99999999999999999999999", "far beyond any class count"),
    (b"1_0", "not an integer label"), (b"+3", "not an integer label"), (b"-2", "not an integer label"),
    (b"2   garbage", "not an integer label"), (b"2" + b" " * 70 + b"9", "bytes, not an integer label"),
    (b"\xef\xbc\x93", "not an integer label"),  # a full-width 3: int() reads it
])
def test_a_label_is_a_plain_decimal_number(tmp_path, text, reason):
    write_tar(tmp_path / "a.tar", [("good.jpg", b"g"), ("good.cls", b" 1\n"), ("bad.jpg", b"b"), ("bad.cls", text)])
    index = load_shards([str(tmp_path / "a.tar")], cache=tmp_path / "cache")
    assert index.labels.tolist() == [1] and index.classes == ("0", "1")
    assert [(s.path, reason in s.reason) for s in index.skipped] == [(f"{tmp_path / 'a.tar'}:bad", True)]


def test_a_label_past_the_default_class_bound_needs_a_classes_file(tmp_path):
    """100000 without classes.json built a 100,001-class model; with a classes.json that long it is a label."""
    write_tar(tmp_path / "a.tar", [("a.jpg", b"a"), ("a.cls", b"3"), ("b.jpg", b"b"), ("b.cls", b"100000")])
    index = load_shards([str(tmp_path / "a.tar")], cache=tmp_path / "cache")
    assert index.labels.tolist() == [3] and len(index.classes) == 4
    [refused] = index.skipped
    assert refused.path.endswith(":b") and "10000" in refused.reason and "classes.json" in refused.reason
    many = tuple(f"c{i}" for i in range(100_001))
    assert load_shards([str(tmp_path / "a.tar")], classes=many, cache=tmp_path / "cache").labels.tolist() == [3, 100000]


def test_a_repeated_member_or_a_second_image_of_a_key_is_listed(tmp_path):
    write_tar(tmp_path / "a.tar", [("a.jpg", b"a"), ("a.cls", b"0"), ("a.cls", b"1"),
                                   ("j.png", b"p"), ("j.jpg", b"j"), ("j.cls", b"1"),
                                   ("ok.jpg", b"o"), ("ok.cls", b"0")])
    index = load_shards([str(tmp_path / "a.tar")], cache=tmp_path / "cache")
    shard = str(tmp_path / "a.tar")
    assert list(index.paths) == [f"{shard}:j", f"{shard}:ok"] and index.read(0) == b"p"
    reasons = {s.path: s.reason for s in index.skipped}
    assert "'a.cls' more than once" in reasons[f"{shard}:a"]
    assert "second image" in reasons[f"{shard}:j.jpg"] and "'j.png'" in reasons[f"{shard}:j.jpg"]


def shard_of(path, labels: list[int], image: bytes = b"x") -> None:
    write_tar(path, [m for n, label in enumerate(labels) for m in ((f"k{n}.jpg", image), (f"k{n}.cls", b"%d" % label))])


@pytest.mark.parametrize("how", ["cp -p (new size, same mtime)", "mv (same size and mtime)"])
def test_a_shard_replaced_under_the_same_mtime_is_indexed_again(tmp_path, how):
    shard = tmp_path / "a.tar"
    shard_of(shard, [0] * 4)
    os.utime(shard, (1e9, 1e9))
    assert load_shards([str(shard)], cache=tmp_path / "cache").labels.tolist() == [0] * 4
    if how.startswith("cp"):
        shard_of(tmp_path / "new.tar", [1] * 6)
        shard.write_bytes((tmp_path / "new.tar").read_bytes())  # the same file, rewritten
    else:
        shard_of(tmp_path / "new.tar", [1] * 4)
        assert (tmp_path / "new.tar").stat().st_size == shard.stat().st_size
        os.replace(tmp_path / "new.tar", shard)
    os.utime(shard, (1e9, 1e9))
    expected = [1] * (6 if how.startswith("cp") else 4)
    assert load_shards([str(shard)], cache=tmp_path / "cache").labels.tolist() == expected


def test_a_classes_file_written_after_the_first_index_counts(tmp_path):
    shard = tmp_path / "a.tar"
    shard_of(shard, [0, 1])
    os.utime(shard, (1e9, 1e9))
    assert load_shards([str(shard)], cache=tmp_path / "cache").classes == ("0", "1")
    (tmp_path / "classes.json").write_text(json.dumps(["cat", "dog"]))
    os.utime(tmp_path / "classes.json", (1e9, 1e9))
    assert load_shards([str(shard)], cache=tmp_path / "cache").classes == ("cat", "dog")
    (tmp_path / "classes.json").write_text(json.dumps(["dog", "cat"]))
    os.utime(tmp_path / "classes.json", (1e9, 1e9))
    assert load_shards([str(shard)], cache=tmp_path / "cache").classes == ("dog", "cat")


def test_a_damaged_kept_shard_index_is_read_again(tmp_path, caplog):
    shard = tmp_path / "a.tar"
    shard_of(shard, [2, 0, 1])
    os.utime(shard, (1e9, 1e9))
    load_shards([str(shard)], cache=tmp_path / "cache")
    [kept] = (tmp_path / "cache" / "shards").iterdir()
    kept.write_bytes(kept.read_bytes().replace(b"[2, 0, 1]", b"[3, 0, 1]"))
    with caplog.at_level("WARNING"):
        index = load_shards([str(shard)], classes=("a", "b", "c", "d"), cache=tmp_path / "cache")
    assert index.labels.tolist() == [2, 0, 1] and any("damaged" in r.getMessage() for r in caplog.records)


def test_what_data_names_is_said_plainly(tmp_path):
    folder = tmp_path / "photos {2024}"  # an ImageFolder whose name holds a brace
    (folder / "cat").mkdir(parents=True)
    assert shard_paths(folder) is None
    upper = tmp_path / "upper"
    upper.mkdir()
    shard_of(upper / "A.TAR", [0])
    assert shard_paths(upper) == [str(upper / "A.TAR")] and shard_paths(upper / "A.TAR") == [str(upper / "A.TAR")]
    shard_of(tmp_path / "x.tar", [0])
    (tmp_path / "x.tar.gz").write_bytes(gzip.compress((tmp_path / "x.tar").read_bytes()))
    with pytest.raises(ValueError, match=r"compressed shards .* are not read.*stoker pack"):
        shard_paths(tmp_path / "x.tar.gz")
    gz_folder = tmp_path / "gz"
    gz_folder.mkdir()
    (gz_folder / "s-0.tar.gz").write_bytes((tmp_path / "x.tar.gz").read_bytes())
    with pytest.raises(ValueError, match="compressed shards"):
        shard_paths(gz_folder)
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00junk")
    with pytest.raises(ValueError, match="not UTF-8 text"):
        shard_paths(tmp_path / "binary")


def _npy(array: np.ndarray) -> bytes:
    stored = io.BytesIO()
    np.save(stored, array, allow_pickle=False)
    return stored.getvalue()


def test_a_npy_member_is_the_image_only_of_a_key_without_an_image_file_and_holding_pixels(tmp_path):
    """`stoker pack --raw-max-side` stores KEY.npy alone; beside KEY.jpg a .npy is another field (features, say),
    used by nothing and listed as nothing, whichever comes first; alone, an array that is not (H, W, 3) uint8 pixels
    (a WebDataset's features) is no image, as before .npy members were read: listed at indexing, not refused as a
    damaged image in training."""
    pixels = _npy(np.zeros((2, 3, 3), np.uint8))
    features = _npy(np.zeros(16, np.float32))
    write_tar(tmp_path / "a.tar", [("raw.npy", pixels), ("raw.cls", b"0"),
                                   ("both.npy", b"features"), ("both.jpg", b"jpeg"), ("both.cls", b"1"),
                                   ("jpeg.jpg", b"jpeg 2"), ("jpeg.npy", b"features 2"), ("jpeg.cls", b"1"),
                                   ("vector.npy", features), ("vector.cls", b"1")])
    index = load_shards([str(tmp_path / "a.tar")], cache=tmp_path / "cache")
    assert [index.read(i) for i in range(len(index))] == [pixels, b"jpeg", b"jpeg 2"]
    assert [s.reason for s in index.skipped] == ["no image member (found .cls, .npy)"]

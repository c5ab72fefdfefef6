"""Shards where they live: served by a real nginx (HTTP, Range) and a real S3 server (moto's) on loopback, read
through the same client code a user's run uses. Training from them gives bitwise the weights of training from the
same shards on local disk, across an interrupt and a resume and with a producer killed as it reads; three ranks
get equal batch counts over eight shards; and every failure is named."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from stoker.bench import servers
from tests.conftest import assert_same_weights, free_port, read_summary, run_cli, silent_server
from tests.integration.test_loader import launch

SETTINGS = ("--devices", "cpu:2", "--epochs", "2", "--seed", "5", "--producers", "2", "--batch-size", "8",
            "--image-size", "32", "--quiet")
SHARDS = "shard-{000000..000007}.tar"
BUCKET = "stoker-shards"


@pytest.fixture(scope="module")
def shards(textures, tmp_path_factory):
    """The texture set packed into 8 shards (train) and 3 (val), and the reference run on local disk."""
    train, val = textures
    root = tmp_path_factory.mktemp("remote")
    run_cli("pack", str(train), str(root / "train"), "--shard-size", "70KB", "--workers", "1")
    run_cli("pack", str(val), str(root / "val"), "--shard-size", "40KB", "--workers", "1")
    assert len(list((root / "train").glob("*.tar"))) == 8
    run_cli("train", "--data", str(root / "train" / SHARDS), "--val", str(root / "val"), "--out",
            str(root / "local"), *SETTINGS, env={"STOKER_CACHE": str(root / "cache")})
    return root


@pytest.fixture(scope="module")
def web(shards):
    if not os.path.exists(servers.NGINX):
        pytest.skip("nginx is not installed and could not be (make test installs Debian's nginx-light as root)")
    with servers.nginx(shards) as server:
        yield server


@pytest.fixture(scope="module")
def s3(shards):
    with servers.s3_server() as server:
        servers.upload_folder(server.url, BUCKET, shards / "train", "data/train/")
        servers.upload_folder(server.url, BUCKET, shards / "val", "data/val/")
        yield server


def val_shards(root) -> str:
    names = sorted(p.name for p in (root / "val").glob("*.tar"))
    return f"shard-{{{names[0][6:12]}..{names[-1][6:12]}}}.tar"


def test_http_shards_train_bitwise_like_local_disk_across_a_resume(shards, web, tmp_path):
    run = tmp_path / "http"
    stopped = run_cli("train", "--data", f"{web.url}/train/{SHARDS}", "--val", f"{web.url}/val/{val_shards(shards)}",
                      "--out", str(run), *SETTINGS, check=False,
                      env={"STOKER_CACHE": str(tmp_path / "cache"),
                           "STOKER_FAULT": "consumer:interrupt-parent:rank=0,step=5;"})
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    copies = tmp_path / "copies"  # the resumed part keeps local copies: its later epochs read from disk
    run_cli("train", "--resume", str(run), "--quiet", "--cache-dir", str(copies),
            env={"STOKER_CACHE": str(tmp_path / "cache")})
    made = list(copies.glob("*.tar"))  # filled in the background while the run trains: how many is the machine's
    assert made and not list(copies.glob(".*.part"))  # partial copies are removed when the run ends
    originals = {p.read_bytes() for p in [*(shards / "train").glob("*.tar"), *(shards / "val").glob("*.tar")]}
    assert all(copy.read_bytes() in originals for copy in made)
    summary = read_summary(run)
    assert summary["status"] == "completed" and 5 < summary["start_step"] < 16  # the resume is mid-epoch
    assert summary["duplicate_samples"] == 0 and summary["missing_samples"] == 0
    assert_same_weights(shards / "local", run)


def test_s3_shards_with_a_producer_killed_as_it_reads_train_bitwise_like_local_disk(shards, s3, tmp_path):
    once = tmp_path / "fired"
    run = tmp_path / "s3"
    run_cli("train", "--data", f"s3://{BUCKET}/data/train/{SHARDS}", "--val", f"s3://{BUCKET}/data/val/",
            "--out", str(run), *SETTINGS,
            env={**servers.s3_environment(s3.url), "STOKER_CACHE": str(tmp_path / "cache"),
                 "STOKER_FAULT": "producer:sigkill:shard-000003.tar:", "STOKER_FAULT_ONCE": str(once)})
    assert once.exists()  # the fault fired: a producer died holding a part
    summary = read_summary(run)
    assert summary["status"] == "completed"
    assert summary["duplicate_samples"] == 0 and summary["missing_samples"] == 0
    assert_same_weights(shards / "local", run)
    config = (run / "config.json").read_text()
    assert servers.S3_TEST_KEY not in config and "AWS_" not in config  # credentials stay in the environment


def test_s3_members_read_signed_or_unsigned_give_local_bytes_and_errors_name_the_object(shards, s3, tmp_path,
                                                                                        monkeypatch):
    """Ranged reads of S3 members go to URLs the store signs; a store set not to sign (AWS_SKIP_SIGNATURE, as for a
    public bucket, here with no keys at all) is read through obstore. Both give the bytes of the same members on
    local disk, and a member whose object is gone is named as the user named it: no signature or key in the
    message."""
    from stoker.data.pixels.imaging import UnusableImage
    from stoker.data.sources import load_source
    from stoker.data.transports import object_store

    for name, value in servers.s3_environment(s3.url).items():
        monkeypatch.setenv(name, value)
    servers.upload_folder(s3.url, BUCKET, shards / "train", "data/gone/", public=True)
    local = load_source(str(shards / "train" / SHARDS), cache=tmp_path / "cache")
    samples = range(0, len(local), 7)
    for prefix, skip_signature in (("data/train", False), ("data/gone", True)):
        monkeypatch.setattr(object_store, "_stores", {})  # a client made anew, as a new process makes it
        monkeypatch.setattr(object_store, "_unsigned_roots", {})
        monkeypatch.setenv("AWS_SKIP_SIGNATURE", str(skip_signature).lower())
        if skip_signature:  # and no keys to sign with
            monkeypatch.delenv("AWS_ACCESS_KEY_ID")
            monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        streamed = load_source(f"s3://{BUCKET}/{prefix}/{SHARDS}", cache=tmp_path / "cache")
        streamed.read_ahead(list(samples))
        assert [streamed.read(i) for i in samples] == [local.read(i) for i in samples]
        routed = object_store._request_url(f"s3://{BUCKET}/{prefix}/shard-000000.tar")  # where a read of it goes
        assert routed is None if skip_signature else routed.startswith(f"{s3.url}/{BUCKET}/{prefix}/shard-000000.tar?")
    monkeypatch.setenv("AWS_SKIP_SIGNATURE", "false")
    for name, value in servers.s3_environment(s3.url).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(object_store, "_stores", {})
    monkeypatch.setattr(object_store, "_unsigned_roots", {})
    gone = load_source(f"s3://{BUCKET}/data/gone/{SHARDS}", cache=tmp_path / "cache")
    servers.delete_prefix(s3.url, BUCKET, "data/gone/")
    with pytest.raises(UnusableImage) as error:
        gone.read(0)
    message = str(error.value)
    assert f"s3://{BUCKET}/data/gone/shard-000000.tar no longer exists" in message
    assert "X-Amz" not in message and servers.S3_TEST_KEY not in message


def test_three_ranks_over_eight_remote_shards_get_equal_batch_counts(shards, web, tmp_path):
    records = launch(tmp_path / "record", "--data", f"{web.url}/train/{SHARDS}", "--epochs", "1", world=3)
    assert records[0]["len"] == records[1]["len"] == records[2]["len"] == [5]  # ceil(120 / 24)
    assert records[0]["batches"] == records[1]["batches"] == records[2]["batches"] == [5]
    seen = [i for rank in records for _, ids in rank["ids"] for i in ids]
    assert sorted(seen) == list(range(120))


def test_a_missing_shard_is_named_before_any_process_starts(shards, web, tmp_path):
    result = run_cli("train", "--data", f"{web.url}/train/shard-{{000000..000008}}.tar", "--out", str(tmp_path / "r"),
                     "--quiet", check=False, env={"STOKER_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{web.url}/train/shard-000008.tar: no such object" in result.stderr
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_a_shard_replaced_during_the_run_is_named_not_read_at_old_offsets(shards, tmp_path):
    from stoker.data.pixels.imaging import UnusableImage
    from stoker.data.sources import load_source

    served = tmp_path / "served"
    shutil.copytree(shards / "train", served)
    (served / "index.json").unlink()  # each shard is fetched whole and indexed, as shards not made by `stoker pack`
    with servers.nginx(served) as server:
        index = load_source(f"{server.url}/{SHARDS}", cache=tmp_path / "cache")
        assert len(index.read(0)) > 0
        first = served / "shard-000000.tar"
        time.sleep(1.1)  # nginx's ETag is the modification time (seconds) and the size
        first.write_bytes(first.read_bytes())
        with pytest.raises(UnusableImage, match=r"shard-000000\.tar changed during the run"):
            index.read(0)


def test_a_server_that_stops_answering_makes_samples_unreadable_not_a_hang(shards, tmp_path):
    from stoker.data.pixels.imaging import UNREADABLE, UnusableImage
    from stoker.data.sources import load_source

    with servers.nginx(shards / "train") as server:
        index = load_source(f"{server.url}/{SHARDS}", cache=tmp_path / "cache")
    started = time.monotonic()
    with pytest.raises(UnusableImage, match=UNREADABLE) as error:
        index.read(0)
    assert "retries" in str(error.value) and time.monotonic() - started < 120  # bounded by the retry timeout


def test_the_cache_folder_holds_copies_within_its_size_and_serves_without_the_server(shards, tmp_path):
    from stoker.data.sources import load_source
    from stoker.data.transports.object_store import LocalCopies

    sizes = sorted(p.stat().st_size for p in (shards / "train").glob("*.tar"))
    limit = sum(sizes[:5])
    copies = LocalCopies(tmp_path / "copies", limit)
    with servers.nginx(shards / "train") as server:
        index = load_source(f"{server.url}/{SHARDS}", cache=tmp_path / "cache", copies=copies)
        expected = [index.read(i) for i in range(len(index))]
        copies.fill(index.remote_shards(), lambda: True)
        held = [p for p in copies.folder.iterdir() if not p.name.startswith(".")]
        assert 0 < len(held) < 8 and sum(p.stat().st_size for p in held) <= limit
        whole = LocalCopies(tmp_path / "whole", 10**9)
        whole.fill(index.remote_shards(), lambda: True)
    served = LocalCopies(whole.folder, whole.limit)
    assert [index.reading_copies(served).read(i) for i in range(len(index))] == expected  # nginx has stopped


def test_a_run_reads_the_pack_index_instead_of_fetching_every_shard(shards, web, tmp_path, monkeypatch):
    from stoker.data.sources import load_source
    from stoker.data.transports import object_store

    def fetch_whole(*args, **kwargs):
        raise AssertionError("a shard was fetched whole to index it")

    local = load_source(shards / "train" / SHARDS, cache=tmp_path / "local")
    monkeypatch.setattr(object_store, "download", fetch_whole)
    index = load_source(f"{web.url}/train/{SHARDS}", cache=tmp_path / "cache")
    assert index.labels.tolist() == local.labels.tolist() and len(index) == 120
    assert [index.read(i) for i in range(len(index))] == [local.read(i) for i in range(len(local))]


def test_a_server_that_hangs_makes_a_read_unreadable_within_the_producer_timeout():
    """A server that takes the connection and never answers: the read gives up (retries included) well inside
    the producer timeout's default of 20 s, so the producer is never taken for hung and the file never blamed."""
    from stoker.data.pixels.imaging import UNREADABLE, UnusableImage
    from stoker.data.transports import object_store

    with silent_server() as port:
        started = time.monotonic()
        with pytest.raises(UnusableImage, match=UNREADABLE):
            object_store.read_range(f"http://127.0.0.1:{port}/shard.tar", '"v1"', 0, 100)
        assert time.monotonic() - started < 20  # bounded by the client's deadline (14 s), not by this machine


def test_pack_index_entries_that_do_not_describe_the_object_are_not_trusted(shards, tmp_path, monkeypatch):
    """An entry of another size, one with a label that is no integer, one placing a member past the shard's end:
    those three shards are fetched whole and indexed; the others come from index.json. Same samples either way."""
    import json

    from stoker.data.sources import load_source
    from stoker.data.transports import object_store

    served = tmp_path / "served"
    shutil.copytree(shards / "train", served)
    index_file = served / "index.json"
    pack_index = json.loads(index_file.read_text())
    entries = pack_index["shards"]
    entries["shard-000000.tar"]["size"] += 512
    entries["shard-000001.tar"]["labels"][0] = "x"
    entries["shard-000002.tar"]["starts"][0] = 10**12
    index_file.write_text(json.dumps(pack_index))
    fetched: list[str] = []
    download = object_store.download

    def counted(url, *args, **kwargs):
        fetched.append(url.rsplit("/", 1)[1])
        return download(url, *args, **kwargs)

    monkeypatch.setattr(object_store, "download", counted)
    local = load_source(shards / "train" / SHARDS, cache=tmp_path / "local")
    with servers.nginx(served) as server:
        index = load_source(f"{server.url}/{SHARDS}", cache=tmp_path / "cache")
        assert sorted(fetched) == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
        assert index.labels.tolist() == local.labels.tolist()
        assert [index.read(i) for i in range(len(index))] == [local.read(i) for i in range(len(local))]


def test_pack_uploads_to_an_s3_prefix_that_reads_like_the_local_pack(textures, shards, s3, tmp_path, monkeypatch):
    from stoker.data.sources import load_source

    env = servers.s3_environment(s3.url)
    out = f"s3://{BUCKET}/packed"
    result = run_cli("pack", str(textures[0]), out, "--shard-size", "70KB", "--workers", "1", env=env)
    assert f"--data '{out}/{SHARDS}'" in result.stdout
    again = run_cli("pack", str(textures[0]), out, "--shard-size", "70KB", "--workers", "1", env=env, check=False)
    assert again.returncode == 2 and "holds 10 object(s) already" in again.stderr  # 8 shards, classes and index
    local = load_source(shards / "train" / SHARDS, cache=tmp_path / "local")
    for key, value in env.items():  # this process reads the store the way a run does
        monkeypatch.setenv(key, value)
    index = load_source(f"{out}/{SHARDS}", cache=tmp_path / "cache")
    assert index.classes == local.classes and index.labels.tolist() == local.labels.tolist()
    assert [index.read(i) for i in range(len(index))] == [local.read(i) for i in range(len(local))]


def test_an_s3_store_at_an_http_endpoint_needs_only_the_endpoint_and_a_deleted_object_is_named(textures, shards, s3,
                                                                                              tmp_path, monkeypatch):
    """As boto3 does, the endpoint's scheme is followed: `pack` and a load work with AWS_ENDPOINT_URL_S3 (or
    AWS_ENDPOINT_URL) at http:// and no AWS_ALLOW_HTTP. A member read through obstore (a store set to send requester
    pays) whose object was deleted is named as the user named it, not by obstore's text; an endpoint that is no URL,
    or one where nothing answers, is named with what to change."""
    from stoker.data.pixels.imaging import UnusableImage
    from stoker.data.sources import load_source
    from stoker.data.transports import object_store

    env = {**servers.s3_environment(s3.url), "AWS_ENDPOINT_URL_S3": s3.url}
    del env["AWS_ALLOW_HTTP"], env["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ALLOW_HTTP", raising=False)
    out = f"s3://{BUCKET}/plain-http"
    run_cli("pack", str(textures[0]), out, "--shard-size", "70KB", "--workers", "1", env=env)
    for key, value in {**env, "AWS_REQUEST_PAYER": "true"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(object_store, "_stores", {})
    local = load_source(shards / "train" / SHARDS, cache=tmp_path / "local")
    index = load_source(f"{out}/{SHARDS}", cache=tmp_path / "cache")
    assert object_store._request_url(f"{out}/shard-000000.tar") is None  # read through obstore
    assert [index.read(i) for i in range(0, len(index), 9)] == [local.read(i) for i in range(0, len(local), 9)]
    servers.delete_prefix(s3.url, BUCKET, "plain-http/")
    with pytest.raises(UnusableImage) as error:
        index.read(0)
    assert str(error.value) == f"unreadable: {out}/shard-000000.tar no longer exists"
    monkeypatch.setattr(object_store, "_stores", {})
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.url.removeprefix("http://"))
    with pytest.raises(ValueError, match=r"AWS_ENDPOINT_URL_S3='127\.0\.0\.1:\d+': expected the store's URL"):
        object_store.stat(f"{out}/other.tar")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ValueError, match="is that the store's address, and is it up?"):
        object_store.stat(f"{out}/another.tar")


def test_parquet_files_under_an_s3_prefix_read_as_written(textures, s3, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stoker.data.sources import load_source

    images = sorted((textures[0] / "0_horizontal").iterdir())[:6]
    folder = tmp_path / "parquet"
    folder.mkdir()
    for part in range(2):
        rows = images[part * 3:part * 3 + 3]
        pq.write_table(pa.table({"image": [p.read_bytes() for p in rows], "label": [part] * 3}),
                       folder / f"train-{part}.parquet")
    servers.upload_folder(s3.url, BUCKET, folder, "parquet/")
    for key, value in servers.s3_environment(s3.url).items():
        monkeypatch.setenv(key, value)
    index = load_source(f"s3://{BUCKET}/parquet/", cache=tmp_path / "cache")
    assert index.labels.tolist() == [0, 0, 0, 1, 1, 1]
    assert [index.read(i) for i in range(6)] == [p.read_bytes() for p in images]


def test_two_runs_filling_one_cache_folder_stay_within_its_size(shards, tmp_path):
    """Two fillers at once (each as a run's would), in opposite orders, into one folder that holds 5 of the 8
    shards: every copy is whole, nothing is left half-written, and the folder never ends over its size."""
    import threading

    from stoker.data.sources import load_source
    from stoker.data.transports.object_store import LocalCopies

    sizes = sorted(p.stat().st_size for p in (shards / "train").glob("*.tar"))
    originals = {p.read_bytes() for p in (shards / "train").glob("*.tar")}
    with servers.nginx(shards / "train") as server:
        index = load_source(f"{server.url}/{SHARDS}", cache=tmp_path / "cache")
        wanted = index.remote_shards()
        runs = [LocalCopies(tmp_path / "copies", sum(sizes[:5])) for _ in range(2)]
        fillers = [threading.Thread(target=copies.fill, args=(order, lambda: True))
                   for copies, order in zip(runs, (wanted, wanted[::-1]))]
        for filler in fillers:
            filler.start()
        for filler in fillers:
            filler.join()
    held = list((tmp_path / "copies").iterdir())
    copies = [p for p in held if not p.name.startswith(".")]
    assert copies and all(p.read_bytes() in originals for p in copies)
    assert sorted(p.name for p in held if p.name.startswith(".")) == [".lock", ".stoker-copies.json"]
    assert sum(p.stat().st_size for p in copies) <= sum(sizes[:5])


@pytest.mark.parametrize("cache_size", ["300KB", None])
def test_a_cache_folder_holding_the_users_files_never_removes_or_counts_them(shards, tmp_path, cache_size):
    """--cache-dir pointed at a folder of the user's: making room for copies removes only copies stoker wrote
    (and named in its ledger), with --cache-size below what the user's files hold, and with the default size
    (here the user's file claims more than the disk: a sparse file counted as held made the old default evict it,
    and a copy of any name but one stoker recorded is left alone)."""
    from stoker.common.config import DataSettings
    from stoker.data.sources import load_source, local_copies
    from stoker.data.transports.object_store import LocalCopies

    folder = tmp_path / "mine"
    folder.mkdir()
    users = {f"photo-{i}.jpg": os.urandom(200 << 10) for i in range(3)}
    for name, data in users.items():
        (folder / name).write_bytes(data)
    with open(folder / "0123456789abcdef0123456789abcdef.shard-000000.tar", "wb") as big:  # a name like a copy's
        big.truncate(2 * shutil.disk_usage(folder).total)  # sparse: claims more than the disk, takes nothing
    with servers.nginx(shards / "train") as server:
        index = load_source(f"{server.url}/{SHARDS}", cache=tmp_path / "cache")
        copies = local_copies(folder, DataSettings(cache_dir=folder, cache_size=cache_size).cache_bytes)
        assert isinstance(copies, LocalCopies)
        for _ in range(2):  # again: the second filling evicts the first's copies for its own, in another order
            copies.fill(index.remote_shards()[::-1] if _ else index.remote_shards(), lambda: True)
    for name, data in users.items():
        assert (folder / name).read_bytes() == data
    assert (folder / "0123456789abcdef0123456789abcdef.shard-000000.tar").stat().st_size > 1 << 30
    made = [p for p in folder.glob("*.tar") if p.stat().st_size < 1 << 30]
    if cache_size is None:
        assert len(made) == 8
    else:
        assert 0 < len(made) < 8 and sum(p.stat().st_size for p in made) <= 300_000


def test_the_latency_proxy_adds_its_round_trip_and_passes_bytes_ends_and_refusals_on(shards, web):
    """The stand-in network `stoker bench remote` measures through: each answer comes one round trip late or more
    (a lower bound: a loaded machine only adds), byte for byte what nginx sends, also after the client half-closes;
    a server that refuses the connection closes the client's."""
    import http.client
    import socket

    shard = shards / "train" / "shard-000003.tar"
    data = shard.read_bytes()
    proxy = servers.latency_proxy(web.port, 200)
    try:
        connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        for start in (0, 1000, len(data) - 700):
            began = time.monotonic()
            connection.request("GET", "/train/shard-000003.tar", headers={"Range": f"bytes={start}-{start + 599}"})
            assert connection.getresponse().read() == data[start:start + 600]
            assert time.monotonic() - began >= 0.2
        connection.request("GET", "/train/shard-000003.tar")  # the same connection, kept alive
        assert connection.getresponse().read() == data
        connection.close()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as half:
            half.sendall(b"GET /train/shard-000003.tar HTTP/1.0\r\n\r\n")
            half.shutdown(socket.SHUT_WR)  # the request is all sent; the answer must still come back
            answer = b"".join(iter(lambda: half.recv(1 << 16), b""))
        assert answer.endswith(data) and answer.startswith(b"HTTP/1.1 200")
    finally:
        proxy.close()
    closed = socket.socket()  # a port held, never listened on: connections to it are refused
    closed.bind(("127.0.0.1", 0))
    nowhere = servers.latency_proxy(closed.getsockname()[1], 50)
    try:
        with socket.create_connection(("127.0.0.1", nowhere.port), timeout=30) as refused:
            refused.sendall(b"GET / HTTP/1.0\r\n\r\n")
            try:
                assert refused.recv(100) == b""
            except ConnectionResetError:
                pass
    finally:
        nowhere.close()
        closed.close()

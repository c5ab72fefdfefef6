"""What processes send each other (real gloo groups): tensors and JSON only, nothing is ever unpickled, and each
rank's checkpoint state goes to rank 0 only."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from stoker.bench.group import run_group
from stoker.common import checkpoint
from stoker.run import cluster
from stoker.training import exchange, wire

CPU = torch.device("cpu")


def _state(rank: int) -> dict:
    """A replica's state as a consumer checkpoints it: an AdamW state dict (int keys, tuples, floats, None, bools),
    the RNG state, int and bool tensors, an empty tensor."""
    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01 * (rank + 1))
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return {"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
            "pending": torch.tensor((rank, 0)), "flag": torch.tensor(True), "empty": torch.empty(0, 3),
            "note": ("rank", rank, 0.5, None)}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _watch_unpickling() -> list[str]:
    """Every global an unpickler looks up in this process (what any pickle of a tensor, an array or an exploit
    needs), as Python's audit events report it."""
    seen: list[str] = []
    sys.addaudithook(lambda event, args: seen.append(f"{args[0]}.{args[1]}") if event == "pickle.find_class"
                     else None)
    return seen


def _all_ok(ok: bool) -> bool:
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


def _machines_exchange(rank: int, world: int) -> dict:
    unpickled = _watch_unpickling()
    machines = cluster.Cluster(rank, world, 1)
    settings = cluster.from_leader(machines, _state(0) if rank == 0 else None)
    gathered = cluster.gather_to_leader(machines, _state(rank))
    ok = _same(settings, _state(0)) and not unpickled
    if rank == 0:
        ok = ok and len(gathered) == world and all(_same(gathered[r], _state(r)) for r in range(world))
    else:
        ok = ok and gathered is None
    return {"all_ok": _all_ok(ok), "unpickled": unpickled}


def test_machines_exchange_settings_and_accounting_without_unpickling_anything():
    result = run_group(_machines_exchange, 3, (), timeout_s=60)
    assert result["unpickled"] == []  # before: broadcast_object_list / gather_object unpickled torch's globals
    assert result["all_ok"]


def _checkpoint_round_trip(rank: int, world: int, folder: str) -> dict:
    unpickled = _watch_unpickling()
    store = dist.FileStore(os.path.join(folder, "store"), world)
    alive = lambda: None  # noqa: E731 - never told to stop here
    sent = []
    real_send = dist.send
    dist.send = lambda tensor, dst, *a, **k: (sent.append((dst, tensor.device, k.get("group"))),
                                              real_send(tensor, dst, *a, **k))
    # On GPUs the states travel on a gloo side group, on the host, not through NCCL: the consumer passes it.
    side = dist.new_group(backend="gloo")
    save = exchange.RankZeroWork(store, "save", 30.0, alive)
    files = exchange.save(save, Path(folder), {"w": torch.ones(2)} if rank == 0 else {}, _state(rank), rank, world,
                          group=side)
    resume = exchange.RankZeroWork(store, "resume", 30.0, alive)
    model = exchange.load_model(resume, Path(folder), rank)
    mine = exchange.hand_out(resume, Path(folder), rank, world, group=side)
    dist.send = real_send
    ok = _same(mine, _state(rank)) and (model is None) == (rank != 0) and not unpickled
    saved = sent if rank != 0 else []
    ok = ok and all(dst == 0 for dst, _, _ in saved)  # a rank's state goes to rank 0, and nowhere else
    ok = ok and all(device == CPU and group is side for _, device, group in sent)
    if rank == 0:
        ok = ok and sorted(files) == ["model.pt", *(checkpoint.rank_file(r) for r in range(world))]
    return {"all_ok": _all_ok(ok), "files": files, "unpickled": unpickled}


def test_each_rank_state_goes_to_rank_0_only_and_comes_back_to_its_rank_on_resume(tmp_path):
    result = run_group(_checkpoint_round_trip, 3, (str(tmp_path),), timeout_s=60)
    assert result["all_ok"]
    for rank in range(3):  # each file holds that rank's state, as torch.load(weights_only=True) reads it
        assert _same(checkpoint.load_verified(tmp_path / checkpoint.rank_file(rank)), _state(rank))


class _Exploit:
    def __reduce__(self):
        return (os.system, ("true",))


def test_values_that_are_not_tensors_or_json_are_refused_before_sending():
    for value in (_Exploit(), {"a": {1, 2}}, [b"bytes"], {"path": Path("/tmp")}):
        with pytest.raises(wire.WireError, match="cannot send"):
            wire.pack(value)


def test_a_pickle_received_as_a_message_is_refused_without_being_unpickled():
    unpickled = _watch_unpickling()
    payload = pickle.dumps(_Exploit())
    framed = torch.cat([torch.tensor([len(payload)]).view(torch.uint8), torch.frombuffer(bytearray(payload),
                                                                                          dtype=torch.uint8)])
    with pytest.raises(wire.WireError, match="not a stoker message"):
        wire.unpack(framed)
    forged = b'{"tree": {"x": 0}, "tensors": [["object", [1]]]}'  # a dtype that is not a tensor dtype
    with pytest.raises(wire.WireError):
        wire.unpack(torch.cat([torch.tensor([len(forged)]).view(torch.uint8),
                               torch.frombuffer(bytearray(forged), dtype=torch.uint8)]))
    assert unpickled == []


def test_values_round_trip_exactly_with_their_types():
    for rank in range(2):
        assert _same(wire.unpack(wire.pack(_state(rank))), _state(rank))
    assert wire.unpack(wire.pack({1: "int key", "1": "str key", (1, 2): [(), []]})) == \
        {1: "int key", "1": "str key", (1, 2): [(), []]}

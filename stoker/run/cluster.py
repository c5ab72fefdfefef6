"""Several machines: one controller per machine, launched by torchrun, all consumers in one process group.

torchrun starts one stoker controller per machine (`--nproc-per-node 1`); its RANK is the machine's index. The
controllers form a small gloo group of their own (env://, from torchrun's MASTER_ADDR and MASTER_PORT) that is used
only at the edges of the run: to agree on the settings and the resume point, to hand every consumer the address
of the consumers' store, and to gather what every machine acknowledged for the global exactly-once check. During
the run, machines talk only through their consumers' averaging collective, and through the consumers' store when
one of them is interrupted (`StopAgreement`).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stoker.training import wire
from stoker.training.rendezvous import StoreAddress

log = logging.getLogger(__name__)

CPU = torch.device("cpu")  # the controllers' group is gloo


@dataclass(frozen=True)
class Cluster:
    node: int  # this machine's index
    nodes: int
    local_consumers: int

    @property
    def first_rank(self) -> int:
        """Global rank of this machine's first consumer: machines hold consecutive blocks of ranks."""
        return self.node * self.local_consumers

    @property
    def world(self) -> int:
        return self.nodes * self.local_consumers

    @property
    def leader(self) -> bool:
        """The machine that writes checkpoints, the summary and the report."""
        return self.node == 0

    @property
    def multi(self) -> bool:
        return self.nodes > 1


def from_environment(local_consumers: int) -> Cluster:
    """One machine, unless torchrun says otherwise; a torchrun launch that is not one controller per machine is
    refused before anything starts."""
    nodes = int(os.environ.get("WORLD_SIZE", "1"))
    if nodes == 1:
        return Cluster(0, 1, local_consumers)
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) != 1:
        raise ValueError("torchrun started several stoker controllers on one machine; use --nproc-per-node 1 "
                         "(stoker starts one consumer per device itself)")
    return Cluster(int(os.environ["RANK"]), nodes, local_consumers)


def join_controllers(cluster: Cluster, timeout_s: float) -> None:
    if cluster.multi and not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://", rank=cluster.node, world_size=cluster.nodes,
                                timeout=datetime.timedelta(seconds=timeout_s))


def leave_controllers() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# Machines exchange tensors and JSON only (`wire`): a pickle from another machine would run its code here.

def from_leader(cluster: Cluster, value: Any) -> Any:
    """The leader's `value` on every machine (`value` is ignored elsewhere)."""
    if not cluster.multi:
        return value
    return wire.broadcast(value, 0, CPU)


def gather_to_leader(cluster: Cluster, value: Any) -> list[Any] | None:
    """Every machine's `value`, in machine order, on the leader (each sends its own to the leader only); None
    elsewhere."""
    if not cluster.multi:
        return [value]
    if not cluster.leader:
        wire.send(value, 0, CPU)
        return None
    return [value, *(wire.recv(node, CPU) for node in range(1, cluster.nodes))]


def check_same_settings(cluster: Cluster, settings: dict[str, Any]) -> None:
    """Every machine must train the same thing on the same number of consumers with the same data. Compared
    against the first machine's by broadcast (gloo's all_gather leaves its threads busy afterwards)."""
    if not cluster.multi:
        return
    leader = from_leader(cluster, settings)
    differing = sorted(k for k in set(settings) | set(leader) if settings.get(k) != leader.get(k))
    flag = torch.tensor([1 if differing else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if differing:
        raise ValueError(f"machine {cluster.node} differs from machine 0 in {', '.join(differing)}; every machine "
                         "needs the same settings, devices per machine and data")
    if flag.item():
        raise ValueError("another machine's settings differ from machine 0's (its log names them); every machine "
                         "needs the same settings, devices per machine and data")


class StopAgreement:
    """Where every machine stops when any of them is interrupted. The interrupted machine raises a flag in the
    consumers' store (served by the first machine); every machine polls it, stops issuing rows of work when it is
    raised and posts the furthest row it has started; once all have posted, every machine stops after the
    furthest. So every consumer reaches the same last step, the same checkpoint and the same final average."""

    POLL_S = 0.2  # a round trip to the first machine; often enough to stop within a few steps

    def __init__(self, cluster: Cluster, store: dist.Store) -> None:
        self.cluster = cluster
        self.store = dist.PrefixStore("stoker-stop/", store)
        self.row: int | None = None  # the row every machine stops after, once agreed
        self._requested = False
        self.posted = False  # this machine's row is in the store
        self._next_poll = 0.0

    @classmethod
    def join(cls, cluster: Cluster, leader_store: dist.Store | None, address: StoreAddress,
             timeout_s: float) -> StopAgreement:
        """On the first machine, over its own store; elsewhere as a client of it."""
        if leader_store is not None:
            return cls(cluster, leader_store)
        assert address.host is not None and address.port is not None, "other machines reach the leader over TCP"
        store = dist.TCPStore(address.host, address.port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        return cls(cluster, store)

    def request(self) -> None:
        if not self._requested:
            self._set("requested", str(self.cluster.node))
            self._requested = True

    def requested(self) -> bool:
        """Whether any machine asked to stop (polled at most every POLL_S)."""
        if not self._requested and self._due():
            self._requested = self._check(["requested"])
        return self._requested

    def post(self, row: int) -> None:
        self._set(f"row/{self.cluster.node}", str(row))
        self.posted = True

    @property
    def waiting(self) -> bool:
        """Asked to stop, but the row is not agreed yet: nothing may be finished before it is."""
        return self._requested and self.row is None

    def poll_row(self) -> int | None:
        """The agreed row, once every machine has posted its own."""
        keys = [f"row/{node}" for node in range(self.cluster.nodes)]
        if self.row is None and self._due() and self._check(keys):
            self.row = max(int(self.store.get(key)) for key in keys)
        return self.row

    # A store that cannot be reached means the first machine has finished, or died, which its consumers'
    # collective reports on every machine: there is nothing left to agree on, and no reason to fail here.

    def _check(self, keys: list[str]) -> bool:
        try:
            return self.store.check(keys)
        except RuntimeError:
            return False

    def _set(self, key: str, value: str) -> None:
        try:
            self.store.set(key, value)
        except RuntimeError as error:
            log.warning("could not tell the other machines where to stop: %s", error)

    def _due(self) -> bool:
        now = time.monotonic()
        if now < self._next_poll:
            return False
        self._next_poll = now + self.POLL_S
        return True


def gather_accounting(cluster: Cluster, stats: Any, final_digests: dict[int, str]) -> str | None:
    """Bring every machine's accounting (`observe.metrics.RunStats`) and replica digests to the first one:
    exactly-once is checked over the union. Returns an error when a machine could not report."""
    try:
        parts = gather_to_leader(cluster, (stats.export(), final_digests))
        for other_stats, digests in (parts or [])[1:]:
            stats.merge(other_stats)
            final_digests.update(digests)
    except RuntimeError as error:  # a machine stopped before the end: its peers' collective says so
        log.error("could not gather the other machines' accounting: %s", error)
        return f"a machine stopped before reporting its accounting ({error})"
    except (ValueError, TypeError, KeyError) as error:  # a machine sent accounting of another shape
        log.error("another machine's accounting could not be merged: %s", error)
        return f"a machine sent accounting that could not be merged ({type(error).__name__}: {error})"
    return None

"""Several machines: one controller per machine, launched by torchrun, all consumers in one process group.

torchrun starts one stoker controller per machine (`--nproc-per-node 1`); its RANK is the machine's index. The
controllers form a small gloo group of their own (env://, from torchrun's MASTER_ADDR and MASTER_PORT) that is used
only at the edges of the run: to agree on the settings and the resume point, to hand every consumer the address
of the consumers' store, and to gather what every machine acknowledged for the global exactly-once check. During
the run, machines talk only through their consumers' averaging collective.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"


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


def from_leader(cluster: Cluster, value: Any) -> Any:
    """The leader's `value` on every machine (`value` is ignored elsewhere)."""
    if not cluster.multi:
        return value
    box = [value if cluster.leader else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_leader(cluster: Cluster, value: Any) -> list[Any] | None:
    """Every machine's `value`, in machine order, on the leader; None elsewhere."""
    if not cluster.multi:
        return [value]
    gathered = [None] * cluster.nodes if cluster.leader else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


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

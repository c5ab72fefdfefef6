"""A consumer's start-up, told to the controller phase by phase: a consumer that hangs before its first step
(an NCCL initialization that never returns in a container, an inductor worker pool that never starts) is then
ended by the controller's `StartupWatch`, naming the phase it hung in, instead of being waited on forever.

One consumer per process: `begin` keeps its outbox; the phases are reported from the functions that do them."""

from __future__ import annotations

from typing import Any

from stoker.common import faults
from stoker.pipeline.messages import StartupPhase

STARTING = "starting (its process, torch)"
STORE = "connecting to the run's store"
GROUP = "joining the process group (torch.distributed's init: NCCL's on GPUs)"
BUILDING = "building the model and its optimizer"
COMPILING = "compiling the model (torch.compile's warm-up)"
PEERS_COMPILING = "waiting for the other consumers to compile"
RESTORING = "reading the checkpoint it resumes from"
INITIAL_STATE = "receiving the initial weights (the group's first collective)"
# Allowed the compile allowance on top: a cold compile takes minutes, and a checkpoint's read may take longer than
# the collective timeout (its peers wait for it outside any collective)
LONG_PHASES = (COMPILING, PEERS_COMPILING, RESTORING)
STARTED = "started"  # ready for its first batch: the start-up is over

_reporter: tuple[Any, int] | None = None  # (the outbox, this consumer's local rank)


def begin(outbox: Any, rank: int) -> None:
    global _reporter
    _reporter = (outbox, rank)
    phase(STARTING)


def phase(name: str) -> None:
    """Tell the controller this consumer is now doing `name` (nothing outside a consumer process)."""
    if _reporter is None:
        return
    outbox, rank = _reporter
    outbox.send(StartupPhase(rank, name))
    if faults.armed():  # "consumer-start:hang:rank=0,phase=joining the process group"
        faults.maybe_inject("consumer-start", f"rank={rank},phase={name};")


def end() -> None:
    global _reporter
    phase(STARTED)
    _reporter = None

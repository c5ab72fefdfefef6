"""A consumer's side of a peer's death: the state every replica agreed on, whether an error is the group's or the
consumer's own, and the messages of a regroup.

After every completed averaging all replicas hold the same weights: that state (weights, optimizer, EMA, RNG, the
averager's counters) is copied aside, the last two of them. When a peer dies the collective in flight fails or
never ends, so a step that was in progress is never half-applied: every survivor goes back to the newest state
they all reached (the controller takes the oldest of the survivors' newest, which each of them holds) and the
controller plans the rest of the epoch again for the survivors (`run/membership.py`). Two copies are enough: a
survivor may have completed one averaging more than another (the dead peer's part arrived at one and not at the
other), never two, since the next averaging needs every peer.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Errors a collective raises when a peer is gone or stuck (gloo's socket errors, NCCL's, torch's own timeouts).
_GROUP_ERROR_TEXT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out",
                     "timed out", "Socket Timeout")


# How often a consumer waiting in a gloo collective looks whether the controller is forming a new group.
WATCH_S = 0.05
_WAIT_TIMED_OUT = "Operation timed out"  # what gloo's Work.wait(timeout) raises when the work is not done yet


@dataclass
class _Watch:
    check: Callable[[], None] | None = None  # raises GroupLost once the controller forms a new group
    timeout_s: float = 0.0


_watch = _Watch()


def watch_group(check: Callable[[], None] | None, timeout_s: float) -> None:
    """From now on, `done` waits in steps of WATCH_S and calls `check` between them (None: plain waits)."""
    _watch.check, _watch.timeout_s = check, timeout_s


def done(work: Any) -> None:
    """Wait for an asynchronous collective. Watched (gloo, elastic), a consumer does not sit in a collective a
    peer's death left half-joined: gloo raises only for the peers whose connection closed, and the others would
    wait for the whole timeout; between short waits it sees the controller's new generation and leaves."""
    if _watch.check is None:
        work.wait()
        return
    deadline = time.monotonic() + _watch.timeout_s
    while True:
        try:
            work.wait(timeout=timedelta(seconds=WATCH_S))
            return
        except RuntimeError as error:
            if _WAIT_TIMED_OUT not in str(error):
                raise
        _watch.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"Timed out after {_watch.timeout_s:g} s waiting for the group's collective")


def all_reduce(tensor: torch.Tensor, op: Any = None) -> None:
    """`dist.all_reduce`, waited for by `done`."""
    done(dist.all_reduce(tensor, async_op=True) if op is None else dist.all_reduce(tensor, op=op, async_op=True))


# Where in gloo's sources an error was raised ("[/__w/pytorch/.../gloo/transport/tcp/pair.cc:537] "): no news to a user.
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")


def in_brief(error: BaseException, limit: int = 200) -> str:
    """An error of the group as a person reads it in a log line: its first line without gloo's source location,
    its first sentence (gloo adds "This is typically caused by ..."), never cut mid-word."""
    lines = str(error).splitlines()
    text = _SOURCE_LOCATION.sub("", lines[0]) if lines else type(error).__name__
    sentence = text.split(". ", 1)[0]
    return sentence if len(sentence) <= limit else sentence[:limit].rsplit(" ", 1)[0] + " ..."


def all_arrive(store: dist.Store, world_size: int, check: Callable[[], None], timeout_s: float) -> None:
    """Before a new group forms (init_process_group, which waits for every member until the collective timeout):
    each member counts itself in under the group's fresh prefix and waits, in short steps that call `check` (it
    raises once the controller moves on), until all have. A member that dies meanwhile never arrives; the
    controller forms a group again without it, and the others leave this one at once. (A death between the last
    arrival and the group's forming is not seen so: the collective timeout remains the bound there.) The count is
    kept in the store, not through a store of Python's, which gloo's threads would call back into."""
    store.add("arrived", 1)
    deadline = time.monotonic() + timeout_s
    while store.add("arrived", 0) < world_size:
        check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"Timed out after {timeout_s:g} s waiting for the new group's members")
        time.sleep(WATCH_S)


class GroupLost(Exception):
    """The controller formed a new group (`generation` moved on): whatever this consumer was doing is void."""


def is_group_error(error: BaseException) -> bool:
    """Whether `error` came from the group (a peer died or hung), not from this consumer's own work."""
    if isinstance(error, GroupLost | getattr(dist, "DistError", GroupLost)):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _GROUP_ERROR_TEXT)


@dataclass(frozen=True)
class Stranded:
    """Consumer -> controller: the group broke; this consumer holds the agreed state after `agreed_step` (and the
    one before it) and waits for a `Regroup`."""

    rank: int  # the consumer's index on this machine, as in every report
    generation: int
    agreed_step: int
    reason: str


@dataclass(frozen=True)
class Joining:
    """Consumer -> controller: a consumer started again after its death is ready to join at the next regroup."""

    rank: int  # the consumer's index on this machine


@dataclass(frozen=True)
class Regroup:
    """Controller -> consumer: go back to the state after `agreed_step` and join group `generation` as `rank` of
    `world_size`. Everything before it on the ready queue belongs to the old group and is dropped. `fresh`: ranks
    started again, which hold no state and get `source`'s after the group forms."""

    generation: int
    rank: int
    world_size: int
    agreed_step: int
    fresh: tuple[int, ...] = ()
    source: int = 0


class AgreedStates:
    """The last two agreed states, as copies into buffers that are reused (a copy per averaging, no allocation
    once both exist). `capture()` returns the state as nested dicts and lists of tensors and plain values."""

    def __init__(self, capture: Callable[[], dict[str, Any]]) -> None:
        self.capture = capture
        self.kept: list[tuple[int, dict[str, Any]]] = []  # (global step it follows, state), oldest first

    def keep(self, global_step: int) -> None:
        """The averaging of `global_step` completed: copy the state (into the older copy's buffers)."""
        reuse = self.kept.pop(0)[1] if len(self.kept) == 2 else None
        self.kept.append((global_step, mirror(self.capture(), reuse)))

    @property
    def newest(self) -> int:
        return self.kept[-1][0]

    def at(self, global_step: int) -> dict[str, Any]:
        """A fresh copy of the state after `global_step` (the caller may keep references into it)."""
        for step, state in self.kept:
            if step == global_step:
                return mirror(state, None)
        raise RuntimeError(f"no agreed state after step {global_step} is kept (kept: "
                           f"{[step for step, _ in self.kept]})")


def mirror(value: Any, reuse: Any) -> Any:
    """A copy of `value` that shares no tensor with it, written into `reuse`'s tensors where their shapes match."""
    if isinstance(value, torch.Tensor):
        if isinstance(reuse, torch.Tensor) and reuse.shape == value.shape and reuse.dtype == value.dtype \
                and reuse.device == value.device:
            return reuse.copy_(value)
        return value.detach().clone()
    if isinstance(value, dict):
        before = reuse if isinstance(reuse, dict) else {}
        return {key: mirror(item, before.get(key)) for key, item in value.items()}
    if isinstance(value, list | tuple):
        items = reuse if isinstance(reuse, list | tuple) and len(reuse) == len(value) else [None] * len(value)
        return type(value)(mirror(item, previous) for item, previous in zip(value, items, strict=True))
    return value

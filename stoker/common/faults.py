"""Fault injection for the fault tests: explicit, driven by one environment variable, never by timing luck.

STOKER_FAULT="ROLE:ACTION:MATCH", for example "producer:segfault:broken_7.jpg" (a producer segfaults when it
reaches a file whose path contains broken_7.jpg) or "consumer:sigkill:rank=1,step=5;" (consumer 1 is killed at
step 5, just before the averaging collective; "...,save=8;" as it begins the step-8 checkpoint, "...,val=0;" as it
ends epoch 0's validation), "producer:delete:cat_3.jpg" (the file is deleted just before it
is read, as if removed after indexing) or "checkpoint:enospc:step_00000008" (writing that checkpoint fails as on a
full disk); "controller:term-self:closing" sends SIGTERM to the controller from its own shutdown, and
"consumer:term-group:rank=1,step=3;" sends SIGTERM to the whole process group; "consumer:oom:rank=0,step=3;"
raises CUDA's out-of-memory error in that step, and "consumer-start:hang:rank=0,phase=joining" hangs a consumer
as it begins that phase of its start-up (`stoker.training.startup`). Several faults: join them with "|".
With STOKER_FAULT_ONCE=FILE each fault fires in the first process that reaches it only (the one that creates FILE;
FILE.1 for the second fault, FILE.2 for the third); without it, in every process that reaches it, so
"producer:sigkill:huge.png" is a file that gets every producer decoding it killed, as the kernel's OOM killer does.
Unset, every hook is a dictionary lookup and nothing more.
"""

from __future__ import annotations

import errno
import os
import signal
import struct
import time

from stoker.common.procs import started_by

ENV = "STOKER_FAULT"
ONCE_ENV = "STOKER_FAULT_ONCE"
ACTIONS = ("segfault", "sigkill", "hang", "raise", "interrupt-parent", "kill-parent", "delete", "enospc",
           "sigkill-mid-message", "term-self", "interrupt-group", "term-group", "kill-group", "repeat-batch",
           "oom")


READ_LATENCY_ENV = "STOKER_READ_LATENCY_MS"  # every file read waits this long, like remote storage
STEP_TIME_ENV = "STOKER_STEP_TIME_MS"  # every training step holds its consumer this long, like a slow device
CHECKPOINT_WRITE_ENV = "STOKER_CHECKPOINT_WRITE_MS"  # every checkpoint file takes this long to write, like a slow disk
CHECKPOINT_READ_ENV = "STOKER_CHECKPOINT_READ_MS"  # and this long to read back
# A consumer started again waits for this file before it asks to join: a test orders the join after a fault (with
# STOKER_FAULT_ONCE, the file a fault creates as it fires), instead of racing the start-up against the steps.
JOIN_AFTER_ENV = "STOKER_JOIN_AFTER"


def simulated_delay(env: str) -> None:
    seconds = delay_s(env)
    if seconds > 0:
        time.sleep(seconds)


def delay_s(env: str) -> float:
    """The wait `env` asks for, in seconds (unset: none)."""
    return max(0.0, float(os.environ.get(env) or 0) / 1000)


def wait_for_file(env: str, check) -> None:
    """Wait until the file named by `env` exists (unset: return at once), calling `check` (which raises to stop)."""
    path = os.environ.get(env)
    while path and not os.path.exists(path):
        check()
        time.sleep(0.05)


def armed() -> bool:
    """Whether any fault is set for this run: lets a hot loop skip building the `where` of each injection point."""
    return ENV in os.environ


def maybe_inject(role: str, where: str, channel=None) -> None:
    """`channel`: the pipe to the controller, for "sigkill-mid-message" (half a message written, then SIGKILL)."""
    for index, (fault_role, action, match) in enumerate(_specs()):
        if fault_role == role and match in where and _first_time(index):
            _act(action, where, channel)


def wants(role: str, action: str, where: str) -> bool:
    """For a fault that changes what a process does instead of what happens to it: "producer-batch:repeat-batch:
    part=5;" makes the producer of part 5 write the batch it built before again (one batch delivered twice)."""
    return any((fault_role, fault_action) == (role, action) and match in where and _first_time(index)
               for index, (fault_role, fault_action, match) in enumerate(_specs()))


def _specs() -> list[list[str]]:
    """Several faults are joined with "|": "consumer:interrupt-parent:...|controller:term-self:..."."""
    spec = os.environ.get(ENV)
    return [one.split(":", 2) for one in spec.split("|")] if spec else []


def _first_time(index: int) -> bool:
    """Whether fault `index` (of those joined with "|") fires here: always, or with STOKER_FAULT_ONCE, only in the
    first process to create its marker."""
    marker = os.environ.get(ONCE_ENV)
    if not marker:
        return True
    marker = f"{marker}.{index}" if index else marker
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _act(action: str, where: str, channel) -> None:
    if action == "sigkill-mid-message":
        os.write(channel.fileno(), struct.pack("!i", 1 << 16) + b"half a message")  # a frame header promising more
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "hang":
        while True:
            time.sleep(3600)
    elif action == "interrupt-parent":  # the controller, not the zygote a child was forked from
        os.kill(started_by(), signal.SIGINT)
    elif action == "term-self":  # SIGTERM: a shell's background job ignores SIGINT, never SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
    elif action in ("interrupt-group", "term-group"):  # as Ctrl-C, or `kill -TERM -PGID` (scancel, docker stop)
        os.killpg(os.getpgrp(), signal.SIGINT if action == "interrupt-group" else signal.SIGTERM)
    elif action == "kill-group":  # kill -9 of the whole process group: the resource tracker dies too
        os.killpg(os.getpgrp(), signal.SIGKILL)
    elif action == "kill-parent":
        os.kill(started_by(), signal.SIGKILL)
    elif action == "delete":
        if os.path.exists(where):
            os.unlink(where)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), where)
    elif action == "raise":
        raise RuntimeError(f"injected fault at {where}")
    elif action == "oom":  # as PyTorch's CUDA allocator words it (torch.OutOfMemoryError is a RuntimeError)
        raise RuntimeError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected at {where})")
    else:
        raise ValueError(f"{ENV}: unknown action {action!r}; expected one of {ACTIONS}")

"""Fault injection for the fault tests: explicit, driven by one environment variable, never by timing luck.

STOKER_FAULT="ROLE:ACTION:MATCH", for example "producer:segfault:broken_7.jpg" (a producer segfaults when it
reaches a file whose path contains broken_7.jpg) or "consumer:sigkill:rank=1,step=5" (consumer 1 is killed at
step 5, inside the averaging collective). Unset, every hook is a dictionary lookup and nothing more.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "STOKER_FAULT"
ACTIONS = ("segfault", "sigkill", "hang", "raise")


def maybe_inject(role: str, where: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    fault_role, action, match = spec.split(":", 2)
    if fault_role == role and match in where:
        _act(action, where)


def _act(action: str, where: str) -> None:
    if action == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "hang":
        while True:
            time.sleep(3600)
    elif action == "raise":
        raise RuntimeError(f"injected fault at {where}")
    raise ValueError(f"{ENV}: unknown action {action!r}; expected one of {ACTIONS}")

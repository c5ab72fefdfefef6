"""The controller's bound on each consumer's start-up, from its process's start to its first batch.

Without it the controller reacts only to a consumer's death, and one that hangs as it starts (an NCCL
initialization in a container, an inductor worker pool that never starts) is waited on forever. Each phase the
consumer reports (`stoker.training.startup`) may last the collective timeout, which its own waits on peers already
use, and as long again: those waits fail first and report their own error; the watch ends what ignores them. The
compile phases, and the read of the checkpoint a run resumes from, get the compile allowance on top
(`warmup.COMPILE_ALLOWANCE_S`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from stoker.training import startup
from stoker.training.warmup import COMPILE_ALLOWANCE_S

HINTS = {startup.GROUP: " (on GPUs: NCCL_DEBUG=INFO shows where NCCL's initialization stops; tools/gpu-check.sh "
                         "runs a one-GPU NCCL smoke test)",
         startup.COMPILING: " (--compile false runs without it)"}


class StartupTimeout(Exception):
    pass


class StartupWatch:
    def __init__(self, collective_timeout_s: float, compile_allowance_s: float = COMPILE_ALLOWANCE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.phase_s = 2 * collective_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.compile_allowance_s = compile_allowance_s
        self.clock = clock
        self.phases: dict[int, tuple[str, float]] = {}  # consumer -> (its phase, since when)

    def start(self, rank: int) -> None:
        """Consumer `rank`'s process was started."""
        self.phases[rank] = (startup.STARTING, self.clock())

    def reported(self, rank: int, phase: str) -> None:
        if rank not in self.phases:
            return  # a consumer started again (elastic): its group's own deadline watches it
        if phase == startup.STARTED:
            del self.phases[rank]
        else:
            self.phases[rank] = (phase, self.clock())

    def bound_s(self, phase: str) -> float:
        return self.phase_s + (self.compile_allowance_s if phase in startup.LONG_PHASES else 0.0)

    def check(self) -> None:
        """Raises StartupTimeout naming the first consumer whose phase outlasted its bound."""
        now = self.clock()
        for rank, (phase, since) in self.phases.items():
            if now - since > self.bound_s(phase):
                allowance = f" plus the compile allowance of {self.compile_allowance_s:.0f} s" \
                    if phase in startup.LONG_PHASES else ""
                raise StartupTimeout(
                    f"consumer {rank} never finished starting: it has been {phase} for {now - since:.0f} s, longer "
                    f"than twice --collective-timeout-s ({self.collective_timeout_s:g} s){allowance}; it is "
                    f"stopped{HINTS.get(phase, '')}")

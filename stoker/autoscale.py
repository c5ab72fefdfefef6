"""When to fork another producer and when to retire one.

Every window the controller reports how long consumers waited for input, how full the ready queues were and how
busy producers were. The policy adds a producer while consumers stall after warm-up and the budget allows, and
retires one when queues stay full while producers sit idle. A cooldown after each change and a retire rule that
needs two calm windows in a row keep it from oscillating.
"""

from __future__ import annotations

from dataclasses import dataclass

STALL_HIGH = 0.05  # consumers waiting more than this share of their time want another producer
STALL_LOW = 0.01
QUEUE_FULL = 0.75
IDLE_UTILIZATION = 0.5


@dataclass(frozen=True)
class Window:
    stall: float  # input wait / consumer wall time over the window, mean over consumers
    queue_fill: float  # ready batches / ready slots, mean over the window
    utilization: float  # producer busy time / (window x producers)
    producers: int


@dataclass(frozen=True)
class Decision:
    change: int  # +1, -1 or 0
    reason: str


class Autoscaler:
    def __init__(self, minimum: int, maximum: int, cooldown_windows: int = 1) -> None:
        self.minimum = minimum
        self.maximum = maximum
        self.cooldown_windows = cooldown_windows
        self._cooldown = 0
        self._calm_windows = 0

    def decide(self, window: Window) -> Decision:
        summary = (f"stall {window.stall:.1%}, queue {window.queue_fill:.0%} full, "
                   f"producers {window.utilization:.0%} busy")
        if self._cooldown > 0:
            self._cooldown -= 1
            return Decision(0, f"cooling down; {summary}")
        if window.stall > STALL_HIGH and window.producers < self.maximum:
            return self._change(+1, f"consumers wait: {summary}")
        calm = window.stall < STALL_LOW and window.queue_fill > QUEUE_FULL and window.utilization < IDLE_UTILIZATION
        self._calm_windows = self._calm_windows + 1 if calm else 0
        if self._calm_windows >= 2 and window.producers > self.minimum:
            return self._change(-1, f"queues full, producers idle: {summary}")
        if window.stall > STALL_HIGH:
            return Decision(0, f"at the budget of {self.maximum} producers; {summary}")
        return Decision(0, summary)

    def _change(self, change: int, reason: str) -> Decision:
        self._cooldown = self.cooldown_windows
        self._calm_windows = 0
        return Decision(change, reason)

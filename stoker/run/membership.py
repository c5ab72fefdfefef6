"""Which consumers train, and what happens when one dies (`--on-consumer-failure continue`).

The controller sees a consumer's death (its process is gone) and moves the shared `generation` on: every survivor
stops what it does (its collective fails at once, a wait sees the generation), leaves the group and reports
`Stranded` with the newest state it holds that all replicas agreed on. Once every survivor has, the controller
takes the oldest of those (each survivor holds it: `training/recovery.py`), takes back what was counted after it,
plans the rest of the run again for the survivors from there (`EpochPlan.regrouped`) and sends each its `Regroup`.
So a step in progress when the consumer died is trained again whole, by the survivors, and every sample of every
epoch is still trained exactly once.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any

from stoker.common.procs import StokerRunError
from stoker.observe.diagnosis import Verdict
from stoker.pipeline.messages import StepReport
from stoker.run.failures import STUCK_GRACE_S
from stoker.training.recovery import Stranded

# Reports kept to be taken back: those after the oldest state a survivor may go back to (two averagings back).
KEEP_WINDOWS = 2


@dataclass
class ConsumerDeath:
    """One consumer's death, as metrics.jsonl, the summary and the verdict tell it."""

    consumer: int
    rank: int  # in the group that broke
    device: str
    cause: str
    died_s: float  # seconds into the run
    agreed_step: int = -1  # the survivors went back to the state after this global step
    recovered_s: float | None = None  # from the death to the survivors' new group and plan
    without_training_s: float | None = None  # from the death to the survivors' first step reported after it
    steps_taken_back: int = 0  # steps trained after the agreed state, trained again
    consumers_after: int = 0

    def as_json(self) -> dict[str, Any]:
        return {key: round(value, 3) if isinstance(value, float) else value for key, value in asdict(self).items()}


def with_deaths(verdict: Verdict, deaths: list[ConsumerDeath]) -> Verdict:
    """The verdict, with what each death cost: "consumer 2 died (the others went on from the state after step 811):
    0.4 s without training, 0 step(s) trained again; 2 consumer(s) from then", in the words of the regroup's log
    line ("2 consumer(s) go on from the state after step 811")."""
    told = [f"consumer {death.consumer} died (the others went on from the state after step {death.agreed_step}): "
            + (f"{death.without_training_s:.1f} s without training, " if death.without_training_s is not None else "")
            + f"{death.steps_taken_back} step(s) trained again; {death.consumers_after} consumer(s) from then"
            for death in deaths if death.recovered_s is not None]
    return replace(verdict, text="; ".join([verdict.text, *told])) if told else verdict


class Membership:
    """The consumers of this machine that train now, in rank order, and the deaths so far."""

    def __init__(self, devices: list[str], generation: Any, min_consumers: int, sync_every: int,
                 timeout_s: float, started: float) -> None:
        self.devices = devices
        self.members = list(range(len(devices)))  # rank -> consumer index
        self.generation = generation  # shared with the consumers (None: the run stops at a death)
        self.min_consumers = min_consumers
        self.timeout_s = timeout_s
        self.started = started
        self.deaths: list[ConsumerDeath] = []
        self.stranded: dict[int, Stranded] = {}
        self.first_stranded_at: float | None = None
        self.regrouping_since: float | None = None
        self.floor = -1  # the agreed step of the last regroup: a broken group's later reports are void
        self.recent: deque[StepReport] = deque()
        self.keep_steps = KEEP_WINDOWS * sync_every + 1
        self.last_reported: dict[int, int] = {}  # consumer -> the newest global step it reported
        self.gone: dict[int, int] = {}  # consumer -> the generation its death was regrouped in: older reports void
        self.fresh: set[int] = set()  # consumers started again, members from the next regroup on, with no state
        self.rejoined: list[dict[str, Any]] = []  # each consumer that rejoined: when, from which step
        self.scheduled = list(self.members)  # rank -> consumer in the plan the consumers train now

    @property
    def elastic(self) -> bool:
        return self.generation is not None

    @property
    def current(self) -> int:
        return self.generation.value if self.generation is not None else 0

    @property
    def regrouping(self) -> bool:
        return self.regrouping_since is not None

    # ---- reports ------------------------------------------------------------------------------------------------

    def counts(self, report: StepReport) -> bool:
        """Whether a step report counts: not one a broken group trained after the state the survivors went back
        to. Those that count are kept a while, to be taken back by a later regroup."""
        if report.generation < self.gone.get(report.rank, -1):
            return False  # lost in an earlier regroup: what it trained up to then is counted or credited
        if report.generation < self.current and not self.regrouping and report.global_step > self.floor:
            return False  # a broken group's step after the state the survivors went back to
        if self.elastic:
            self.recent.append(report)
            while self.recent and self.recent[0].global_step < report.global_step - self.keep_steps:
                self.recent.popleft()
        self.last_reported[report.rank] = max(report.global_step, self.last_reported.get(report.rank, -1))
        if report.generation == self.current and self.deaths and self.deaths[-1].without_training_s is None \
                and self.deaths[-1].recovered_s is not None:
            self.deaths[-1].without_training_s = time.monotonic() - self.started - self.deaths[-1].died_s
        return True

    def slot_counts(self, generation: int) -> bool:
        """A slot freed by a consumer of a broken group was taken back at the regroup."""
        return generation >= self.current

    # ---- a death ------------------------------------------------------------------------------------------------

    def join(self, consumer: int) -> None:
        """A consumer started again is ready: the others are told to leave their group, and all form a new one with
        it, which gets a survivor's state."""
        self.stranded[consumer] = Stranded(consumer, self.current, 1 << 62, "started again")
        if consumer in self.members:  # said again: the group it was to join broke, or was overtaken, before it
            if consumer not in self.fresh:  # got the others' state: it still holds none, and has not rejoined
                mine = [index for index, joined in enumerate(self.rejoined) if joined["consumer"] == consumer]
                if mine:
                    del self.rejoined[mine[-1]]
            self.fresh.add(consumer)
            return
        self.members = sorted([*self.members, consumer])
        self.fresh.add(consumer)
        if self.regrouping_since is None:
            self.regrouping_since = time.monotonic()
        with self.generation.get_lock():
            self.generation.value += 1

    def lose(self, consumer: int, cause: str) -> ConsumerDeath | None:
        """`consumer` died: the survivors are told to leave the group (or the run fails when they may not go on)."""
        survivors = [c for c in self.members if c != consumer]
        if consumer in self.fresh:  # started again, died before it joined: no loss of training
            self.members, self.fresh = survivors, self.fresh - {consumer}
            self.stranded.pop(consumer, None)
            return None
        if not self.elastic:
            raise StokerRunError(cause)
        holding = [c for c in survivors if c not in self.fresh]  # those started again hold no state yet
        if len(holding) < self.min_consumers:
            self.members = survivors  # the summary's consumers_at_end says the count the error gives
            raise StokerRunError(f"{cause}; {len(holding)} consumer(s) left, fewer than min_consumers="
                                 f"{self.min_consumers}")
        now = time.monotonic()
        death = ConsumerDeath(consumer, self.scheduled.index(consumer), self.devices[consumer], cause,
                              now - self.started)
        self.deaths.append(death)
        self.members = survivors
        self.stranded.pop(consumer, None)
        if self.regrouping_since is None:
            self.regrouping_since = now
        with self.generation.get_lock():
            self.generation.value += 1
        return death

    def strand(self, message: Stranded) -> None:
        if message.rank in self.members:
            self.stranded[message.rank] = message
            if self.first_stranded_at is None:
                self.first_stranded_at = time.monotonic()

    def stuck(self) -> list[int]:
        """Consumers that never reached a collective their peers gave up on (`--collective-timeout-s`): a survivor
        was stranded with nobody dead, STUCK_GRACE_S ago (its peers' reports come within moments). They are to be
        killed, and the others go on as after a death. Every consumer stranded and none dead: the group broke by
        itself (the network), and the run fails."""
        if self.regrouping or self.first_stranded_at is None:
            return []
        if time.monotonic() - self.first_stranded_at < STUCK_GRACE_S:
            return []
        stuck = [c for c in self.members if c not in self.stranded]
        if not stuck:
            reasons = "; ".join(f"consumer {c}: {self.stranded[c].reason}" for c in self.members)
            raise StokerRunError(f"the consumers' group broke with every consumer alive ({reasons})")
        return stuck

    def ready(self, finished: dict[int, Any]) -> bool:
        """Every survivor that has not finished has left the broken group (one that finished needs no group)."""
        waiting = [c for c in self.members if c not in finished]
        return self.regrouping and any(c not in self.fresh for c in waiting) and all(
            c in self.stranded for c in waiting)

    def check_deadline(self, finished: dict[int, Any]) -> None:
        """A survivor that never leaves the broken group (stuck in its device) ends the run; one that finished is
        not waited for."""
        if self.regrouping_since is None:
            return
        waited = time.monotonic() - self.regrouping_since
        if waited > 2 * self.timeout_s:
            missing = [c for c in self.members if c not in self.stranded and c not in finished]
            raise StokerRunError(f"consumer(s) {missing} did not leave the broken group within {waited:.0f} s "
                                 "(2 x collective_timeout_s) after a consumer died")

    def agreed_step(self) -> int:
        return min(self.stranded[c].agreed_step for c in self.members if c in self.stranded and c not in self.fresh)

    def take_back(self, agreed: int) -> list[StepReport]:
        """The reports of steps after `agreed`, which the survivors train again: no longer counted."""
        back = [r for r in self.recent if r.global_step > agreed]
        self.recent = deque(r for r in self.recent if r.global_step <= agreed)
        for consumer in self.last_reported:
            self.last_reported[consumer] = min(self.last_reported[consumer], agreed)
        return back

    def drop_finished(self, finished: dict[int, Any]) -> None:
        """Consumers that took their `Finish` before the group broke have ended: the new group is the others."""
        self.members = [c for c in self.members if c not in finished]

    def regrouped(self, agreed: int, taken_back: int) -> None:
        now = time.monotonic()
        for death in self.deaths:
            if death.recovered_s is None:
                death.agreed_step, death.steps_taken_back = agreed, taken_back
                death.recovered_s = now - self.started - death.died_s
                death.consumers_after = len(self.members)
                self.gone[death.consumer] = self.current
        self.rejoined += [{"consumer": c, "from_step": agreed + 1, "t": round(now - self.started, 3)}
                          for c in sorted(self.fresh)]
        self.fresh = set()
        self.scheduled = list(self.members)
        self.floor = agreed
        self.stranded, self.first_stranded_at = {}, None
        self.regrouping_since = None

"""Why consumers stopped: when one reports a failure or dies, name the peer that caused it (dead, or stuck outside
the collective its peers wait in) before the symptom, and log what the others reported."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from stoker.common.procs import POLL_S, Mailbox, describe_exit
from stoker.pipeline.messages import ConsumerFailed

log = logging.getLogger(__name__)

STUCK_GRACE_S = 3.0  # after one consumer's collective timed out, how long its peers' reports may take


class FailureWitness:
    def __init__(self, consumers: Sequence, mailbox: Mailbox, collective_timeout_s: float) -> None:
        self.consumers = consumers  # the consumer processes, by local rank
        self.mailbox = mailbox
        self.collective_timeout_s = collective_timeout_s

    def causes(self, first: ConsumerFailed) -> list[str]:
        """What made `first` fail, if a peer on this machine did: a dead one, else a stuck one."""
        return self.dead_peers(first.rank) or self.stuck_peers(first)

    def dead_peers(self, reporter: int) -> list[str]:
        """A collective error usually means a peer died: name it first, it is the cause."""
        dead = []
        for rank, process in enumerate(self.consumers):
            if rank == reporter:
                continue
            process.join(timeout=1.0)
            if process.exitcode not in (None, 0):
                dead.append(f"consumer {rank} (pid {process.pid}) {describe_exit(process)}")
        return dead

    def stuck_peers(self, first: ConsumerFailed) -> list[str]:
        """A collective timed out and no peer died: every peer waiting in it times out too, within moments; one
        that is alive and does not report that never reached the collective."""
        if "timed out" not in first.error.error.lower() and "timeout" not in first.error.error.lower():
            return []
        reported = {first.rank}
        deadline = time.monotonic() + STUCK_GRACE_S
        while len(reported) < len(self.consumers) and time.monotonic() < deadline:
            reported |= {m.rank for m in self.mailbox.receive(timeout_s=POLL_S) if isinstance(m, ConsumerFailed)}
        return [f"consumer {rank} (pid {process.pid}) is stuck: it did not reach the collective within "
                f"collective_timeout_s={self.collective_timeout_s:g} while its peers waited in it"
                for rank, process in enumerate(self.consumers) if rank not in reported and process.is_alive()]

    def log_reported_failures(self) -> None:
        """A consumer died: if another one reported why (a collective error, say), say that first."""
        while messages := self.mailbox.receive(timeout_s=0.5):
            for message in messages:
                if isinstance(message, ConsumerFailed):
                    log.error("%s", message.error)

"""The run's checkpoints, as the controller keeps them: every consumer's part of a save gathered, the checkpoint's
meta (where training resumes, the files and their digests, the config, the classes, the accounting so far) written
beside them, the whole committed atomically in the background, the newest `KEEP_CHECKPOINTS` kept, and the last
committed one recorded for the summary. The consumers write the state; this never touches a tensor.
"""

from __future__ import annotations

import logging
from pathlib import Path

from stoker.common import checkpoint
from stoker.common.checkpoint import Position
from stoker.common.config import TrainConfig
from stoker.observe.metrics import MetricsLog, RunStats
from stoker.observe.summary import ACCOUNTING_FILE, Ledger
from stoker.pipeline.messages import Saved
from stoker.run.cluster import Cluster

log = logging.getLogger(__name__)

KEEP_CHECKPOINTS = 3


class Checkpoints:
    def __init__(self, run_dir: Path, config: TrainConfig, cluster: Cluster, num_consumers: int,
                 steps_per_epoch: int, classes: list[str], sample_counts: dict[str, int], ledger: Ledger) -> None:
        self.run_dir = run_dir
        self.config = config
        self.cluster = cluster
        self.num_consumers = num_consumers  # on this machine
        self.steps_per_epoch = steps_per_epoch
        self.classes = classes
        self.sample_counts = sample_counts
        self.ledger = ledger
        self.pending: dict[int, dict[int, dict[str, str]]] = {}  # global step -> rank -> its files and digests
        self.last: Path | None = None
        self.commits = checkpoint.BackgroundCommits()
        self.failure: str | None = None  # a commit that failed while closing

    def expect(self, global_step: int) -> None:
        """A save was handed to the consumers outside the scheduler's own (an interrupt's)."""
        self.pending[global_step] = {}

    def saved(self, message: Saved, stats: RunStats) -> None:
        """A consumer's part is written; once every consumer's is, the checkpoint is committed."""
        parts = self.pending.setdefault(message.global_step, {})
        parts[message.rank] = message.files
        if len(parts) < self.num_consumers:
            return
        del self.pending[message.global_step]
        self.ledger.checkpointed(message.global_step)
        if not self.cluster.leader:
            return  # the first machine's rank 0 wrote every replica's state
        files = {name: digest for rank_files in parts.values() for name, digest in rank_files.items()}
        steps = self.steps_per_epoch
        position = Position(message.global_step // steps, message.global_step % steps, message.global_step)
        meta = {"position": position.__dict__, "files": files, "num_consumers": self.cluster.world,
                "config": self.config.as_json(), "classes": self.classes, "samples": self.sample_counts}
        final = checkpoint.checkpoint_dir(self.run_dir, message.global_step)
        temporary = checkpoint.checkpoint_dir(self.run_dir, message.global_step, temporary=True)
        extra = {}
        if not self.cluster.multi:  # several machines: the others' accounting reaches this one only at the end
            extra[ACCOUNTING_FILE] = self.ledger.snapshot(stats, message.global_step)
        self.commits.submit(temporary, final, meta, extra, KEEP_CHECKPOINTS)

    def record_commits(self, metrics: MetricsLog, wait: bool = False) -> None:
        for final in self.commits.committed(wait):
            self.last = final
            metrics.write("checkpoint", path=final, step=checkpoint.step_of(final))

    def close(self, metrics: MetricsLog) -> None:
        """Idempotent: the commits still running are waited for; one that fails is the run's failure."""
        try:
            self.record_commits(metrics, wait=True)
        except OSError as error:
            log.error("could not commit the last checkpoint: %s", error)
            self.failure = str(error)
        self.commits.close()

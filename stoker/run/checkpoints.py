"""The run's checkpoints, as the controller keeps them: every consumer's part of a save gathered, the checkpoint's
meta (where training resumes, the files and their digests, the config, the classes, the accounting so far) written
beside them, the whole committed atomically in the background, the newest `KEEP_CHECKPOINTS` kept, and the last
committed one recorded for the summary. The consumers write the state; this never touches a tensor.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from stoker.common import checkpoint
from stoker.common.config import TrainConfig
from stoker.common.positions import Position
from stoker.data.pixels import PIXELS_VERSION
from stoker.observe.metrics import MetricsLog, RunStats
from stoker.observe.summary import ACCOUNTING_FILE, Ledger
from stoker.pipeline.messages import Saved
from stoker.run.cluster import Cluster

log = logging.getLogger(__name__)

KEEP_CHECKPOINTS = 3


class Checkpoints:
    def __init__(self, run_dir: Path, config: TrainConfig, cluster: Cluster, num_consumers: int,
                 classes: list[str], sample_counts: dict[str, int], ledger: Ledger) -> None:
        self.run_dir = run_dir
        self.config = config
        self.cluster = cluster
        self.num_consumers = num_consumers  # on this machine
        self.classes = classes
        self.sample_counts = sample_counts
        self.ledger = ledger
        self.pending: dict[int, dict[int, dict[str, str]]] = {}  # global step -> rank -> its files and digests
        self.positions: dict[int, Position] = {}  # global step -> where a resume from its checkpoint continues
        self.reference_consumers = cluster.world  # the count the run's learning-rate schedule was made for
        self.completed: set[int] = set()  # global steps whose every part is written (committed, or committing)
        self.disagreeing: set[int] = set()  # global steps some replica saved between two averagings
        self.writers: dict[int, int] = {}  # global step -> the consumers handed its save
        self.last: Path | None = None
        self.commits = checkpoint.BackgroundCommits()
        self.failure: str | None = None  # a commit that failed while closing

    def expect(self, position: Position) -> None:
        """A save at `position` was handed to the consumers (as many as train now)."""
        self.pending.setdefault(position.global_step, {})
        self.positions[position.global_step] = position
        self.writers[position.global_step] = self.num_consumers

    def regroup(self, num_consumers: int, agreed_step: int, stats: RunStats) -> None:
        """The consumers changed: a checkpoint now takes the survivors' parts. A save after the agreed step is
        made again by the survivors (its temporary folder removed); one before it that every survivor passed lacks
        only the dead consumer's message, and is committed when rank 0's part (which holds every state) is in."""
        self.num_consumers = num_consumers
        for global_step in sorted(self.pending):
            whole = any(checkpoint.MODEL_FILE in files for files in self.pending[global_step].values())
            if global_step <= agreed_step and whole:
                self._commit(global_step, stats)
                continue
            del self.pending[global_step]
            self.positions.pop(global_step, None)
            self.writers.pop(global_step, None)
            shutil.rmtree(checkpoint.checkpoint_dir(self.run_dir, global_step, temporary=True), ignore_errors=True)
            if global_step <= agreed_step:
                log.warning("the checkpoint at step %d is dropped: the consumer that wrote it died before it said "
                            "so", global_step)

    def saved(self, message: Saved, stats: RunStats) -> None:
        """A consumer's part is written; once every consumer's is, the checkpoint is committed."""
        parts = self.pending.setdefault(message.global_step, {})
        parts[message.rank] = message.files
        if not message.replicas_agree:
            self.disagreeing.add(message.global_step)
        if len(parts) >= self.writers.get(message.global_step, self.num_consumers):
            self._commit(message.global_step, stats)

    def _commit(self, global_step: int, stats: RunStats) -> None:
        parts = self.pending.pop(global_step)
        writers = self.writers.pop(global_step, self.num_consumers)
        self.completed.add(global_step)
        position = self.positions.pop(global_step)
        self.ledger.checkpointed(global_step)
        if not self.cluster.leader:
            return  # the first machine's rank 0 wrote every replica's state
        files = {name: digest for rank_files in parts.values() for name, digest in rank_files.items()}
        meta = {"position": position.__dict__, "files": files,
                "num_consumers": writers if not self.cluster.multi else self.cluster.world,
                "reference_consumers": self.reference_consumers,
                "replicas_agree": global_step not in self.disagreeing,
                "config": self.config.as_json(), "classes": self.classes, "samples": self.sample_counts,
                "pixels": PIXELS_VERSION}
        final = checkpoint.checkpoint_dir(self.run_dir, global_step)
        temporary = checkpoint.checkpoint_dir(self.run_dir, global_step, temporary=True)
        extra = {}
        if not self.cluster.multi:  # several machines: the others' accounting reaches this one only at the end
            extra[ACCOUNTING_FILE] = self.ledger.snapshot(stats, position)
        self.commits.submit(temporary, final, meta, extra, KEEP_CHECKPOINTS)

    def record_commits(self, metrics: MetricsLog, wait: bool = False) -> None:
        for final in self.commits.committed(wait):
            self.last = final
            metrics.write("checkpoint", path=final, step=checkpoint.step_of(final))

    def folder(self, global_step: int) -> Path:
        """Where the consumers write the checkpoint after `global_step` until it is committed."""
        return checkpoint.checkpoint_dir(self.run_dir, global_step, temporary=True)

    def close(self, metrics: MetricsLog) -> None:
        """Idempotent: the commits still running are waited for (one that fails is the run's failure), and what
        no commit finished is deleted."""
        try:
            self.record_commits(metrics, wait=True)
        except OSError as error:
            log.error("could not commit the last checkpoint: %s", error)
            self.failure = str(error)
        self.commits.close()
        checkpoint.discard_incomplete(self.run_dir)

"""A run folder holds one run: a new run refuses a folder that holds one, and `--resume` needs a checkpoint in it.

Checked in the controller before any process starts, so a user error is an exit code 2 and nothing to clean up.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
from pathlib import Path

from stoker.common import checkpoint
from stoker.common.config import RUN_CONFIG_FILE

# What a run leaves in its folder (the first is written when it starts, before any step).
RUN_MARKERS = (RUN_CONFIG_FILE, "metrics.jsonl", "summary.json", "checkpoints")


class RunDirError(ValueError):
    """The run folder cannot be used as asked; the message says what to do instead."""


# The torchrun job a run folder belongs to (its rendezvous id), written beside config.json by every machine.
JOB_FILE = "torchrun-job.json"


def torchrun_job() -> str | None:
    """The id of the torchrun job this controller belongs to (`--rdzv-id`, or --standalone's own), where there is
    one: a static rendezvous (`--node-rank`) names none, and two such launches must not take each other's folder."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return job if job not in ("", "none") else None


def mark_job(run_dir: Path) -> None:
    """Record the torchrun job this folder's run belongs to (`started_again` reads it)."""
    if (job := torchrun_job()) is not None:
        (run_dir / JOB_FILE).write_text(json.dumps({"job": job}))


def started_again(run_dir: Path) -> bool:
    """Whether torchrun started this job's workers again in their own folder: after a failure within
    `--max-restarts`, or a membership change (a machine lost or added, with `--nnodes MIN:MAX`), which torchrun
    does not count as a restart (TORCHELASTIC_RESTART_COUNT stays 0), so the job's id decides."""
    job = torchrun_job()
    if job is None:
        return False
    try:
        return json.loads((run_dir / JOB_FILE).read_text()).get("job") == job
    except (OSError, ValueError, AttributeError):
        return False


def after_a_restart(run_dir: Path, here: bool, elsewhere: bool) -> str | None:
    """On the first machine, what a job torchrun started again does: "resume" from the last checkpoint of the part
    that failed, None to start afresh (no machine's folder is this job's, or the part failed before its first
    checkpoint). `here`, `elsewhere`: whether this machine's folder, and another machine's, are this job's. A
    `RunDirError` where going on would lose or repeat work silently."""
    if not (here or elsewhere):
        return None
    if not here:
        raise RunDirError(f"torchrun started job {torchrun_job()!r} again, but the first machine's run folder "
                          f"{run_dir} is not this job's (the machine that held it was lost, or another came "
                          "first): keep the run folder on a disk every machine sees, and --resume it")
    status = _status(run_dir)
    if status in ("completed", "interrupted"):  # not a failure torchrun recovers from: a new launch, or Ctrl-C
        raise RunDirError(f"out={str(run_dir)!r} holds this job's run, which ended {status}: continue it with "
                          f"--resume {run_dir}, or give a new --out folder")
    return "resume" if any((run_dir / "checkpoints").glob(f"{checkpoint.PREFIX}*")) else None


def _status(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None  # killed before it wrote one


def check_new_run_dir(run_dir: Path) -> None:
    """A new run writes metrics.jsonl afresh and numbers its checkpoints from 0: in a folder that holds a run it
    would truncate that run's metrics, and the old run's checkpoints (higher steps) would outrank its own."""
    found = [name for name in RUN_MARKERS if (run_dir / name).exists()]
    if found:
        raise RunDirError(f"out={str(run_dir)!r} already holds a run ({', '.join(found)}); continue it with "
                          f"--resume {run_dir}, or give a new --out folder (or remove this one)")


def newest_checkpoint(run_dir: Path, fits: checkpoint.FitCheck | None = None) -> tuple[Path, dict]:
    """The checkpoint `--resume` continues from, or a `RunDirError` that says there is none to continue from."""
    try:
        return checkpoint.newest_valid(run_dir, fits)
    except checkpoint.CheckpointError as error:
        raise RunDirError(f"{error}: nothing to resume from (the run stopped before its first checkpoint, or "
                          f"every checkpoint was refused, see the warnings above); start it again with "
                          f"--out {run_dir} after removing the folder, or with a new --out folder") from None


def default_run_dir() -> Path:
    """runs/<time>; under a torchrun job, runs/<its id>, the same folder each time torchrun starts it again."""
    job = torchrun_job()
    return Path("runs") / (f"torchrun-{job}" if job else datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))


class RunDirLock:
    """An exclusive `flock` on the run folder for as long as a run (or a resume) uses it: a second run or resume of
    the same folder is refused instead of training beside the first (whose close would delete the other's
    checkpoint in progress). The kernel releases the lock when its holder dies, however it dies, so a killed run
    never leaves a folder locked. Each machine of a run locks a file of its own (several machines may share one
    folder on a network filesystem)."""

    def __init__(self, run_dir: Path, node: int = 0) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / (".lock" if node == 0 else f".lock-node{node}")
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 64, 0).decode(errors="replace").strip() or "not yet known"
            os.close(descriptor)
            raise RunDirError(f"{run_dir} is in use by another stoker run (pid {holder} holds {self.path}); wait "
                              "for it to end, or give another --out folder") from None
        self._descriptor: int | None = descriptor

    def record_holder(self) -> None:
        """Write this process's pid into the lock file, for the message a second start gets. Only once the run
        starts: a start refused before that (a completed run, a changed setting) rewrites nothing."""
        if self._descriptor is not None:
            os.ftruncate(self._descriptor, 0)
            os.pwrite(self._descriptor, f"{os.getpid()}\n".encode(), 0)

    def close(self) -> None:
        """Idempotent; the file stays (removing it would let a third run lock a new file while a second holds the
        old one)."""
        descriptor, self._descriptor = self._descriptor, None
        if descriptor is not None:
            os.close(descriptor)

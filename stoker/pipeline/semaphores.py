"""Named semaphores that a later start can remove when the run that made them was killed.

With the spawn start method every multiprocessing lock, semaphore, event and queue is a named POSIX semaphore,
`/dev/shm/sem.mp-*`, that children open by name; the resource tracker unlinks them when a run ends or its
controller dies, but `kill -9` of the whole process group kills the tracker too, and they stay (11 per run). Their
default names say nothing about who made them, so nothing could tell a dead run's from another program's. Here
the first process that needs them takes a lock file, `/dev/shm/stoker-sem_PID_HEX`, holds it for its lifetime,
and names every semaphore it makes after it (`sem.stoker-sem_PID_HEX-*`): the ring's rule then applies, whoever
holds the lock is alive, in any PID namespace, and `sweep_dead_semaphores` removes the rest.
"""

from __future__ import annotations

import logging
import multiprocessing.process
import multiprocessing.util
import os
import re
import secrets
from collections import defaultdict

from stoker.pipeline.ring import SHM_DIR, hold_lock, remove_if_unheld

log = logging.getLogger(__name__)

LOCK_PREFIX = "stoker-sem_"
_LOCK_PATTERN = re.compile(rf"^{LOCK_PREFIX}\d+_[0-9a-f]+$")
_SEMAPHORE_PATTERN = re.compile(rf"^sem\.({LOCK_PREFIX}\d+_[0-9a-f]+)-")
_claimed: tuple[int, str] | None = None  # (pid, lock file) of this process's claim


def name_semaphores_for_sweeping() -> None:
    """From now on, semaphores this process makes carry the name of a lock it holds until it exits. Idempotent;
    where there is no /dev/shm (or the lock cannot be taken) semaphores keep their default names."""
    global _claimed
    if _claimed is not None and _claimed[0] == os.getpid():
        return
    for _ in range(3):  # a start's sweep may take the file between its creation and our lock: rare
        tag = f"{LOCK_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
        path = os.path.join(SHM_DIR, tag)
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600))
        except OSError:
            return
        descriptor = hold_lock(path)
        if descriptor is not None:
            break
    else:
        log.warning("could not lock %s: semaphores of this run keep their default names", SHM_DIR)
        return
    _claimed = (os.getpid(), path)
    # multiprocessing names semaphores '<semprefix>-<random>' (SemLock._make_name); there is no public setting.
    multiprocessing.process.current_process()._config["semprefix"] = "/" + tag  # type: ignore[attr-defined]
    # Exit priority below the semaphores' own (0): their names are unlinked at exit before the lock goes.
    multiprocessing.util.Finalize(None, _release, (descriptor, path), exitpriority=-1)


def _release(descriptor: int, path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
    os.close(descriptor)


def sweep_dead_semaphores() -> list[str]:
    """Remove semaphores (and lock files) of processes that are gone; returns the semaphores' file names."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    by_tag: dict[str, list[str]] = defaultdict(list)
    for name in names:
        if match := _SEMAPHORE_PATTERN.match(name):
            by_tag[match.group(1)].append(name)
    tags = set(by_tag) | {name for name in names if _LOCK_PATTERN.match(name)}
    removed = []
    for tag in sorted(tags):
        if not _holder_gone(tag):
            continue
        for name in by_tag[tag]:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass  # its own finalizer was faster
    if removed:
        log.info("removed %d semaphore(s) of dead runs from %s", len(removed), SHM_DIR)
    return removed


def _holder_gone(tag: str) -> bool:
    """True when no process holds the tag's lock: its lock file is removed here, or was never there."""
    path = os.path.join(SHM_DIR, tag)
    if not os.path.exists(path):
        return True  # semaphores are named only once the lock is held: its holder released it, or was swept
    return remove_if_unheld(path)

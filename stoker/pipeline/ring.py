"""A fixed ring of preallocated batch slots in one shared-memory segment.

Producers write a batch into a slot and send only its id; consumers read it and hand it back. Nothing image-sized
is pickled, and the ring bounds memory. Only the controller creates and unlinks the segment, and holds an
exclusive `flock` on it while it lives, so that a later start can remove segments of controllers that died: a
lock is released by the kernel when its holder dies however it dies, and unlike a pid it means the same thing in
every PID namespace (containers sharing /dev/shm with --ipc=host each have their own pids).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from stoker.common.choices import SizeRamp

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "stoker_"
_NAME_PATTERN = re.compile(rf"^{NAME_PREFIX}(\d+)_[0-9a-f]+$")
_ALIGN = 64
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python's mmap module names it only from 3.13
_madvise = ctypes.CDLL(None, use_errno=True).madvise
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
STATUS_FIELDS = 3  # per producer: part id being built, position in the batch, heartbeat (monotonic ns)


@dataclass(frozen=True)
class RingSpec:
    """Everything a child needs to attach: picklable and small."""

    name: str
    num_slots: int
    batch_size: int
    image_size: int
    num_status: int
    val_image_size: int | None = None  # None: validation at `image_size` (`--val-image-size`)
    ramp: SizeRamp | None = None  # training's side by epoch (`--image-size-ramp`), `image_size` its largest
    train_samples: int = 0  # the sources' sizes: a mark per sample, `SlotRing.loaded_of`
    val_samples: int = 0

    @property
    def val_size(self) -> int:
        return self.image_size if self.val_image_size is None else self.val_image_size

    @property
    def slot_side(self) -> int:
        """The side a slot is sized for: every slot may hold a training or a validation batch (the scheduler
        hands out whichever slot is free), so each holds the larger of the two."""
        return max(self.image_size, self.val_size)

    def side(self, kind: str, epoch: int | None = None) -> int:
        """The side of a batch of this kind; with a ramp, a training batch's is its epoch's."""
        if kind == "val":
            return self.val_size
        if self.ramp is None:
            return self.image_size
        assert epoch is not None, "a ramped ring's training side depends on the epoch"
        return self.ramp.size_at(epoch)

    def _layout(self) -> list[tuple[str, tuple[int, ...], np.dtype]]:
        s, b, px = self.num_slots, self.batch_size, self.slot_side
        return [
            ("pixels", (s, b * px * px * 3), np.dtype(np.uint8)),
            ("labels", (s, b), np.dtype(np.int64)),
            ("ids", (s, b), np.dtype(np.int64)),
            ("counts", (s,), np.dtype(np.int64)),
            ("status", (self.num_status, STATUS_FIELDS), np.dtype(np.int64)),
            ("loaded", (self.train_samples + self.val_samples,), np.dtype(np.uint32)),
        ]

    @property
    def nbytes(self) -> int:
        return sum(_aligned(int(np.prod(shape)) * dtype.itemsize) for _, shape, dtype in self._layout())


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


class SlotRing:
    """Numpy views over the segment: `images[slot, i]` is sample i of the training batch in `slot`,
    `val_images[slot, i]` of the validation batch (`images_of(kind)`). Both view the same bytes of each slot,
    from its start, each with its own side: a training batch at 160 px and a validation batch at 224 px are each
    contiguous in the slot, as one batch of one size is."""

    def __init__(self, spec: RingSpec, segment: shared_memory.SharedMemory, owner: bool) -> None:
        self.spec = spec
        self._segment: shared_memory.SharedMemory | None = segment
        self._owner = owner
        self._lock: int | None = None  # the creator's lock: "alive" for every sweep, in any PID namespace
        offset = 0
        for name, shape, dtype in spec._layout():
            size = int(np.prod(shape)) * dtype.itemsize
            setattr(self, name, np.ndarray(shape, dtype=dtype, buffer=segment.buf, offset=offset))
            offset += _aligned(size)
        self.images = self._images_at(spec.image_size)
        self.val_images = self._images_at(spec.val_size)
        self.pixels: np.ndarray
        self.labels: np.ndarray
        self.ids: np.ndarray
        self.counts: np.ndarray
        self.status: np.ndarray
        self.loaded: np.ndarray

    def _images_at(self, side: int) -> np.ndarray:
        """(slots, batch, side, side, 3) over `pixels`: C-contiguous within a slot, slots `pixels`' row apart."""
        sample = side * side * 3
        return np.lib.stride_tricks.as_strided(
            self.pixels, shape=(self.spec.num_slots, self.spec.batch_size, side, side, 3),
            strides=(self.pixels.strides[0], sample, side * 3, 3, 1), writeable=True)

    def images_of(self, kind: str, epoch: int | None = None) -> np.ndarray:
        """The view a batch of this kind ("train" or "val") of `epoch` is written and read through: with
        `--image-size-ramp` a training batch is contiguous at its epoch's side from the slot's start, as a
        validation batch is at its own."""
        if kind == "val":
            return self.val_images
        if self.spec.ramp is None:
            return self.images
        side = self.spec.side(kind, epoch)
        return self.images if side == self.spec.image_size else self._images_at(side)

    def loaded_of(self, kind: str) -> np.ndarray:
        """By sample id, the byte length of the sample's file when a producer last loaded it whole and strictly
        (0: not yet), shared by every producer: a later load of bytes of that length may stop decoding at the crop's
        box (`load_into`'s `checked_before`). Files are taken not to change during a run, as the index takes them; one
        of another length since is loaded whole again."""
        train = self.spec.train_samples
        return self.loaded[train:] if kind == "val" else self.loaded[:train]

    @classmethod
    def create(cls, num_slots: int, batch_size: int, image_size: int, num_status: int,
               val_image_size: int | None = None, ramp: SizeRamp | None = None,
               samples: tuple[int, int] = (0, 0)) -> SlotRing:
        """`samples`: how many the training and validation sources hold (a `loaded_of` mark each)."""
        for _ in range(3):  # a start's sweep may take the segment between its creation and our lock: rare
            name = f"{NAME_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
            spec = RingSpec(name, num_slots, batch_size, image_size, num_status, val_image_size, ramp, *samples)
            check_shm_space(spec.nbytes)
            segment = shared_memory.SharedMemory(name=name, create=True, size=spec.nbytes)
            ring = cls(spec, segment, owner=True)
            ring._lock = hold_lock(os.path.join(SHM_DIR, name))
            if ring._lock is not None or not os.path.isdir(SHM_DIR):
                break
            ring.close()
        else:
            raise OSError(f"could not create and lock the batch slot ring in {SHM_DIR}")
        if _map_every_page(segment) in (errno.EFAULT, errno.ENOMEM):
            ring.close()
            raise _too_small(spec.nbytes, f"{SHM_DIR} could not allocate it")
        ring.status[:] = -1
        return ring

    @classmethod
    def attach(cls, spec: RingSpec) -> SlotRing:
        segment = shared_memory.SharedMemory(name=spec.name, create=False)
        _map_every_page(segment)
        return cls(spec, segment, owner=False)

    def close(self) -> None:
        """Idempotent. Views are dropped before the mapping is closed; the owner also unlinks."""
        segment, self._segment = self._segment, None
        if segment is None:
            return
        for name in [name for name, _, _ in self.spec._layout()] + ["images", "val_images"]:
            setattr(self, name, None)
        segment.close()
        if self._owner:
            try:
                segment.unlink()
            except FileNotFoundError:
                pass
        lock, self._lock = self._lock, None
        if lock is not None:
            os.close(lock)


def _map_every_page(segment: shared_memory.SharedMemory) -> int:
    """Fault in the whole segment in one call; returns errno (0 on success). Batches are megabytes: page by page,
    the first pass over the ring took a fault per 4 KiB in every process (54 ms for a 58 MiB ring in the creator,
    15 ms in each process that attaches, against 31 and 13 ms here, outside the hot path). In the creator it also
    allocates the memory, so a /dev/shm that cannot hold the ring fails here instead of with a SIGBUS mid-run.
    Kernels before 5.14 answer EINVAL and pages are faulted lazily as before."""
    assert segment.buf is not None, "an open segment"  # the buffer is None only once closed
    pages = (ctypes.c_char * segment.size).from_buffer(segment.buf)
    try:
        return 0 if _madvise(ctypes.addressof(pages), segment.size, _MADV_POPULATE_WRITE) == 0 else ctypes.get_errno()
    finally:
        del pages  # a live export would keep the segment from closing


def check_shm_space(needed: int) -> None:
    """A clear error instead of a bus error when /dev/shm (Docker's default is 64 MB) cannot hold the ring."""
    if not os.path.isdir(SHM_DIR):
        return
    free = shutil.disk_usage(SHM_DIR).free
    if free < needed:
        raise _too_small(needed, f"{SHM_DIR} has {free / 2**20:.0f} MiB free")


def _too_small(needed: int, situation: str) -> ValueError:
    """The one message for a /dev/shm that cannot hold the ring: what it needs, and how to give it that."""
    return ValueError(f"the batch slot ring needs {needed / 2**20:.0f} MiB of shared memory but {situation}; raise "
                      f"it (docker run --shm-size={_suggest(needed)} or --ipc=host) or lower the batch size or the "
                      "image size (--batch-size, --image-size, --slots-per-consumer; a Loader's batch_size, "
                      "image_size)")


def _suggest(needed: int) -> str:
    return f"{max(1, -(-needed * 2 // 2**30))}g"


def hold_lock(path: str) -> int | None:
    """Lock a file (or folder) for as long as the descriptor stays open (not inherited: O_CLOEXEC). None when
    there is no such file (no /dev/shm on this platform, or a sweep removed it before we locked it). The rule of
    every sweep of what dead runs leave (segments, semaphores, store folders): whoever holds the lock is alive."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    fcntl.flock(descriptor, fcntl.LOCK_EX)  # waits while a sweep holds it to decide
    try:
        if os.stat(path).st_ino == os.fstat(descriptor).st_ino:
            return descriptor
    except FileNotFoundError:
        pass
    os.close(descriptor)
    return None


def sweep_dead_segments() -> list[str]:
    """Remove segments no live controller holds (a SIGKILL of the process group kills the tracker too)."""
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if _NAME_PATTERN.match(name) and remove_if_unheld(os.path.join(SHM_DIR, name)):
            removed.append(name)
    if removed:
        log.info("removed %d shared-memory segment(s) of dead runs: %s", len(removed), ", ".join(removed))
    return removed


def remove_if_unheld(path: str, remove: Callable[[str], None] = os.unlink) -> bool:
    """Remove the file (or with `remove`, the folder) if its lock is free (its holder is gone), deciding while
    holding that lock."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # removed meanwhile, or not ours to open
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # a live controller holds it, in this PID namespace or another
    except OSError as error:
        log.warning("could not check %s, left by a dead run?: %s", path, error)
        return False
    else:
        try:
            remove(path)
            return True
        except OSError as error:
            log.warning("could not remove %s of a dead run: %s", path, error)
            return False
    finally:
        os.close(descriptor)


def segment_creator(name: str) -> int:
    """The pid in a stoker segment's name: the process that made it."""
    match = _NAME_PATTERN.match(name)
    assert match is not None, name
    return int(match.group(1))


def live_segments(pid: int | None = None) -> list[str]:
    """Names of stoker segments in /dev/shm (of one controller when `pid` is given): used by tests and checks."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(n for n in names if _NAME_PATTERN.match(n) and (pid is None or segment_creator(n) == pid))

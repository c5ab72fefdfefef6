"""Atomic, checksummed checkpoints that load with `torch.load(weights_only=True)`.

A checkpoint is a folder `checkpoints/step_NNNNNNNN/`: `model.pt` (the averaged model, written by rank 0),
`rank_R.pt` (each consumer's optimizer and RNG state: local SGD leaves them per replica) and `meta.json` (position,
settings, classes and a SHA-256 of every file, and a SHA-256 of its own content: everything a resume reads is
covered by a checksum, so an edited position cannot silently skip steps). Consumers write their files into a
temporary folder; the controller commits it with an fsync and a rename once every rank has reported, so a crash at
any moment leaves either the old or the new checkpoint, never half of one.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from stoker.common import faults
from stoker.common.positions import (  # noqa: F401 (checkpoint.X stays the one name for these)
    META_CHECKSUM,
    META_FILE,
    MODEL_FILE,
    PREFIX,
    TMP_PREFIX,
    Position,
    checkpoint_dir,
    rank_file,
    step_of,
)

log = logging.getLogger(__name__)


class CheckpointError(Exception):
    """A checkpoint is missing, truncated, tampered with, or not loadable as plain weights."""


def write_atomic(path: Path, payload: bytes) -> str:
    """Temporary file in the same folder, fsync, rename, fsync the folder. Returns the payload's SHA-256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            faults.maybe_inject("checkpoint", str(path))
            faults.simulated_delay(faults.CHECKPOINT_WRITE_ENV)
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return hashlib.sha256(payload).hexdigest()


def save_tensors(path: Path, state: dict[str, Any]) -> str:
    """Every tensor is written as a CPU tensor: a file saved from `cuda:3` must load on a machine with fewer GPUs,
    or none, without `map_location` (the README's plain `torch.load`)."""
    buffer = io.BytesIO()
    torch.save(to_cpu(state), buffer)
    return write_atomic(path, buffer.getvalue())


def to_cpu(state: Any) -> Any:
    """A copy with every tensor on the CPU (tensors already there are kept as they are)."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {key: to_cpu(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_cpu(value) for value in state)
    return state


def fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def meta_checksum(meta: dict[str, Any]) -> str:
    """SHA-256 of meta.json's content without its own checksum, independent of key order and layout."""
    content = {key: value for key, value in meta.items() if key != META_CHECKSUM}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def commit(temporary: Path, final: Path, meta: dict[str, Any], keep: int) -> None:
    """Write meta.json with every file's checksum and its own, then make the folder visible in one rename."""
    meta = {**meta, META_CHECKSUM: meta_checksum(meta)}
    write_atomic(temporary / META_FILE, json.dumps(meta, indent=1).encode())
    if final.exists():
        shutil.rmtree(final)
    os.replace(temporary, final)
    fsync_dir(final.parent)
    _prune(final.parent, keep)


class BackgroundCommits:
    """Checkpoint commits (the controller's files, meta.json, fsync, rename) on one thread, in order. On a slow
    disk a commit in the controller's loop held up the delivery of batches: a consumer whose next batch was stuck
    behind it left its peers waiting in the collective until it timed out."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stoker-checkpoint")
        self._pending: deque[Future] = deque()

    def submit(self, temporary: Path, final: Path, meta: dict[str, Any], extra: dict[str, bytes], keep: int) -> None:
        self._pending.append(self._pool.submit(_commit_with, temporary, final, meta, extra, keep))

    def committed(self, wait: bool = False) -> list[Path]:
        """The checkpoints committed since the last call, in order; a failed commit raises its error here."""
        done = []
        while self._pending and (wait or self._pending[0].done()):
            done.append(self._pending.popleft().result())
        return done

    def close(self) -> None:
        """Idempotent: lets the commits under way finish (a checkpoint is not left half-made by a normal stop)."""
        self._pool.shutdown(wait=True)


def _commit_with(temporary: Path, final: Path, meta: dict[str, Any], extra: dict[str, bytes], keep: int) -> Path:
    files = {name: write_atomic(temporary / name, payload) for name, payload in extra.items()}
    commit(temporary, final, {**meta, "files": {**meta["files"], **files}}, keep)
    return final


def discard_incomplete(run_dir: Path) -> None:
    """Remove temporary folders of checkpoints that were never committed (a crash or a failed write)."""
    for folder in (run_dir / "checkpoints").glob(f"{TMP_PREFIX}{PREFIX}*"):
        shutil.rmtree(folder, ignore_errors=True)


def _prune(folder: Path, keep: int) -> None:
    for old in sorted(folder.glob(f"{PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def describe_load_error(error: BaseException, limit: int = 300) -> str:
    """What torch's error says about the file, in one line. A weights_only refusal's first line only tells how
    to load the file unsafely (and reads as advice to): the line that names the global the file asked for is
    what to show. Other errors (load_state_dict's) put the keys on the lines after the first: they are kept."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if lines and lines[0].startswith("Weights only load failed"):
        told = [line for line in lines[1:] if not line.startswith(("Check the documentation", "(1)", "(2)"))]
        asked = next((line for line in lines if "GLOBAL" in line), told[0] if told else "").split(". Please use")[0]
        text = f"it holds more than tensors and plain containers, which stoker never unpickles: {asked}"
    else:
        text = "; ".join(lines)
    return f"{type(error).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def load_verified(path: Path) -> Any:
    """Load one file with weights_only=True; anything that is not plain tensors and containers is refused."""
    faults.simulated_delay(faults.CHECKPOINT_READ_ENV)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"{path}: refused ({describe_load_error(error)})") from None


def verify(folder: Path) -> dict[str, Any]:
    """meta.json of a checkpoint whose meta.json matches its own checksum, holds what a resume reads, and whose
    files all exist and match their checksums. Anything else is a `CheckpointError` (the previous one is used)."""
    meta = _read_meta(folder)
    for name, expected in meta["files"].items():
        try:
            actual = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        except OSError as error:
            raise CheckpointError(f"{folder / name}: unreadable ({error.strerror})") from None
        if actual != expected:
            raise CheckpointError(f"{folder / name}: checksum mismatch (truncated or modified)")
    return meta


def _read_meta(folder: Path) -> dict[str, Any]:
    path = folder / META_FILE
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({error})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: not a JSON object ({type(meta).__name__})")
    if META_CHECKSUM not in meta:
        raise CheckpointError(f"{path}: no {META_CHECKSUM} (modified, or written by a stoker that did not "
                              "checksum it)")
    if meta[META_CHECKSUM] != meta_checksum(meta):
        raise CheckpointError(f"{path}: checksum mismatch (modified)")
    try:
        folder_step = step_of(folder)
    except ValueError:
        raise CheckpointError(f"{folder}: not named step_N") from None
    if problem := _shape_problem(meta, folder_step):
        raise CheckpointError(f"{path}: {problem}")
    return meta


def _shape_problem(meta: dict[str, Any], folder_step: int) -> str | None:
    """What a checksummed meta.json may still get wrong (a bug, or a forger who recomputed the checksum)."""
    files, position = meta.get("files"), meta.get("position")
    if not isinstance(files, dict) or not all(isinstance(v, str) and "/" not in k for k, v in files.items()):
        return "'files' is not a mapping of file names to checksums"
    if not isinstance(position, dict) or not {"epoch", "step", "global_step"} <= set(position) <= {
            "epoch", "step", "global_step", "offset"} or not all(type(v) is int and v >= 0 for v in position.values()):
        return "'position' is not {epoch, step, global_step[, offset]} as non-negative integers"
    if position["global_step"] != folder_step:
        return f"'position' says step {position['global_step']}, the folder's name {folder_step}"
    if type(meta.get("num_consumers")) is not int or meta["num_consumers"] < 1:
        return "'num_consumers' is not a positive integer"
    reference = meta.get("reference_consumers", meta["num_consumers"])
    if type(reference) is not int or not 1 <= reference <= 1 << 20:
        return "'reference_consumers' is not an integer from 1 to 2^20"
    if type(meta.get("replicas_agree", True)) is not bool:
        return "'replicas_agree' is not true or false"
    pixels = meta.get("pixels")
    if pixels is not None and (type(pixels) is not int or pixels < 1):
        return "'pixels' (the decoder's pixels version) is not a positive integer"
    return None


# (a loaded file's path, what it holds, its checkpoint's meta.json): raises CheckpointError when the file does not
# hold what a resume reads (stoker.run.checkpoint_fit).
FitCheck = Callable[[Path, Any, dict[str, Any]], None]


def verify_loadable(folder: Path, fits: FitCheck | None = None) -> dict[str, Any]:
    """verify(), then load every tensor file as resuming will, one at a time, and hand each to `fits`: a file can
    match its checksum and still hold a pickle weights_only refuses, or tensors that do not fit the model (written
    by a forger who fixed meta.json, or by another torch)."""
    meta = verify(folder)
    for name in meta["files"]:
        if name.endswith(".pt"):
            loaded = load_verified(folder / name)
            if fits is not None:
                fits(folder / name, loaded, meta)
    return meta


def newest_valid(run_dir: Path, fits: FitCheck | None = None) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint that verifies, loads and fits; each refused one is logged with its reason."""
    candidates = sorted((run_dir / "checkpoints").glob(f"{PREFIX}*"), reverse=True)
    for folder in candidates:
        try:
            return folder, verify_loadable(folder, fits)
        except CheckpointError as error:
            log.warning("skipping checkpoint: %s", error)
    raise CheckpointError(f"resume={str(run_dir)!r}: no valid checkpoint under {run_dir / 'checkpoints'}")

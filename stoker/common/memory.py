"""How much memory this process can still use: the machine's `MemAvailable`, or less where a memory cgroup it is in
(a container's `--memory`, a Kubernetes pod's limit, a Slurm job's) allows less. A container sees the host's
/proc/meminfo: on a 1 TB host under a 32 GB limit, MemAvailable alone would let 500 producers start into the OOM
killer.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned 64-bit number (9223372036854771712); any limit at or over
# this is none.
NO_LIMIT_FROM = 1 << 62


class Layout(NamedTuple):
    """One cgroup version's files, and where its memory hierarchy is mounted under CGROUP_ROOT."""

    mount: str
    limit: str
    usage: str
    inactive_file: str  # memory.stat keys of the page cache the kernel reclaims before it kills
    active_file: str


V2 = Layout("", "memory.max", "memory.current", "inactive_file", "active_file")
V1 = Layout("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file", "total_active_file")


def available_memory(proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> int | None:
    """Bytes; None where neither figure can be read (not Linux)."""
    figures = [f for f in (meminfo_available(proc), cgroup_headroom(proc, cgroup_root)) if f is not None]
    return min(figures) if figures else None


def meminfo_available(proc: Path = PROC) -> int | None:
    try:
        fields = dict(line.split(":", 1) for line in (proc / "meminfo").read_text().splitlines() if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


def cgroup_headroom(proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> int | None:
    """The smallest (limit - usage) over this process's memory cgroup and every one above it: a limit is often set
    on an ancestor (a Slurm job above its steps, a Kubernetes pod above its containers) while the leaf has none. The
    hierarchy's root is read too: a container without its own cgroup namespace lists the host's path, but has its
    own cgroup mounted at the root."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    headrooms = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        layout = V2 if controllers == "" else V1 if "memory" in controllers.split(",") else None
        if layout is None:
            continue
        mount = cgroup_root / layout.mount
        folder = mount / path.strip("/")
        for candidate in [folder, *folder.parents]:
            if not candidate.is_relative_to(mount):
                break
            if (headroom := _headroom(candidate, layout)) is not None:
                headrooms.append(headroom)
    return min(headrooms) if headrooms else None


def _headroom(folder: Path, layout: Layout) -> int | None:
    """limit - usage, usage without the page cache the kernel reclaims first (all of the inactive part, half of the
    active one, as MemAvailable counts the page cache)."""
    try:
        limit_text = (folder / layout.limit).read_text().strip()
        usage = int((folder / layout.usage).read_text())
    except (OSError, ValueError):
        return None
    if not limit_text.isdigit() or int(limit_text) >= NO_LIMIT_FROM:  # "max", or v1's no limit
        return None
    stat = _stat(folder)
    reclaimable = stat.get(layout.inactive_file, 0) + stat.get(layout.active_file, 0) // 2
    return max(0, int(limit_text) - max(0, usage - reclaimable))


def _stat(folder: Path) -> dict[str, int]:
    try:
        lines = (folder / "memory.stat").read_text().splitlines()
    except OSError:
        return {}
    pairs = (line.partition(" ") for line in lines)
    return {key: int(value) for key, _, value in pairs if value.strip().isdigit()}

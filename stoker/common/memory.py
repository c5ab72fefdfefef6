"""How much memory this process can still use: the machine's `MemAvailable`, or less where its memory cgroup (a
container's `--memory`, a Kubernetes limit, a Slurm job) allows less. A container sees the host's /proc/meminfo:
on a 1 TB host with a 32 GB limit, MemAvailable alone would let 500 producers start into the OOM killer.
"""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as the largest page-aligned 64-bit number
# (limit, usage) files of each cgroup version, and where its memory hierarchy is mounted under CGROUP_ROOT.
V2 = ("memory.max", "memory.current", "inactive_file", "")
V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file", "memory")


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
    """The smallest (limit - usage) of this process's memory cgroups, usage without the inactive page cache the
    kernel reclaims before it kills (as `docker stats` counts it). Each is read at the path /proc/self/cgroup names
    and at the hierarchy's root: a container without its own cgroup namespace lists the host's path but has its own
    cgroup mounted at the root."""
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
        mount = cgroup_root / layout[3]
        for folder in dict.fromkeys((mount / path.lstrip("/"), mount)):
            if (headroom := _headroom(folder, *layout[:3])) is not None:
                headrooms.append(headroom)
    return min(headrooms) if headrooms else None


def _headroom(folder: Path, limit_file: str, usage_file: str, reclaimable_stat: str) -> int | None:
    try:
        limit_text = (folder / limit_file).read_text().strip()
        usage = int((folder / usage_file).read_text())
    except (OSError, ValueError):
        return None
    if not limit_text.isdigit() or int(limit_text) >= UNLIMITED:  # "max", or v1's unlimited
        return None
    return max(0, int(limit_text) - (usage - _stat(folder, reclaimable_stat)))


def _stat(folder: Path, name: str) -> int:
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0

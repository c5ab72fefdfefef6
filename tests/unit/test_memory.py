"""The memory a run may use: MemAvailable, or a memory cgroup's limit less its usage where lower. The files are
written as the kernel writes them (Documentation/admin-guide/cgroup-v2.rst and cgroup-v1/memory.rst)."""

from __future__ import annotations

from pathlib import Path

from stoker.common.memory import available_memory, cgroup_headroom, meminfo_available

GiB = 2**30
HOST_MEMINFO = "MemTotal:       1056318976 kB\nMemFree:        20000000 kB\nMemAvailable:   1000000000 kB\n"


def machine(tmp_path: Path, cgroup_lines: str, files: dict[str, str]) -> tuple[Path, Path]:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(HOST_MEMINFO)
    (proc / "self" / "cgroup").write_text(cgroup_lines)
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)
    return proc, root


def test_a_v2_container_limit_below_the_hosts_memory_is_what_is_available(tmp_path):
    """32 GiB limit, 4 GiB charged of which 1 GiB inactive page cache (reclaimed before any OOM kill): 29 GiB."""
    proc, root = machine(tmp_path, "0::/\n", {"memory.max": f"{32 * GiB}\n", "memory.current": f"{4 * GiB}\n",
                                              "memory.stat": f"anon {3 * GiB}\nfile {GiB}\ninactive_file {GiB}\n"})
    assert available_memory(proc, root) == 29 * GiB
    assert meminfo_available(proc) == 1000000000 * 1024


def test_no_v2_limit_leaves_meminfo(tmp_path):
    proc, root = machine(tmp_path, "0::/user.slice\n", {"user.slice/memory.max": "max\n",
                                                         "user.slice/memory.current": f"{GiB}\n"})
    assert cgroup_headroom(proc, root) is None
    assert available_memory(proc, root) == 1000000000 * 1024


def test_a_v1_container_sees_its_own_cgroup_at_the_root_of_the_hierarchy(tmp_path):
    """Docker on cgroup v1 without a cgroup namespace: /proc/self/cgroup names the host's path, which does not
    exist inside the container; the container's limit is at the mount's root."""
    proc, root = machine(tmp_path, "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/docker/abc\n",
                         {"memory/memory.limit_in_bytes": f"{8 * GiB}\n",
                          "memory/memory.usage_in_bytes": f"{2 * GiB}\n",
                          "memory/memory.stat": f"cache {GiB}\ntotal_inactive_file {GiB // 2}\n"})
    assert available_memory(proc, root) == 8 * GiB - 2 * GiB + GiB // 2


def test_a_v2_limit_on_an_ancestor_counts_when_the_leaf_has_none(tmp_path):
    """Slurm's layout: the job's cgroup holds the limit, the task's below it says max. Half the active page cache
    counts as reclaimable, as MemAvailable counts it."""
    job = "system.slice/slurmstepd.scope/job_7"
    proc, root = machine(tmp_path, f"0::/{job}/step_0/user/task_0\n", {
        f"{job}/memory.max": f"{4 * GiB}\n", f"{job}/memory.current": f"{3 * GiB}\n",
        f"{job}/memory.stat": f"active_file {GiB}\ninactive_file {GiB // 2}\n",
        f"{job}/step_0/user/task_0/memory.max": "max\n", f"{job}/step_0/user/task_0/memory.current": f"{GiB}\n"})
    assert cgroup_headroom(proc, root) == 4 * GiB - (3 * GiB - GiB // 2 - GiB // 2)


def test_the_tightest_of_nested_limits_counts_and_v1s_unlimited_is_no_limit(tmp_path):
    proc, root = machine(tmp_path, "4:memory:/slurm/job_7\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": f"{GiB}\n",
        "memory/slurm/job_7/memory.limit_in_bytes": f"{3 * GiB}\n",
        "memory/slurm/job_7/memory.usage_in_bytes": f"{GiB}\n"})
    assert cgroup_headroom(proc, root) == 2 * GiB


def test_over_the_limit_is_none_available_and_unreadable_files_are_no_figure(tmp_path):
    proc, root = machine(tmp_path, "0::/\n", {"memory.max": f"{GiB}\n", "memory.current": f"{2 * GiB}\n"})
    assert available_memory(proc, root) == 0
    assert available_memory(tmp_path / "nowhere", tmp_path / "nothing") is None


def test_this_machines_own_files_give_a_figure():
    available = available_memory()
    assert meminfo_available() is not None and available is not None and available > 0

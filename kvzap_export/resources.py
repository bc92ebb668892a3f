"""What this process may use of the machine: cores and memory, container limits included.

``os.sched_getaffinity`` and ``/proc/meminfo`` describe the host: inside a container (Docker ``--cpus``/``--memory``,
a Kubernetes pod, a CI runner) the cgroup's CPU quota and memory limit are what the process really gets. Both cgroup
versions are read: v2 (``cpu.max``, ``memory.max`` - ``memory.current``) and v1 (``cpu.cfs_quota_us`` /
``cpu.cfs_period_us``, ``memory.limit_in_bytes`` - ``memory.usage_in_bytes``), in the process's own cgroup (from
``/proc/self/cgroup``) and every parent up to the mount point; the tightest limit wins.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def _membership(text: str | None = None) -> dict[str, tuple[str, str]]:
    """controller (``""`` for cgroup v2) -> (the process's cgroup path, the hierarchy's joined controller names, e.g.
    ``cpu,cpuacct``), from ``/proc/self/cgroup``."""
    if text is None:
        try:
            text = Path("/proc/self/cgroup").read_text()
        except OSError:
            return {}
    paths: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths[controller.removeprefix("name=")] = (parts[2], parts[1])
    return paths


def _levels(root: Path, membership: dict[str, tuple[str, str]], controller: str,
            names: tuple[str, ...]) -> Iterator[list[str]]:
    """The contents of ``names`` at each level that has them, from the process's cgroup of ``controller`` up to its
    hierarchy's top (v2: ``root``; v1: ``root/controller`` or ``root/cpu,cpuacct``): a limit set on a parent (a
    systemd slice, a Kubernetes pod) binds the process as much as its own. Where a cgroup namespace hides the path, the
    top is the process's own cgroup."""
    if controller not in membership:
        return
    path, joined = membership[controller]
    tops = [root] if not controller else list(dict.fromkeys([root / controller, root / joined]))
    top = next((candidate for candidate in tops if candidate.is_dir()), None)
    if top is None:
        return
    relative = PurePosixPath(path.lstrip("/"))
    for level in [relative, *relative.parents]:
        try:
            yield [(top / level / name).read_text().strip() for name in names]
        except OSError:
            continue


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, cgroup_text: str | None = None) -> int | None:
    """Cores the tightest CPU quota of the process's cgroup and its parents allows (rounded up), or None without one."""
    membership = _membership(cgroup_text)
    quotas = []
    for (value,) in _levels(root, membership, "", ("cpu.max",)):
        quota, _, period = value.partition(" ")
        if quota != "max" and period:
            quotas.append(int(quota) / int(period))
    for quota, period in _levels(root, membership, "cpu", ("cpu.cfs_quota_us", "cpu.cfs_period_us")):
        if int(quota) > 0 and int(period) > 0:
            quotas.append(int(quota) / int(period))
    return max(1, math.ceil(min(quotas))) if quotas else None


def cgroup_memory_room(root: Path = CGROUP_ROOT, cgroup_text: str | None = None) -> int | None:
    """Bytes the tightest memory limit of the process's cgroup and its parents still leaves, or None without one:
    limit - usage, where the usage leaves out the inactive file cache (the kernel reclaims it before it kills
    anything; ``docker stats`` counts the same way)."""
    membership = _membership(cgroup_text)
    rooms = []
    for controller, names, cache in (("", ("memory.max", "memory.current", "memory.stat"), "inactive_file"),
                                     ("memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat"),
                                      "total_inactive_file")):
        for limit, usage, stat_text in _levels(root, membership, controller, names):
            if limit != "max" and int(limit) < _UNLIMITED:
                stat = dict(line.split(" ", 1) for line in stat_text.splitlines() if " " in line)
                used = int(usage) - int(stat.get(cache, 0))
                rooms.append(max(0, int(limit) - max(0, used)))
    return min(rooms) if rooms else None


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by its cgroup's CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        quota = cgroup_cpu_limit()
    except (OSError, ValueError):
        quota = None
    return max(1, min(cores, quota or cores))


def available_memory() -> int | None:
    """Bytes this process can still allocate without swapping or being killed: the host's MemAvailable, capped by its
    cgroup's remaining memory; None where neither can be read (not Linux)."""
    host = None
    try:
        with open("/proc/meminfo") as meminfo:
            host = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    try:
        room = cgroup_memory_room()
    except (OSError, ValueError):
        room = None
    known = [value for value in (host, room) if value is not None]
    return min(known) if known else None

"""What this process may use of the machine: cores and memory, container limits included.

``os.sched_getaffinity`` and ``/proc/meminfo`` describe the host: inside a container (Docker ``--cpus``/``--memory``,
a Kubernetes pod, a CI runner) the cgroup's CPU quota and memory limit are what the process really gets. Both cgroup
versions are read: v2 (``cpu.max``, ``memory.max`` - ``memory.current``) and v1 (``cpu.cfs_quota_us`` /
``cpu.cfs_period_us``, ``memory.limit_in_bytes`` - ``memory.usage_in_bytes``), in the process's own cgroup (from
``/proc/self/cgroup``) or, where a cgroup namespace shows it as the root, at the mount point.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def _membership(text: str | None = None) -> dict[str, str]:
    """controller (``""`` for cgroup v2) -> the process's cgroup path, from ``/proc/self/cgroup``."""
    if text is None:
        try:
            text = Path("/proc/self/cgroup").read_text()
        except OSError:
            return {}
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths[controller.removeprefix("name=")] = parts[2]
    return paths


def _read(root: Path, membership: dict[str, str], controller: str, names: tuple[str, ...]) -> list[str] | None:
    """The contents of ``names`` in the process's cgroup of ``controller`` (v1: ``root/controller/...``, v2: ``root/...``),
    or at that hierarchy's top; None where the files are not there."""
    if controller not in membership:
        return None
    top = root / controller if controller else root
    for directory in (top / membership[controller].lstrip("/"), top):
        try:
            return [(directory / name).read_text().strip() for name in names]
        except OSError:
            continue
    return None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, cgroup_text: str | None = None) -> int | None:
    """Cores the cgroup's CPU quota allows (rounded up), or None without a quota."""
    membership = _membership(cgroup_text)
    values = _read(root, membership, "", ("cpu.max",))
    if values is not None:
        quota, _, period = values[0].partition(" ")
        if quota != "max" and period:
            return max(1, math.ceil(int(quota) / int(period)))
    values = _read(root, membership, "cpu", ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
    if values is not None and int(values[0]) > 0 and int(values[1]) > 0:
        return max(1, math.ceil(int(values[0]) / int(values[1])))
    return None


def cgroup_memory_room(root: Path = CGROUP_ROOT, cgroup_text: str | None = None) -> int | None:
    """Bytes the cgroup's memory limit still leaves, or None without a limit: limit - usage, where the usage leaves out
    the inactive file cache (the kernel reclaims it before it kills anything; ``docker stats`` counts the same way)."""
    membership = _membership(cgroup_text)
    for controller, names, cache in (("", ("memory.max", "memory.current", "memory.stat"), "inactive_file"),
                                     ("memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat"),
                                      "total_inactive_file")):
        values = _read(root, membership, controller, names)
        if values is not None and values[0] != "max" and int(values[0]) < _UNLIMITED:
            stat = dict(line.split(" ", 1) for line in values[2].splitlines() if " " in line)
            used = int(values[1]) - int(stat.get(cache, 0))
            return max(0, int(values[0]) - max(0, used))
    return None


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

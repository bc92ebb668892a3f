"""Cores and memory this process may use: CPU affinity and MemAvailable, capped by a container's cgroup limits."""

import pytest

from kvzap_export import resources
from kvzap_export.resources import cgroup_cpu_limit, cgroup_memory_room

V2 = "0::/job.slice/runner\n"
V1 = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n"


def _files(root, directory, **files):
    target = root / directory
    target.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (target / name.replace("_", ".", 1)).write_text(text)


@pytest.mark.parametrize(("quota", "cores"), [("150000 100000", 2), ("200000 100000", 2), ("50000 100000", 1),
                                             ("max 100000", None)])
def test_cgroup_v2_cpu_quota_in_the_process_cgroup(tmp_path, quota, cores):
    _files(tmp_path, "job.slice/runner", cpu_max=quota)
    assert cgroup_cpu_limit(tmp_path, V2) == cores


def test_cgroup_v1_cpu_quota_and_no_quota(tmp_path):
    _files(tmp_path, "cpu/docker/abc", cpu_cfs_quota_us="300000", cpu_cfs_period_us="100000")
    assert cgroup_cpu_limit(tmp_path, V1) == 3
    _files(tmp_path, "cpu/docker/abc", cpu_cfs_quota_us="-1", cpu_cfs_period_us="100000")
    assert cgroup_cpu_limit(tmp_path, V1) is None


def test_cgroup_v2_memory_room_leaves_out_the_inactive_file_cache(tmp_path):
    _files(tmp_path, "job.slice/runner", memory_max="1000000", memory_current="700000",
           memory_stat="anon 500000\ninactive_file 200000\nactive_file 0\n")
    assert cgroup_memory_room(tmp_path, V2) == 1000000 - (700000 - 200000)


def test_a_cgroup_namespace_shows_the_limit_at_the_mount_point(tmp_path):
    _files(tmp_path, ".", memory_max="4096", memory_current="1024", memory_stat="")
    assert cgroup_memory_room(tmp_path, "0::/\n") == 3072
    assert cgroup_memory_room(tmp_path, V2) == 3072  # the named cgroup is not mounted here: its top is read


def test_cgroup_v1_memory_limit_and_unlimited(tmp_path):
    _files(tmp_path, "memory/docker/abc", memory_limit_in_bytes="8000", memory_usage_in_bytes="3000",
           memory_stat="total_inactive_file 1000\n")
    assert cgroup_memory_room(tmp_path, V1) == 6000
    _files(tmp_path, "memory/docker/abc", memory_limit_in_bytes="9223372036854771712")
    assert cgroup_memory_room(tmp_path, V1) is None
    _files(tmp_path, "job.slice/runner", memory_max="max", memory_current="5", memory_stat="")
    assert cgroup_memory_room(tmp_path, V2) is None


def test_the_tightest_limit_of_the_cgroup_and_its_parents_binds(tmp_path):
    _files(tmp_path, "job.slice", memory_max="5000", memory_current="1000", memory_stat="", cpu_max="100000 100000")
    _files(tmp_path, "job.slice/runner", memory_max="max", memory_current="900", memory_stat="", cpu_max="max 100000")
    assert cgroup_memory_room(tmp_path, V2) == 4000 and cgroup_cpu_limit(tmp_path, V2) == 1  # the slice's limits
    _files(tmp_path, "job.slice/runner", memory_max="2000", memory_current="900", memory_stat="", cpu_max="max 100000")
    assert cgroup_memory_room(tmp_path, V2) == 1100  # its own, tighter than the slice's


def test_cgroup_v1_cpu_mounted_under_its_joined_name(tmp_path):
    _files(tmp_path, "cpu,cpuacct/docker/abc", cpu_cfs_quota_us="150000", cpu_cfs_period_us="100000")
    assert cgroup_cpu_limit(tmp_path, V1) == 2


def test_no_cgroup_files_mean_no_limit(tmp_path):
    assert cgroup_cpu_limit(tmp_path, V2) is None and cgroup_memory_room(tmp_path, V1) is None


def test_usable_cores_and_memory_are_capped_by_the_cgroup(monkeypatch):
    import os

    affinity = len(os.sched_getaffinity(0))
    monkeypatch.setattr(resources, "cgroup_cpu_limit", lambda: None)
    assert resources.usable_cores() == affinity
    monkeypatch.setattr(resources, "cgroup_cpu_limit", lambda: 1)
    assert resources.usable_cores() == 1
    monkeypatch.setattr(resources, "cgroup_cpu_limit", lambda: affinity + 8)  # a quota above the affinity: affinity
    assert resources.usable_cores() == affinity

    monkeypatch.setattr(resources, "cgroup_memory_room", lambda: None)
    host = resources.available_memory()
    assert host is not None and host > 0  # MemAvailable
    monkeypatch.setattr(resources, "cgroup_memory_room", lambda: 12345)
    assert resources.available_memory() == 12345

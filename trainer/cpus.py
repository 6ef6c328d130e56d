"""How many CPUs this process may use: the cores it may run on, capped by its cgroup's CPU quota.

A pod's CPU limit is a CFS quota, not an affinity: `os.sched_getaffinity` still names every core of the node, and a
process that starts a worker or a thread per core there runs them all on the quota's share, throttled, and holds
the memory of each. The quota is read as the Go runtime reads it for GOMAXPROCS: the cgroup of the `cpu`
controller (cgroup v1) or the unified one (v2) from /proc/self/cgroup, found under its mount in
/proc/self/mountinfo, and the smallest quota from there up to the mount's root. Stdlib only: `ctl` imports it.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

ROOT = Path("/")


def usable_cpus(root: Path = ROOT) -> int:
    """The cores this process may run on, at most the quota rounded up (0.25 CPUs: 1), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cpu_quota(root)
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def cpu_quota(root: Path = ROOT) -> float | None:
    """The CPUs the cgroup quota allows this process (1.5 for a limit of 1500m), or None when it has none."""
    try:
        found = cgroup_directory(root)
        if found is None:
            return None
        directory, mount_point, version = found
        quotas = [read_quota(directory, version)]
        while directory != mount_point:  # a pod's limit is on the pod's cgroup and on its container's
            directory = directory.parent
            quotas.append(read_quota(directory, version))
        return min((quota for quota in quotas if quota is not None), default=None)
    except (OSError, ValueError):  # an unreadable or unfamiliar cgroup file system: no quota known
        return None


def cgroup_directory(root: Path) -> tuple[Path, Path, int] | None:
    """The directory of this process's CPU cgroup, its mount point, and the cgroup version, or None without one."""
    paths = {}  # version -> this process's cgroup path in that hierarchy
    for line in (root / "proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            paths.setdefault(2, path)
        elif "cpu" in controllers.split(","):
            paths[1] = path
    # A v1 cpu controller (hybrid hosts too) is the one that holds the quota; v2's is then empty.
    version = 1 if 1 in paths else 2
    if version not in paths:
        return None
    for line in (root / "proc/self/mountinfo").read_text().splitlines():
        fields, _, after = line.partition(" - ")
        mount_root, mount_point = fields.split()[3:5]
        fs_type, _, options = after.split()[:3]
        if fs_type != ("cgroup" if version == 1 else "cgroup2"):
            continue
        if version == 1 and "cpu" not in options.split(","):
            continue
        mount = root / unescape(mount_point).lstrip("/")
        # Inside a container the mount's root is the container's own cgroup (or "/" with a cgroup namespace, where
        # the path reads "/" too); on a host it is the hierarchy's root and the path is below it.
        relative = os.path.relpath(paths[version], unescape(mount_root))
        return (mount if relative.startswith("..") else mount / relative), mount, version
    return None


def read_quota(directory: Path, version: int) -> float | None:
    """The quota of one cgroup, None when unlimited or when the level has no such file (v2's root)."""
    try:
        if version == 2:
            quota, period = (directory / "cpu.max").read_text().split()
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int((directory / "cpu.cfs_quota_us").read_text())
    except FileNotFoundError:
        return None
    return None if quota_us < 0 else quota_us / int((directory / "cpu.cfs_period_us").read_text())


def unescape(path: str) -> str:
    """mountinfo's octal escapes (a space is \\040)."""
    return re.sub(r"\\([0-7]{3})", lambda escape: chr(int(escape.group(1), 8)), path)

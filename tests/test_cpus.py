"""trainer.cpus: the CPUs a process may use, its cgroup's CPU quota included, on the cgroup layouts a process meets
(a container's view of v1 and v2, a host's, a hybrid host) and, for real, under a quota this machine sets."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from trainer.cpus import ROOT, cgroup_directory, cpu_quota, usable_cpus

REPO = Path(__file__).resolve().parents[1]
CORES = len(os.sched_getaffinity(0))
V1_MOUNT = "30 24 0:27 {root} /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct"
V1_OTHER = "31 24 0:28 {root} /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory"
V2_MOUNT = "29 24 0:26 {root} /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"
POD = "/kubepods/burstable/pod1234"
CONTAINER = f"{POD}/abcdef"


def fake_root(tmp_path: Path, cgroup: list[str], mounts: list[str], files: dict[str, str]) -> Path:
    """A /proc/self and /sys/fs/cgroup under `tmp_path`, as a process in that cgroup layout reads them."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("".join(line + "\n" for line in cgroup))
    other = "22 1 0:21 / /proc rw - proc proc rw"
    (tmp_path / "proc/self/mountinfo").write_text("".join(line + "\n" for line in [other, *mounts]))
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    return tmp_path


def v1_quota(directory: str, quota_us: int, period_us: int = 100000) -> dict[str, str]:
    return {f"{directory}/cpu.cfs_quota_us": str(quota_us), f"{directory}/cpu.cfs_period_us": str(period_us)}


def v1_host(pod_quota_us: int, container_quota_us: int, container_period_us: int = 100000) -> tuple[Any, ...]:
    """A pod's container seen from the host (no cgroup namespace): no quota at the root, then the pod's and its own."""
    directory = "sys/fs/cgroup/cpu,cpuacct"
    quotas = v1_quota(directory, -1) | v1_quota(f"{directory}{POD}", pod_quota_us)
    quotas |= v1_quota(f"{directory}{CONTAINER}", container_quota_us, container_period_us)
    return [f"3:cpu,cpuacct:{CONTAINER}"], [V1_MOUNT.format(root="/")], quotas


LAYOUTS = {
    # runc on cgroup v1 without a cgroup namespace: the full path, and the container's cgroup mounted as the root.
    "v1 container, 250m": (
        [f"4:memory:{CONTAINER}", f"3:cpu,cpuacct:{CONTAINER}", "0::/"],
        [V1_MOUNT.format(root=CONTAINER), V1_OTHER.format(root=CONTAINER)],
        v1_quota("sys/fs/cgroup/cpu,cpuacct", 25000),
        0.25,
    ),
    # A host's process (ctl run) in a pod's cgroup: the pod's limit and the container's, the smaller one counts.
    "v1 host, pod 3 and container 1.5": (*v1_host(300000, 75000, 50000), 1.5),
    "v1 host, the pod's limit only": (*v1_host(200000, -1), 2.0),
    "v1 without a quota": (
        [f"3:cpu,cpuacct:{CONTAINER}"],
        [V1_MOUNT.format(root=CONTAINER)],
        v1_quota("sys/fs/cgroup/cpu,cpuacct", -1),
        None,
    ),
    # A hybrid host: the cpu controller is v1's, whatever the unified hierarchy's files say.
    "hybrid": (
        ["3:cpu,cpuacct:/job", "0::/job"],
        [V2_MOUNT.format(root="/").replace("/sys/fs/cgroup ", "/sys/fs/cgroup/unified "), V1_MOUNT.format(root="/")],
        v1_quota("sys/fs/cgroup/cpu,cpuacct", -1)
        | v1_quota("sys/fs/cgroup/cpu,cpuacct/job", 400000)
        | {"sys/fs/cgroup/unified/job/cpu.max": "100000 100000"},
        4.0,
    ),
    # cgroup v2 with a cgroup namespace (containerd's default there): "/" in both files, the root has no cpu.max.
    "v2 container, 1500m": (["0::/"], [V2_MOUNT.format(root="/")], {"sys/fs/cgroup/cpu.max": "150000 100000"}, 1.5),
    "v2 unlimited": (["0::/"], [V2_MOUNT.format(root="/")], {"sys/fs/cgroup/cpu.max": "max 100000"}, None),
    "v2 host, a limit above": (
        ["0::/user.slice/ctl.scope"],
        [V2_MOUNT.format(root="/")],
        {
            "sys/fs/cgroup/user.slice/cpu.max": "50000 100000",
            "sys/fs/cgroup/user.slice/ctl.scope/cpu.max": "max 100000",
        },
        0.5,
    ),
    "no cgroup file system mounted": (["0::/"], [], {}, None),
    "an unreadable quota": (["0::/"], [V2_MOUNT.format(root="/")], {"sys/fs/cgroup/cpu.max": "lots"}, None),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_quota_of_the_process_cgroup_and_its_ancestors(tmp_path: Path, layout: str) -> None:
    cgroup, mounts, files, expected = LAYOUTS[layout]
    root = fake_root(tmp_path, cgroup, mounts, files)
    assert cpu_quota(root) == expected
    assert usable_cpus(root) == (CORES if expected is None else max(1, min(CORES, math.ceil(expected))))


def test_a_quota_above_the_cores_leaves_the_cores(tmp_path: Path) -> None:
    root = fake_root(
        tmp_path, ["0::/"], [V2_MOUNT.format(root="/")], {"sys/fs/cgroup/cpu.max": f"{CORES + 8}00000 100000"}
    )
    assert usable_cpus(root) == CORES


def test_a_process_under_a_real_quota_counts_one_cpu(tmp_path: Path) -> None:
    """A child of this process's own cpu cgroup with half a CPU of quota, set through the kernel's cgroup file system
    as a kubelet sets a pod's limit: a process moved into it counts 1 CPU, on a machine of any size."""
    found = cgroup_directory(ROOT)
    assert found is not None, "no cpu cgroup: the tier's kubelet needs one too"
    directory, _, version = found
    child = directory / f"ddpjob-test-{uuid.uuid4().hex[:8]}"
    child.mkdir()
    try:
        if version == 2:
            (child / "cpu.max").write_text("50000 100000")
        else:
            (child / "cpu.cfs_quota_us").write_text("50000")
        code = "from trainer.cpus import cpu_quota, usable_cpus; print(cpu_quota(), usable_cpus())"
        moved = f'echo $$ > {child}/cgroup.procs && exec {sys.executable} -c "{code}"'
        result = subprocess.run(["sh", "-c", moved], cwd=REPO, capture_output=True, text=True, check=False)
        assert (result.returncode, result.stdout.split()) == (0, ["0.5", "1"]), result.stderr
    finally:
        child.rmdir()  # the process has exited: the cgroup is empty

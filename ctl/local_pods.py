"""A job's pods as `ctl run` starts them: the chart rendered as for a cluster, each pod's trainer container made a
local process through ctl/pod.py (the code the e2e pod executor uses too): its command, args and env as rendered,
its mounted ConfigMap's files (training.yaml) in a directory of the run, and every mount path rewritten to its local
directory.

What stands in for a node: a claim is ./runs (so the chart's run directory, <storage.mountPath>/<name>, is
./runs/<name>); the pod's HOME is this user's home, with its caches; an emptyDir is this machine's directory of
that path where one exists (/tmp, /dev/shm), else a directory of the run per node.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ctl.kinds import Replica
from ctl.kinds.trainjob import COMPLETION_INDEX_LABEL
from ctl.pod import LocalContainer, PodSetupError, Volume, local_container
from ctl.processes import LOCAL_ADDRESS
from ctl.render import Manifest, chart_values, render_chart, split_manifests
from ctl.spec import JobSpec
from trainer.cpus import usable_cpus
from trainer.location import S3Location, is_s3, run_cache

NAMESPACE = "default"
# Every PersistentVolumeClaim of a local run: the chart's run directory <mountPath>/<name> is ./runs/<name> here.
LOCAL_CLAIMS = Path("runs")
# The pod label holding a TrainJob node's completion index (a fieldRef a pod may read).
COMPLETION_INDEX_FIELD = f"metadata.labels['{COMPLETION_INDEX_LABEL}']"


@dataclass(frozen=True)
class LocalNode:
    """One pod of the job, ready to start here: which replica, and its container as a local process."""

    replica: Replica
    container: LocalContainer


@dataclass(frozen=True)
class LocalJob:
    """The job's pods as rendered, materialised under `work_dir` (ConfigMaps written, mount paths rewritten)."""

    nodes: list[LocalNode]
    location: str  # the run directory the nodes' training config names: a directory, or an s3:// URI
    work_dir: Path

    @property
    def run_dir(self) -> Path:
        """The run directory on this machine: the location, or the node-local side of one on object storage."""
        return run_cache(S3Location.parse(self.location)) if is_s3(self.location) else Path(self.location)


def rendered_pods(manifests: list[Manifest], spec: JobSpec) -> dict[Replica, dict[str, Any]]:
    """Each replica's pod spec as the operator creates it from the rendered job object."""
    return spec.kind.replica_pods({m.kind: m.obj for m in manifests}, spec)


@contextlib.contextmanager
def local_job(spec: JobSpec, run_dir: Path | None = None) -> Iterator[LocalJob]:
    """Render the job (`run_dir`: its training.checkpoint.dir, as `--run-dir` asks) and materialise its pods in a
    temporary directory, removed afterwards. PodSetupError when a pod needs what this machine cannot give."""
    values = chart_values(spec)
    # Every local pod shares this machine: each requests its share of the CPUs ctl may use, not what a cluster's
    # node would grant it, so the chart's OMP_NUM_THREADS divides this machine among all local processes.
    values["resources"]["cpu"] = f"{usable_cpus() * 1000 // spec.nodes}m"
    if run_dir is not None:
        values["training"].setdefault("checkpoint", {})["dir"] = str(run_dir.absolute())
    manifests = split_manifests(render_chart(values, spec.name, NAMESPACE))
    config_maps = {m.name: m.obj for m in manifests if m.kind == "ConfigMap"}
    with tempfile.TemporaryDirectory(prefix="ddpjob-") as tmp:
        work_dir = Path(tmp)
        nodes = []
        for replica, pod in rendered_pods(manifests, spec).items():
            pod_dir = work_dir / replica.pod_name(spec.name)

            def volume_dir(volume: Volume, pod_dir: Path = pod_dir) -> Path:
                return local_volume(volume, pod_dir, config_maps)

            fields = {
                "metadata.name": replica.pod_name(spec.name),
                "metadata.namespace": NAMESPACE,
                "spec.nodeName": socket.gethostname(),
                "status.podIP": LOCAL_ADDRESS,
                "status.hostIP": LOCAL_ADDRESS,
                COMPLETION_INDEX_FIELD: str(replica.index),
            }
            container = local_container(pod, volume_dir, fields, lambda name, source: None, provided_dirs(pod))
            nodes.append(LocalNode(replica, container))
        yield LocalJob(nodes, training_location(pod, container), work_dir)  # every node's config names the same


def local_volume(volume: Volume, pod_dir: Path, config_maps: dict[str, dict[str, Any]]) -> Path:
    """A volume of a local pod: a claim is ./runs; a ConfigMap the chart rendered, its files in the pod's directory;
    an emptyDir, a directory of the pod's."""
    if "persistentVolumeClaim" in volume:
        return LOCAL_CLAIMS.absolute()
    directory = pod_dir / "volumes" / volume["name"]
    if "configMap" in volume:
        name = volume["configMap"]["name"]
        if name not in config_maps:
            raise PodSetupError(f"volume {volume['name']}: ConfigMap {name} is not one the chart renders")
        directory.mkdir(parents=True)
        for key, text in (config_maps[name].get("data") or {}).items():
            (directory / key).write_text(text, encoding="utf-8")
    elif "emptyDir" in volume:
        directory.mkdir(parents=True)
    else:
        kind = next((key for key in volume if key != "name"), "unknown")
        raise PodSetupError(f"volume {volume['name']}: ctl run cannot provide a {kind} volume")
    return directory


def provided_dirs(pod: dict[str, Any]) -> dict[str, Path]:
    """Mounts that are this machine's own directories: the pod's HOME is this user's (a laptop keeps its caches),
    and an emptyDir mounted where this machine has a directory (/tmp, /dev/shm) is that directory."""
    container = pod["containers"][0]
    empty_dirs = {v["name"] for v in pod.get("volumes") or [] if "emptyDir" in v}
    provided = {
        m["mountPath"]: Path(m["mountPath"])
        for m in container.get("volumeMounts") or []
        if m["name"] in empty_dirs and Path(m["mountPath"]).is_dir()
    }
    home = next((var.get("value") for var in container.get("env") or [] if var["name"] == "HOME"), None)
    return provided | ({home.rstrip("/"): Path.home()} if home else {})


def training_location(pod: dict[str, Any], container: LocalContainer) -> str:
    """The run directory named by the training config (the mounted ConfigMap file that the command reads): an
    absolute path, or an s3:// URI."""
    config_volumes = {v["name"] for v in pod.get("volumes") or [] if "configMap" in v}
    config_dirs = [
        container.mounts[m["mountPath"].rstrip("/")]
        for m in pod["containers"][0].get("volumeMounts") or []
        if m["name"] in config_volumes
    ]
    for arg in container.command:
        path = Path(arg)
        if path.is_file() and any(path.is_relative_to(directory) for directory in config_dirs):
            checkpoint = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("checkpoint") or {}
            location = checkpoint.get("dir") or str(LOCAL_CLAIMS)
            return location if is_s3(location) else str(Path(location).absolute())
    raise PodSetupError(f"the trainer's command reads no file of its mounted ConfigMap: {container.command}")

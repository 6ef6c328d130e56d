"""The training image that `make image` builds (tests/image.py), run as the chart runs it, and what is in it.

The pod is the quickstart's master as `ctl render` renders it: its security context (uid/gid 1000, fsGroup, read-only
root, no privilege escalation, no capabilities), its volumes (the ConfigMap's training.yaml, the claim, the scratch
emptyDir's subPaths at HOME and /tmp, /dev/shm in memory) as a kubelet lays them out, its command and env, and the
env the training operator adds. podman runs it with no network (loopback only), the image's name as the chart's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path
from typing import Any

import image as image_module
import pytest
import yaml
from conftest import REPO, run_ctl
from image import STAND_IN_REPOSITORY, Image, ensure_image, export, local_image, podman_env
from packaging.requirements import Requirement

from ctl.operator_env import Replica, operator_env
from ctl.pod import container_env
from ctl.spec import load_spec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

QUICKSTART = REPO / "examples" / "quickstart.yaml"
# A few steps: seconds of training, then the final checkpoint, evaluation, export and report.
OVERRIDES = ["training.maxSteps=10"]
RUN_TIMEOUT_SECONDS = 300
# Measured: the stand-in base is 5.81 GB (torch 2.14.1 with its CUDA 13 wheels, 5.3 GB), the Dockerfile's layers add
# 0.78 GB (the train extra's packages, jemalloc, g++ 0.26 GB, the project): 6.59 GB in all.
MAX_ADDED_BYTES = 850_000_000
MAX_STAND_IN_IMAGE_BYTES = 6_800_000_000
# What a build may leave behind: its requirements file, pip's and apt's caches and lists, setuptools' build tree.
LEFTOVERS = (
    "/tmp/*",
    "/root/.cache/pip",
    "/home/ddpjob/.cache/pip",
    "/var/lib/apt/lists/*_*",
    "/var/cache/apt/archives/*.deb",
    "/var/cache/apt/*.bin",
    "/opt/ddpjob/build",
    "/opt/ddpjob/*.egg-info",
)
QUANTITY = re.compile(r"(\d+)(Ki|Mi|Gi)?")


@pytest.fixture(scope="module")
def image() -> Image:
    return ensure_image()


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], env=podman_env(), capture_output=True, text=True, timeout=timeout)


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes quantity in the binary units the chart writes."""
    match = QUANTITY.fullmatch(quantity)
    assert match, f"quantity {quantity!r}: not one this test reads"
    return int(match.group(1)) * 1024 ** {None: 0, "Ki": 1, "Mi": 2, "Gi": 3}[match.group(2)]


def make_dir(path: Path, mode: int, gid: int | None) -> Path:
    """A volume directory as the kubelet makes it: owned by root, group fsGroup (setgid) when one is set."""
    path.mkdir(parents=True, exist_ok=True)
    if gid is not None:
        os.chown(path, 0, gid)
        mode |= 0o2000
    path.chmod(mode)
    return path


def pod_run_args(pod: dict[str, Any], config_maps: dict[str, dict[str, Any]], node: Path) -> tuple[list[str], dict]:
    """`podman run` options for the pod's one container, its volumes laid out under `node`; and the host directory
    of each mount path."""
    (container,) = pod["containers"]
    pod_security = pod.get("securityContext") or {}
    security = pod_security | (container.get("securityContext") or {})
    fs_group = pod_security.get("fsGroup")
    args = ["--user", f"{security['runAsUser']}:{security['runAsGroup']}"]
    args += ["--group-add", str(fs_group)] if fs_group is not None else []
    if security.get("readOnlyRootFilesystem"):
        args += ["--read-only", "--read-only-tmpfs=false"]  # a kubelet adds no tmpfs of its own
    if security.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    for capability in (security.get("capabilities") or {}).get("drop", []):
        args += ["--cap-drop", capability]
    if "memory" in (container.get("resources") or {}).get("limits", {}):
        args += ["--memory", str(quantity_bytes(container["resources"]["limits"]["memory"]))]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts: dict[str, Path] = {}
    for mount in container["volumeMounts"]:
        volume, path = volumes[mount["name"]], mount["mountPath"]
        if (volume.get("emptyDir") or {}).get("medium") == "Memory":
            size = quantity_bytes(volume["emptyDir"]["sizeLimit"])
            args += ["--mount", f"type=tmpfs,destination={path},tmpfs-size={size},tmpfs-mode=1777"]
            continue
        if "configMap" in volume:
            source = make_dir(node / "volumes" / mount["name"], 0o755, None)
            for key, text in config_maps[volume["configMap"]["name"]]["data"].items():
                (source / key).write_text(text)
                (source / key).chmod(0o644)
        elif "persistentVolumeClaim" in volume:
            source = make_dir(node / "claims" / volume["persistentVolumeClaim"]["claimName"], 0o775, fs_group)
        else:
            assert "emptyDir" in volume, f"volume {mount['name']}: not one this test lays out"
            source = make_dir(node / "volumes" / mount["name"], 0o777, fs_group)
        if mount.get("subPath"):  # made by the kubelet with the volume's own mode
            source = make_dir(source / mount["subPath"], 0o777, fs_group)
        mounts[path] = source
        args += ["--volume", f"{source}:{path}{':ro' if mount.get('readOnly') else ''}"]
    return args, mounts


def test_the_image_trains_the_quickstart_as_the_chart_runs_it(image: Image, tmp_path: Path) -> None:
    rendered = run_ctl("render", str(QUICKSTART), *[f"--set={o}" for o in OVERRIDES], cwd=REPO)
    assert rendered.returncode == 0, rendered.stderr
    manifests = [m for m in yaml.safe_load_all(rendered.stdout) if m]
    config_maps = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "ConfigMap"}
    (job,) = [m for m in manifests if m["kind"] == "PyTorchJob"]
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == image.reference  # the chart's default is the image `make image` built
    # The chart's command is the image's own: `docker run` of the image and the pod run the same thing.
    config = (local_image(f"docker.io/library/{image.reference}") or {})["Config"]
    assert config["Entrypoint"] + config["Cmd"] == container["command"] + container.get("args", [])

    spec = load_spec(QUICKSTART, OVERRIDES)
    replica = Replica("master", 0)
    name = replica.pod_name(spec.name)
    fields = {"metadata.name": name, "metadata.namespace": "default", "status.podIP": "127.0.0.1"}
    env = container_env(container, fields, lambda variable, source: None) | operator_env(spec, replica)
    options, mounts = pod_run_args(pod, config_maps, tmp_path)
    # Kubernetes' command replaces the image's entrypoint, and its args the image's CMD.
    entry = ["--entrypoint", json.dumps(container["command"])] if "command" in container else []
    container_name = f"ddpjob-test-{uuid.uuid4().hex[:12]}"
    command = [
        "run", "--rm", f"--name={container_name}", "--pull=never", "--network=none",
        f"--hostname={name}", f"--add-host={name}:127.0.0.1",  # the master Service's name is this pod
        *options, *[f"--env={key}={value}" for key, value in env.items()], *entry,
        image.reference, *container.get("args", []),
    ]  # fmt: skip
    try:
        result = podman(*command, timeout=RUN_TIMEOUT_SECONDS)
    finally:  # a run past its time keeps going without podman's client
        podman("rm", "--force", "--ignore", container_name)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]

    training = yaml.safe_load(config_maps[f"{spec.name}-training"]["data"]["training.yaml"])
    checkpoints = Path(training["checkpoint"]["dir"])
    claim_path = next(path for path in mounts if checkpoints.is_relative_to(path))
    run_dir = mounts[claim_path] / checkpoints.relative_to(claim_path)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["world_size"] == 2 and report["steps"] == 10
    assert {"config.json", "model.safetensors"} <= {p.name for p in (run_dir / "final").iterdir()}
    assert (run_dir / "report.json").stat().st_uid == 1000
    assert "step 10/10 | loss " in output, output[-4000:]


# Run in the image: its installed distributions, those the `train` extra needs (following each one's requirements
# with the image's own markers), and the build leftovers found.
INSPECT = """
import glob, importlib.metadata as metadata, json, re, sys
from pip._vendor.packaging.requirements import Requirement

def normalized(name):
    return re.sub(r"[-_.]+", "-", name).lower()

wanted, leftovers = json.loads(sys.argv[1]), json.loads(sys.argv[2])
installed = {normalized(d.metadata["Name"]): d for d in metadata.distributions()}
needed, pending = set(), [Requirement(r) for r in wanted]
while pending:
    requirement = pending.pop()
    name = normalized(requirement.name)
    if name in needed or name not in installed:
        continue
    needed.add(name)
    for line in installed[name].requires or []:
        child = Requirement(line)
        if not child.marker or any(child.marker.evaluate({"extra": e}) for e in requirement.extras or {""}):
            pending.append(child)
found = sorted(path for pattern in leftovers for path in glob.glob(pattern))
print(json.dumps({"installed": sorted(installed), "needed": sorted(needed), "leftovers": found}))
"""


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_image_has_the_trainer_without_client_dependencies_or_build_leftovers(image: Image) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    train = project["optional-dependencies"]["train"]
    train_names = {normalized(Requirement(r).name) for r in train}
    client_only = {normalized(Requirement(r).name) for r in project["dependencies"]} - train_names
    assert {"kubernetes", "typer", "helm-python-sdk"} <= client_only
    result = podman(
        "run", "--rm", "--pull=never", "--network=none", "--user=0", "--entrypoint=python", image.reference,
        "-c", INSPECT, json.dumps(train), json.dumps(LEFTOVERS),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout)
    installed, needed = set(found["installed"]), set(found["needed"])
    assert "ddpjob" in installed
    assert train_names <= needed  # the whole extra is there
    # A client dependency is there only where the trainer's own need it (transformers' CLI needs Typer).
    assert (client_only & installed) - needed == set()
    assert found["leftovers"] == []


def test_the_image_size_and_its_archive(image: Image) -> None:
    built, base = local_image(f"docker.io/library/{image.reference}"), local_image(image.base)
    assert built and base
    added = built["Size"] - base["Size"]
    assert added < MAX_ADDED_BYTES, f"the Dockerfile's layers add {added:,} bytes"
    if image.base.startswith(STAND_IN_REPOSITORY):
        assert built["Size"] < MAX_STAND_IN_IMAGE_BYTES, f"the image is {built['Size']:,} bytes"

    # The archive a node imports (`ctr -n k8s.io images import`): this image, under the name a kubelet resolves the
    # chart's `ddpjob:<appVersion>` to, layers uncompressed.
    with tarfile.open(image.archive) as archive:

        def blob(digest: str) -> dict[str, Any]:
            return json.load(archive.extractfile(f"blobs/{digest.replace(':', '/')}"))

        (manifest,) = json.load(archive.extractfile("index.json"))["manifests"]
        assert manifest["annotations"]["org.opencontainers.image.ref.name"] == f"docker.io/library/{image.reference}"
        layers = blob(manifest["digest"])
        assert layers["config"]["digest"] == f"sha256:{built['Id']}"
        assert {layer["mediaType"] for layer in layers["layers"]} == {"application/vnd.oci.image.layer.v1.tar"}


def test_an_export_removes_the_older_archives_before_it_writes_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new content's archive is 6 GB: written beside the old one, it once filled a CI machine's disk."""
    older = [tmp_path / f"ddpjob-0.1.0-{content}.oci.tar" for content in ("a" * 16, "b" * 16)]
    for path in older:
        path.write_bytes(b"an older content's image")
    there_while_saving: list[str] = []

    def podman(*args: str, **_: Any) -> str:  # podman save's file handling, without a 6 GB image
        there_while_saving.extend(path.name for path in tmp_path.iterdir())
        Path(args[args.index("--output") + 1]).write_bytes(b"this content's image")
        return ""

    monkeypatch.setattr(image_module, "CACHE", tmp_path)
    monkeypatch.setattr(image_module, "podman", podman)
    archive = export("docker.io/library/ddpjob:0.1.0", "c" * 64)
    assert there_while_saving == []
    assert list(tmp_path.iterdir()) == [archive]
    assert archive.read_bytes() == b"this content's image"

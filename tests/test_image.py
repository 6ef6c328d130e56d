"""The training image that `make image` builds (tests/image.py): the command the chart runs it with, what is in it, its
size and the archive a node imports. The control-plane tier (tests/e2e) runs it in real pods.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import image as image_module
import pytest
import yaml
from conftest import REPO, run_ctl
from image import STAND_IN_REPOSITORY, Image, ensure_image, export, local_image, podman_env
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

QUICKSTART = REPO / "examples" / "quickstart.yaml"
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


@pytest.fixture(scope="module")
def image() -> Image:
    return ensure_image()


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], env=podman_env(), capture_output=True, text=True, timeout=timeout)


def test_the_chart_runs_the_image_s_own_command(image: Image) -> None:
    """The chart's default image is the one `make image` built, and the chart's command is the image's own: `docker
    run` of the image and a pod run the same thing. (The control-plane tier runs the image in real pods as the chart
    renders them: its security context, volumes, env and the operators' env, on the node's containerd.)"""
    rendered = run_ctl("render", str(QUICKSTART), cwd=REPO)
    assert rendered.returncode == 0, rendered.stderr
    (job,) = [m for m in yaml.safe_load_all(rendered.stdout) if m and m["kind"] == "PyTorchJob"]
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert container["image"] == image.reference
    config = (local_image(f"docker.io/library/{image.reference}") or {})["Config"]
    assert config["Entrypoint"] + config["Cmd"] == container["command"] + container.get("args", [])


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


# Run in the image: the modules a rank imports that have no byte code beside their source. The image sets
# PYTHONDONTWRITEBYTECODE and a pod's root is read-only, so each would be compiled again in every process
# (`import torch` then `torch._dynamo`: 8.9 s instead of 3.2 while the stand-in's torch had none).
UNCOMPILED = """
import os, sys
import torch, torch._dynamo, transformers, trainer.__main__
for name, module in sorted(sys.modules.items()):
    spec = getattr(module, "__spec__", None)
    if spec and spec.cached and (spec.origin or "").endswith(".py") and not os.path.exists(spec.cached):
        print(name)
"""


def test_what_a_rank_imports_in_the_image_is_byte_compiled(image: Image) -> None:
    result = podman(
        "run", "--rm", "--pull=never", "--network=none", "--entrypoint=python", image.reference, "-c", UNCOMPILED
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == []


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

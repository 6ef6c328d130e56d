"""The training image, built here from the repository's Dockerfile with podman: `make image` runs this file, and the
tests that need the image call ensure_image().

The Dockerfile's base (its BASE_IMAGE argument's default, the CUDA PyTorch image) is used when it is in local
storage or can be pulled within a few seconds. Where no registry answers (this project's machines), the build runs
on a stand-in of the same shape (tests/containers/stand-in.Containerfile): a Debian rootfs made by mmdebstrap, with
the same torch version from PyPI, made once per machine and kept under a tag carrying its recipe's hash. The image
is tagged as the chart's pods name it, `ddpjob:<appVersion>` (Docker's normalized form), labelled with the hash of
what it is built from, and reused while that is unchanged; its OCI archive, for `ctr images import`, is kept per
content hash under ~/.cache/ddpjob/images. podman runs with the settings in tests/containers (runc, cgroupfs, file
events, ulimits this machine allows), passed by environment variables: nothing under /etc is changed. Images live
in podman's own storage (root's: /var/lib/containers/storage).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"
CONTAINERS = REPO / "tests" / "containers"
STAND_IN = CONTAINERS / "stand-in.Containerfile"
STAND_IN_REPOSITORY = "localhost/ddpjob-base"  # tagged <torch version>-<recipe hash>
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddpjob" / "images"
# The image's name as a kubelet resolves the chart's `ddpjob:<appVersion>` (containerd normalizes it so).
REGISTRY_PREFIX = "docker.io/library/"
# Every build, tagged by its content hash; the KEEP_BUILDS newest are kept (they share the base's layers), and the
# newest archive only (6 GB each: it is read once, by the node's import, which containerd's root then caches).
BUILDS_REPOSITORY = "localhost/ddpjob-build"
KEEP_BUILDS = 3
KEEP_ARCHIVES = 1
# Where the image records what it was built from (the content hash) and on which base.
CONTENT_LABEL = "io.ddpjob.content"
BASE_LABEL = "io.ddpjob.base"
# An absent registry fails at once (no DNS); a slow one must not hold the build for long.
PULL_TIMEOUT_SECONDS = 30
# The stand-in's root filesystem: Debian's minimal variant, Python with its headers (conda's Python in the real base
# has them; torch.compile's C++ kernels include Python.h), the CA store, useradd (the real base is Ubuntu).
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
ROOTFS_PACKAGES = ("python3", "libpython3-dev", "ca-certificates", "passwd")
# Builds reach PyPI through this machine's TLS setup: its CA bundle is mounted over the image's for each build step.
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BUILD_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


class ImageError(RuntimeError):
    """The image cannot be built here; one line saying why."""


class BadInput(ImageError):
    """The repository's files do not say what to build (exit 2)."""


@dataclass(frozen=True)
class Image:
    reference: str  # what the chart's pods run by default: ddpjob:<appVersion>
    content: str  # sha256 of what the image is built from (Dockerfile, its build context, the stand-in's recipe)
    archive: Path  # OCI archive of the image, named docker.io/library/ddpjob:<appVersion>, layers uncompressed
    base: str  # the base image it was built on: the Dockerfile's, or the stand-in's local tag


def podman_env() -> dict[str, str]:
    """This process's environment with podman and buildah pointed at the repository's container settings."""
    return os.environ | {
        "CONTAINERS_CONF": str(CONTAINERS / "containers.conf"),
        "CONTAINERS_REGISTRIES_CONF": str(CONTAINERS / "registries.conf"),
    }


def podman(*args: str, timeout: float | None = None, quiet: bool = True) -> str:
    """Runs podman; its stdout. `quiet=False` streams its output to stderr (builds show their progress)."""
    try:
        result = subprocess.run(
            ["podman", *args],
            env=podman_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if quiet else None,
            text=True,
            timeout=timeout,
        )
    except FileNotFoundError:
        raise ImageError("podman is missing: run .ci/install-container-tools (`make image` does)") from None
    if result.returncode != 0:
        lines = (result.stderr or "").strip().splitlines() or [f"exit code {result.returncode}"]
        raise ImageError(f"podman {args[0]} failed: {lines[-1]}")
    return result.stdout


def local_image(reference: str) -> dict[str, Any] | None:
    """`podman image inspect`'s record of the image (Id, Labels, Size...), None where local storage has no such name."""
    exists = subprocess.run(["podman", "image", "exists", reference], env=podman_env(), capture_output=True)
    if exists.returncode == 1:
        return None
    (inspected,) = json.loads(podman("image", "inspect", reference))
    return inspected


def app_version() -> str:
    version = yaml.safe_load((REPO / "helm" / "ddpjob" / "Chart.yaml").read_text()).get("appVersion")
    if not version:
        raise BadInput("helm/ddpjob/Chart.yaml has no appVersion: the image's tag is unknown")
    return str(version)


def dockerfile_base() -> str:
    """The Dockerfile's base image: its BASE_IMAGE argument's default."""
    match = re.search(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    if not match:
        raise BadInput("Dockerfile: no `ARG BASE_IMAGE=<image>` names the base image")
    return match.group(1)


def base_torch_version(base: str) -> str:
    """The torch version of a pytorch/pytorch tag: what the stand-in installs."""
    match = re.fullmatch(r"(?:docker\.io/)?pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime", base)
    if not match:
        raise BadInput(f"Dockerfile: base image {base!r} is not a pytorch/pytorch:<torch>-cuda<x>-cudnn<y>-runtime tag")
    return match.group(1)


def context_files() -> list[Path]:
    """The build context's files: the Dockerfile and what .dockerignore lets through (its `!` lines; its other
    patterns after `*` leave out names anywhere, such as `**/__pycache__`)."""
    lines = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()]
    patterns = [line for line in lines if line and not line.startswith("#")]
    if patterns[:1] != ["*"]:
        raise BadInput(".dockerignore must start with `*` and name what the image needs with `!` lines")
    included = [REPO / p[1:].rstrip("/") for p in patterns if p.startswith("!")]
    excluded = [p.removeprefix("**/") for p in patterns[1:] if not p.startswith("!")]
    files = [DOCKERFILE, REPO / ".dockerignore"]
    for root in included:
        candidates = sorted(root.rglob("*")) if root.is_dir() else [root]
        for path in candidates:
            parts = path.relative_to(REPO).parts
            if path.is_file() and not any(Path(part).match(pattern) for part in parts for pattern in excluded):
                files.append(path)
    return files


def stand_in_recipe() -> str:
    """sha256 of everything the stand-in is made from."""
    digest = hashlib.sha256(STAND_IN.read_bytes())
    digest.update(repr((DEBIAN_SUITE, DEBIAN_MIRROR, ROOTFS_PACKAGES, base_torch_version(dockerfile_base()))).encode())
    return digest.hexdigest()


def content_hash() -> str:
    digest = hashlib.sha256(stand_in_recipe().encode())
    for path in context_files():
        digest.update(f"\0{path.relative_to(REPO)}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def note(message: str) -> None:
    print(f"image: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def timed(what: str) -> Iterator[None]:
    start = time.monotonic()
    yield
    note(f"{what}: {time.monotonic() - start:.0f} s")


def real_base(base: str) -> str | None:
    """The Dockerfile's base from local storage, or pulled within PULL_TIMEOUT_SECONDS; None when it cannot be had."""
    if local_image(base):
        return base
    try:
        podman("pull", "--quiet", base, timeout=PULL_TIMEOUT_SECONDS)
        return base
    except subprocess.TimeoutExpired:
        why = f"no answer within {PULL_TIMEOUT_SECONDS} s"
    except ImageError as error:
        why = str(error)
    note(f"cannot pull {base} ({why}); building on a stand-in of its shape (tests/containers/stand-in.Containerfile)")
    return None


def host_uv() -> tuple[Path, Path]:
    """This machine's uv and its cache: the stand-in installs torch with them (downloads shared with the host)."""
    uv = shutil.which("uv", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if uv is None:
        raise ImageError("uv is missing: `make dev` installs it into .venv")
    cache = subprocess.run([uv, "cache", "dir"], capture_output=True, text=True, check=True).stdout.strip()
    Path(cache).mkdir(parents=True, exist_ok=True)
    return Path(uv).resolve(), Path(cache)


def ca_mount() -> list[str]:
    """The build's mount of this machine's CA bundle (PyPI through a TLS-inspecting proxy), where it has one."""
    bundle = Path(os.environ.get("SSL_CERT_FILE") or HOST_CA_BUNDLE)
    return ["--volume", f"{bundle}:{BUILD_CA_BUNDLE}:ro"] if bundle.is_file() else []


def debian_rootfs(tag: str) -> str:
    """The stand-in's Debian root filesystem as a local image (kept until the stand-in is made from it)."""
    if local_image(tag):
        return tag
    if shutil.which("mmdebstrap") is None:
        raise ImageError("mmdebstrap is missing: run .ci/install-container-tools (`make image` does)")
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE, prefix="rootfs-") as tmp:
        tarball = Path(tmp) / "rootfs.tar"
        command = ["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(ROOTFS_PACKAGES)}"]
        with timed(f"Debian {DEBIAN_SUITE} rootfs (mmdebstrap)"):
            result = subprocess.run([*command, DEBIAN_SUITE, str(tarball), DEBIAN_MIRROR], stderr=subprocess.PIPE)
            if result.returncode != 0:
                last = (result.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
                raise ImageError(f"mmdebstrap failed: {last}")
            podman("import", "--quiet", str(tarball), tag)
    return tag


def stand_in(base: str) -> str:
    """The stand-in base's local tag, made first if this machine has none of its recipe."""
    torch = base_torch_version(base)
    recipe = stand_in_recipe()[:16]
    tag = f"{STAND_IN_REPOSITORY}:{torch}-{recipe}"
    if local_image(tag):
        return tag
    note(f"making the stand-in base {tag} (once per machine: about 4 minutes)")
    rootfs = debian_rootfs(f"localhost/ddpjob-rootfs:{recipe}")
    uv, uv_cache = host_uv()
    # /mnt and /srv: directories the rootfs has, empty, so the image keeps no trace of the mounts.
    mounts = ["--volume", f"{uv.parent}:/mnt:ro", "--volume", f"{uv_cache}:/srv", *ca_mount()]
    with timed(f"stand-in base, torch {torch} from PyPI"):
        podman(
            "build", "--network=host", "--pull=never", *mounts,
            "--build-arg", f"ROOTFS={rootfs}", "--build-arg", f"TORCH_VERSION={torch}", "--build-arg", f"UV={uv.name}",
            "--tag", tag, "--file", str(STAND_IN), str(CONTAINERS),
            quiet=False,
        )  # fmt: skip
    podman("rmi", rootfs)  # its layer stays, under the stand-in
    prune(STAND_IN_REPOSITORY, 1)  # an older recipe's
    return tag


def build(tag: str, base: str, content: str) -> None:
    arguments = ["--build-arg", f"BASE_IMAGE={base}"]
    labels = ["--label", f"{CONTENT_LABEL}={content}", "--label", f"{BASE_LABEL}={base}"]
    with timed("image build"):
        podman(
            "build", "--network=host", "--pull=never", *ca_mount(), *arguments, *labels,
            "--tag", tag, "--file", str(DOCKERFILE), str(REPO),
            quiet=False,
        )  # fmt: skip


def export(reference: str, content: str) -> Path:
    """The image's OCI archive, named `reference`, written once per content."""
    name = reference.removeprefix(REGISTRY_PREFIX).replace(":", "-")
    archive = CACHE / f"{name}-{content[:16]}.oci.tar"
    if archive.exists():
        archive.touch()  # the newest are kept
        return archive
    partial = archive.with_name(archive.name + ".partial")
    partial.unlink(missing_ok=True)
    # Older contents' archives go first, not after: with the new one beside them the disk would need 6 GB more at the
    # peak (a CI run once ended here with "no space left on device").
    archives = sorted(CACHE.glob(f"{name}-*.oci.tar"), key=lambda path: path.stat().st_mtime, reverse=True)
    for stale in archives[KEEP_ARCHIVES - 1 :]:
        stale.unlink()
    with timed("OCI archive"):
        # Uncompressed layers: a multi-GB gzip would cost minutes here and at every import.
        podman("save", "--quiet", "--uncompressed", "--format", "oci-archive", "--output", str(partial), reference)
    partial.rename(archive)
    return archive


def prune(repository: str, keep: int) -> None:
    """Untag the images of `repository` beyond the `keep` newest (podman removes what no tag holds)."""
    listed = podman("images", "--filter", f"reference={repository}", "--format", "{{.Repository}}:{{.Tag}}")
    for stale in listed.split()[keep:]:  # newest first
        with contextlib.suppress(ImageError):  # in use by a container, or the base of a kept build: it stays
            podman("rmi", stale)


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """One build at a time per machine (two test sessions may start at once)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def ensure_image() -> Image:
    """The training image for the repository's current content, built (and archived) only when it changed."""
    # The storage settings stay the machine's: podman's database keeps the driver it was created with, and a driver
    # named by a storage.conf of ours reaches the cleanup process (which records a container's exit) as a flag that
    # disagrees with it, so every `podman run` waited 20 s for an exit code. Checked instead: vfs would copy the
    # whole image for each layer and container.
    driver = podman("info", "--format", "{{.Store.GraphDriverName}}").strip()
    if driver != "overlay":
        raise ImageError(f"podman stores images with {driver!r}, not overlay: each container would copy the image")
    reference = f"{REGISTRY_PREFIX}ddpjob:{app_version()}"
    content = content_hash()
    # Each build is also tagged by its content: worktrees of other contents on this machine take turns with the
    # reference's tag without building again.
    built = f"{BUILDS_REPOSITORY}:{content[:16]}"
    with locked():
        found = local_image(built)
        if found:
            base = found["Labels"][BASE_LABEL]
        else:
            note(f"building {reference} for this content ({content[:16]})")
            wanted = dockerfile_base()
            base = real_base(wanted) or stand_in(wanted)
            build(built, base, content)
            prune(BUILDS_REPOSITORY, KEEP_BUILDS)
        podman("tag", built, reference)
        archive = export(reference, content)
    return Image(reference.removeprefix(REGISTRY_PREFIX), content, archive, base)


def main() -> int:
    try:
        image = ensure_image()
    except BadInput as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ImageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{image.reference}\t{image.archive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

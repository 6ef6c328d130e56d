"""Small OCI images written as OCI archives, for the node's containerd to import (no registry here): the pod
sandbox's pause image and the image of the training operator's init container (busybox's sh, nslookup, seq and
sleep). One uncompressed layer each; the same files give the same digests, so an import is skipped once done.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"


@dataclass(frozen=True)
class Image:
    """An OCI archive and what containerd calls the image in it (its fully qualified reference)."""

    archive: Path
    reference: str
    manifest_digest: str


def layer(files: dict[str, Path], links: dict[str, str]) -> bytes:
    """A layer tar: each host file at its path in the image (mode kept, owner root), and symbolic links."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        directories = sorted({str(Path(p).parent) for p in [*files, *links]} - {"."})
        for directory in directories:
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for path, source in sorted(files.items()):
            info = tarfile.TarInfo(path)
            info.size, info.mode = source.stat().st_size, source.stat().st_mode & 0o777
            with source.open("rb") as handle:
                tar.addfile(info, handle)
        for path, target in sorted(links.items()):
            info = tarfile.TarInfo(path)
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
            tar.addfile(info)
    return buffer.getvalue()


def digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def write_archive(
    path: Path, reference: str, files: dict[str, Path], links: dict[str, str], config: dict[str, Any]
) -> Image:
    """An OCI archive of a one-layer image named `reference` (`io.containerd.image.name`, which `ctr images
    import` names the image by)."""
    layer_tar = layer(files, links)
    image_config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": [digest(layer_tar)]},
        },
        sort_keys=True,
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": digest(image_config), "size": len(image_config)},
            "layers": [{"mediaType": LAYER_MEDIA_TYPE, "digest": digest(layer_tar), "size": len(layer_tar)}],
        },
        sort_keys=True,
    ).encode()
    annotations = {"io.containerd.image.name": reference, "org.opencontainers.image.ref.name": reference}
    index = json.dumps(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": MANIFEST_MEDIA_TYPE,
                    "digest": digest(manifest),
                    "size": len(manifest),
                    "annotations": annotations,
                }
            ],
        }
    ).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    with tarfile.open(partial, "w") as tar:
        entries = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}', "index.json": index}
        entries |= {f"blobs/sha256/{digest(blob)[7:]}": blob for blob in (layer_tar, image_config, manifest)}
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    partial.replace(path)
    return Image(path, reference, digest(manifest))


def content_tag(path: Path) -> str:
    """A tag that changes with the file's content: an image built from another binary is another image."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def pause_image(pause: Path, directory: Path) -> Image:
    return write_archive(
        directory / "pause.tar",
        f"localhost/ddpjob-e2e/pause:{content_tag(pause)}",
        {"pause": pause},
        {},
        {"Entrypoint": ["/pause"], "User": "65535:65535"},
    )


# The applets the operator's init container template runs (k8s/operator/initContainer.yaml).
BUSYBOX_APPLETS = ("sh", "nslookup", "grep", "seq", "sleep", "echo")


def busybox_image(busybox: Path, directory: Path) -> Image:
    """Debian's static busybox as the init container's image: it needs no libc in the image."""
    return write_archive(
        directory / "busybox.tar",
        f"localhost/ddpjob-e2e/busybox:{content_tag(busybox)}",
        {"bin/busybox": busybox},
        {f"bin/{applet}": "busybox" for applet in BUSYBOX_APPLETS},
        {"Cmd": ["/bin/sh"], "Env": ["PATH=/bin"]},
    )

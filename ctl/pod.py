"""A pod's container as a local process: the one way `ctl run` and the e2e pod executor start a rendered pod.

Both take the pod spec (Kubernetes' camelCase form, as the chart renders it and the API serves it) and give its
single container's command and args as written, its env list evaluated (values; the fieldRefs the caller can
answer; other references through the caller), and each volume as a local directory of the caller's choosing.
Each mount path is then replaced by its directory wherever it appears as a whole path in the command, the env
values and the mounted ConfigMaps' files (training.yaml names the run directory under the claim's mount), so a
chart change reaches a laptop run and a pod alike. What the operator injects is the caller's (ctl/operator_env.py).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Volume = dict[str, Any]
# A `valueFrom` the caller resolves (configMapKeyRef, secretKeyRef, an unknown fieldRef): the value, or None to
# leave the variable out.
Reference = Callable[[str, dict[str, Any]], str | None]
VARIABLE_REFERENCE = re.compile(r"\$(\$|\(([^)]*)\))")  # $$, or $(NAME)


class PodSetupError(RuntimeError):
    """The pod asks for something a local process cannot be given; one line saying what."""


@dataclass(frozen=True)
class LocalContainer:
    """What a local process needs to be the pod's container."""

    command: list[str]
    env: dict[str, str]  # the container's own env list, paths rewritten (no operator env, no inherited env)
    mounts: dict[str, Path]  # container path -> local directory
    working_dir: Path | None  # the container's workingDir, rewritten; None: the caller's choice


def path_rewriter(mounts: Mapping[str, Path]) -> Callable[[str], str]:
    """Replaces each mount path, where it appears as a whole path prefix, by its local directory."""
    if not mounts:
        return lambda text: text
    paths = sorted(mounts, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w./-])(" + "|".join(re.escape(p) for p in paths) + r")(?=/|$|[^\w.-])")
    return lambda text: pattern.sub(lambda m: str(mounts[m.group(1)]), text)


def the_container(pod_spec: Mapping[str, Any]) -> dict[str, Any]:
    containers = pod_spec.get("containers") or []
    if len(containers) != 1:
        raise PodSetupError(f"a local process runs a single-container pod; this one has {len(containers)}")
    return containers[0]


def expand_references(text: str, variables: Mapping[str, str]) -> str:
    """`$(VAR)` in a container's command, args or env value, as the kubelet expands it: the variable of `variables`
    (for the command: the container's, the operator's included; for a value: those listed before it); `$$` is a
    literal `$`; a name not there stays as written."""

    def replace(match: re.Match[str]) -> str:
        return "$" if match.group(1) == "$" else variables.get(match.group(2), match.group(0))

    return VARIABLE_REFERENCE.sub(replace, text)


def container_env(container: Mapping[str, Any], fields: Mapping[str, str], reference: Reference) -> dict[str, str]:
    """The container's env list: values, the fieldRefs in `fields` (fieldPath -> value), the rest by `reference`."""
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = expand_references(var.get("value") or "", env)  # the kubelet's order: earlier only
            continue
        field_path = (source.get("fieldRef") or {}).get("fieldPath")
        value = fields[field_path] if field_path in fields else reference(var["name"], source)
        if value is not None:
            env[var["name"]] = value
    return env


def local_container(
    pod_spec: Mapping[str, Any],
    volume_dir: Callable[[Volume], Path],
    fields: Mapping[str, str],
    reference: Reference,
    provided: Mapping[str, Path] | None = None,
) -> LocalContainer:
    """The pod's container as a local process; `volume_dir` materialises a volume (a ConfigMap's files written into
    its directory). `provided`: container paths the caller maps to a local directory of its own instead."""
    container = the_container(pod_spec)
    provided = provided or {}
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    directories: dict[str, Path] = {}
    mounts: dict[str, Path] = {}
    for mount in container.get("volumeMounts") or []:
        path = mount["mountPath"].rstrip("/") or "/"
        if path in provided:
            mounts[path] = provided[path]
            continue
        if mount["name"] not in volumes:
            raise PodSetupError(f"volume mount {path}: the pod has no volume {mount['name']!r}")
        if mount["name"] not in directories:
            directories[mount["name"]] = volume_dir(volumes[mount["name"]])
        source = directories[mount["name"]]
        if mount.get("subPath"):
            source /= mount["subPath"]
            if not source.exists():  # a kubelet creates a missing subPath as a directory
                source.mkdir(parents=True)
        mounts[path] = source
    rewrite = path_rewriter(mounts)
    for name, directory in directories.items():
        if "configMap" in volumes[name]:  # the config names paths under the other mounts; other files (a PEM) are data
            for file in directory.glob("*.yaml"):
                file.write_text(rewrite(file.read_text()))
    env = {name: rewrite(value) for name, value in container_env(container, fields, reference).items()}
    command = [rewrite(arg) for arg in [*(container.get("command") or []), *(container.get("args") or [])]]
    if not command:
        raise PodSetupError("the container has no command (the image's entrypoint is unknown here)")
    working_dir = container.get("workingDir")
    return LocalContainer(command, env, mounts, Path(rewrite(working_dir)) if working_dir else None)


def image_path(path: str) -> str:
    """PATH for a container whose image is this Python environment: its bin directory (python, torchrun) first."""
    return f"{Path(sys.executable).parent}:{path}"

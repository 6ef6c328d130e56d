"""Render a job spec through the Helm chart, in process (helm-python-sdk: Helm's own Go engine, no binary).

The spec is validated by the pydantic model first; the validated values (camelCase) are the chart's
values, so `ctl render spec.yaml` and `helm template NAME helm/ddpjob -f spec.yaml` give the same objects.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ctl.spec import JobSpec

CHART_ENV = "DDPJOB_CHART"
SOURCE_CHART = Path(__file__).resolve().parent.parent / "helm" / "ddpjob"  # a source checkout (editable install)
INSTALLED_CHART = Path(sys.prefix) / "share" / "ddpjob" / "helm" / "ddpjob"  # pyproject's data-files, from a wheel

# Helm's install order (pkg/release/util/kind_sorter.go): `helm template` prints objects in this order,
# unknown kinds (custom resources such as PyTorchJob) last, alphabetically, then by name; hooks come last.
INSTALL_ORDER = [
    "PriorityClass", "Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange", "PodSecurityPolicy",
    "PodDisruptionBudget", "ServiceAccount", "Secret", "SecretList", "ConfigMap", "StorageClass",
    "PersistentVolume", "PersistentVolumeClaim", "CustomResourceDefinition", "ClusterRole", "ClusterRoleList",
    "ClusterRoleBinding", "ClusterRoleBindingList", "Role", "RoleList", "RoleBinding", "RoleBindingList",
    "Service", "DaemonSet", "Pod", "ReplicationController", "ReplicaSet", "Deployment", "HorizontalPodAutoscaler",
    "StatefulSet", "Job", "CronJob", "IngressClass", "Ingress", "APIService", "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    # Not Helm's: Trainer v2 refuses a TrainJob before its runtime exists. Helm installs the runtime as a
    # pre-install hook; `ctl submit` and `kubectl apply -f` of this output create it first by this order.
    "TrainingRuntime",
]  # fmt: skip
DOC_SEPARATOR = re.compile(r"^---\s*$", re.MULTILINE)


class RenderError(RuntimeError):
    """The chart could not be loaded or rendered (not a spec problem: the spec was validated first)."""


@dataclass(frozen=True)
class Manifest:
    """One rendered object: the template it came from, its text as Helm wrote it, and the parsed object."""

    source: str
    text: str
    obj: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.obj.get("kind", ""))

    @property
    def name(self) -> str:
        return str(self.obj.get("metadata", {}).get("name", ""))


def chart_path() -> Path:
    """The chart: $DDPJOB_CHART, else helm/ddpjob next to this package (a source checkout), else the installed copy."""
    path = Path(os.environ.get(CHART_ENV) or (SOURCE_CHART if SOURCE_CHART.is_dir() else INSTALLED_CHART))
    if not (path / "Chart.yaml").is_file():
        raise RenderError(f"no Helm chart at {path} (set {CHART_ENV} to the helm/ddpjob directory)")
    return path


def _order(manifest: Manifest) -> tuple[int, str, str]:
    rank = INSTALL_ORDER.index(manifest.kind) if manifest.kind in INSTALL_ORDER else len(INSTALL_ORDER)
    return rank, manifest.kind, manifest.name


def split_manifests(rendered: dict[str, str]) -> list[Manifest]:
    """Helm's per-template output -> one Manifest per object, in `helm template`'s order."""
    manifests = []
    for source, text in rendered.items():
        if source.endswith("NOTES.txt") or Path(source).name.startswith("_"):
            continue
        for doc in DOC_SEPARATOR.split(text):
            obj = yaml.safe_load(doc)
            if obj:
                manifests.append(Manifest(source, doc.strip("\n"), obj))
    return sorted(manifests, key=_order)


def render_chart(values: dict[str, Any], release: str, namespace: str = "default") -> dict[str, str]:
    """Helm's engine on the chart: template path -> rendered text (NOTES.txt included)."""
    import helm_python  # loads Helm's shared library; only commands that render pay for it

    try:
        with helm_python.Chart.load(chart_path()) as chart:
            return chart.render(values, name=release, namespace=namespace, is_install=True)
    except helm_python.HelmError as exc:
        raise RenderError(f"helm: {exc.detail.strip()}") from None


def _without_nulls(value: Any) -> Any:
    """Drop null mapping entries: Helm treats null as "unset", and merging a values file drops them too."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def chart_values(spec: JobSpec) -> dict[str, Any]:
    """The chart's values for a validated spec: exactly what `helm install -f spec.yaml` would merge to."""
    values: dict[str, Any] = _without_nulls(spec.to_values())
    return values


def render(spec: JobSpec, namespace: str = "default") -> list[Manifest]:
    """The objects a job spec becomes; the release is named after the job."""
    return split_manifests(render_chart(chart_values(spec), spec.name, namespace))


def notes(spec: JobSpec, namespace: str = "default") -> str:
    """The chart's NOTES.txt for this spec: how to follow the job."""
    rendered = render_chart(chart_values(spec), spec.name, namespace)
    return next((text.strip() for source, text in rendered.items() if source.endswith("NOTES.txt")), "")


def to_yaml(manifests: list[Manifest]) -> str:
    """Multi-document YAML as `helm template` prints it (`# Source:` comments included)."""
    return "".join(f"---\n# Source: {m.source}\n{m.text}\n" for m in manifests)


def to_json(manifests: list[Manifest]) -> str:
    """A kubectl-style List of the objects."""
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [m.obj for m in manifests]}, indent=2) + "\n"

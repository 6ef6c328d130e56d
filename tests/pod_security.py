"""The Pod Security Standards "restricted" profile (Kubernetes docs, policy version latest: v1.30 rules), rule by
rule, on a pod spec as the API server sees it: the chart's pod templates with the containers the training operator
adds (tests/test_chart.py), and the pods the real operator created (tests/e2e, next to the real admission).

`violations` says what breaks the profile, one line each, in the words of the rule; empty when the pod is admitted.
"""

from __future__ import annotations

import json
from typing import Any

ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim"}
ALLOWED_VOLUMES |= {"projected", "secret"}
SECCOMP_TYPES = ("RuntimeDefault", "Localhost")


def violations(pod_spec: dict[str, Any]) -> list[str]:
    """Every rule of "restricted" (and "baseline", which it includes) that `pod_spec` breaks (camelCase keys)."""
    found = [
        f"{field}: host namespaces are forbidden"
        for field in ("hostNetwork", "hostPID", "hostIPC")
        if pod_spec.get(field)
    ]
    for volume in pod_spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            found.append(f"volume {volume['name']}: type {sorted(kinds - ALLOWED_VOLUMES)} is not allowed")
    pod_sc = pod_spec.get("securityContext") or {}
    if pod_sc.get("runAsUser") == 0:
        found.append("pod: runAsUser 0")
    for container in (pod_spec.get("initContainers") or []) + pod_spec["containers"]:
        name = container["name"]
        sc = container.get("securityContext") or {}
        if sc.get("privileged"):
            found.append(f"{name}: privileged")
        if "hostPort" in json.dumps(container.get("ports") or []):
            found.append(f"{name}: hostPort")
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation must be false")
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            found.append(f"{name}: runAsNonRoot must be true (container or pod)")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}
        if seccomp.get("type") not in SECCOMP_TYPES:
            found.append(f"{name}: seccompProfile.type must be RuntimeDefault or Localhost (container or pod)")
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"{name}: capabilities must drop ALL")
        if not set(capabilities.get("add") or []) <= {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities may add NET_BIND_SERVICE only")
    return found

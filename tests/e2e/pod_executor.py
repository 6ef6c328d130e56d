"""The local pod executor: a minimal kubelet for the e2e control plane, running pods as local processes.

It watches every pod, starts the pod's container command as a local process group and reports the pod's status
through the pods/status subresource (Running, then Succeeded/Failed with the exit code), so the training operator
reconciles PyTorchJobs for real. What a node would provide is stood in for like this:

- volumes: a ConfigMap or Secret is written to a per-pod directory; a PersistentVolumeClaim is a directory per
  claim shared by all pods (like ReadWriteMany); an emptyDir is a per-pod directory. Each mount path is replaced
  by its local directory wherever it appears as a path in the command, the env values and the ConfigMap files
  (training.yaml names the checkpoint directory under the claim's mount path).
- networking: pods share loopback. The host part of MASTER_ADDR, PET_MASTER_ADDR and PET_RDZV_ENDPOINT, when it
  names a Service of the pod's namespace (as the operator sets it), becomes 127.0.0.1; nothing else is rewritten.
  The pod starts once that Service exists (as the operator's init container waits for the master's DNS name).
  The metrics port (DDPJOB_METRICS_PORT) gets a free port per pod, and PROMETHEUS_MULTIPROC_DIR a per-pod dir.
- images: the command runs from this Python environment (its bin directory, with torchrun, first on PATH).
  Security contexts are not applied (processes run as the executor's user).
- init containers (the operator's wait-for-master-DNS) are reported completed without running: the address they
  wait for is the loopback rewrite above.
- restarts: restartPolicy OnFailure/Always restarts the container in place after a kubelet's crash-loop back-off
  (restartCount + 1); the pod stays Running meanwhile.
- deletion: a deleted pod's process group gets SIGTERM, then SIGKILL after terminationGracePeriodSeconds.

Each container's output is kept as a kubelet keeps it, one file per (re)start:
`<work-dir>/pods/<namespace>/<pod>-<uid>/<container>/<restart count>.log`.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import ipaddress
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import urllib3
from local_processes import LOOPBACK, die_with_parent, free_port, terminate_group

HOST_VARIABLES = ("MASTER_ADDR", "PET_MASTER_ADDR", "PET_RDZV_ENDPOINT")
# The trainer's metrics endpoint and prometheus_client's multiprocess directory (trainer/spec.py).
METRICS_PORT_VARIABLE = "DDPJOB_METRICS_PORT"
METRICS_HOST_VARIABLE = "DDPJOB_METRICS_HOST"
METRICS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
START_ERROR_EXIT_CODE = 128  # what a kubelet reports for a container that could not start
# How long a pod's start waits for the Service its master address names (the operator creates it after the pods).
SERVICE_WAIT_S = 60.0
# A kubelet's crash-loop back-off: 10 s, doubled per restart, at most 5 min.
RESTART_BACKOFF_S = 10.0
RESTART_BACKOFF_MAX_S = 300.0


class PodSetupError(RuntimeError):
    """The pod asks for something this executor cannot provide; the pod fails with this message."""


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class LocalPod:
    """One pod's local state: its directory, its running container process and what was reported."""

    namespace: str
    name: str
    uid: str
    directory: Path
    restart_policy: str
    grace_s: float
    container: str = ""
    image: str = ""
    process: subprocess.Popen | None = None
    restart_count: int = 0
    started_at: str = ""
    last_state: dict[str, Any] = field(default_factory=dict)
    deleted: bool = False


class PodExecutor:
    def __init__(self, kubeconfig: Path, work_dir: Path) -> None:
        self.client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        self.core = kubernetes.client.CoreV1Api(self.client)
        self.work_dir = work_dir
        self.pods: dict[str, LocalPod] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    # -- the watch loop -------------------------------------------------------------------------------------------

    def run(self) -> None:
        (self.work_dir / "pod-executor.ready").touch()
        while not self.stopping.is_set():
            try:
                listed = self.core.list_pod_for_all_namespaces()
                self.sync({p.metadata.uid for p in listed.items})
                for pod in listed.items:
                    self.handle(pod)
                stream = kubernetes.watch.Watch().stream(
                    self.core.list_pod_for_all_namespaces,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=30,
                )
                for event in stream:
                    if event["type"] == "DELETED":
                        self.delete(event["object"].metadata.uid)
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        self.handle(event["object"])
            except (kubernetes.client.ApiException, urllib3.exceptions.HTTPError, OSError) as error:
                if not self.stopping.is_set():
                    print(f"pod-executor: watch interrupted ({error}); listing again", file=sys.stderr, flush=True)
                    time.sleep(1)

    def sync(self, existing_uids: set[str]) -> None:
        """After a re-list: pods deleted while the watch was down."""
        for uid in [uid for uid in self.pods if uid not in existing_uids]:
            self.delete(uid)

    def handle(self, pod: kubernetes.client.V1Pod) -> None:
        uid = pod.metadata.uid
        if pod.metadata.deletion_timestamp is not None:
            self.delete(uid)
            return
        with self.lock:
            if uid in self.pods or pod.status.phase in ("Succeeded", "Failed"):
                return
            local = LocalPod(
                namespace=pod.metadata.namespace,
                name=pod.metadata.name,
                uid=uid,
                directory=self.work_dir / "pods" / pod.metadata.namespace / f"{pod.metadata.name}-{uid[:8]}",
                restart_policy=pod.spec.restart_policy or "Always",
                grace_s=float(pod.spec.termination_grace_period_seconds or 30),
            )
            self.pods[uid] = local
        threading.Thread(target=self.run_pod, args=(local, pod), name=pod.metadata.name, daemon=True).start()

    def delete(self, uid: str) -> None:
        with self.lock:
            local = self.pods.get(uid)
            if local is None or local.deleted:
                return
            local.deleted = True
            process = local.process
        if process is not None:
            threading.Thread(target=terminate_group, args=(process, local.grace_s), daemon=True).start()

    def stop(self) -> None:
        with self.lock:
            self.stopping.set()
            running = [p.process for p in self.pods.values() if p.process is not None and p.process.poll() is None]
        stopping = [threading.Thread(target=terminate_group, args=(process, 5.0)) for process in running]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()

    # -- one pod ------------------------------------------------------------------------------------------------

    def run_pod(self, local: LocalPod, pod: kubernetes.client.V1Pod) -> None:
        try:
            command, env, cwd = self.prepare(local, pod)
        except Exception as error:  # whatever stops the setup (a missing key, a bad subPath) fails the pod, with it
            self.report_terminated(local, START_ERROR_EXIT_CODE, "StartError", f"{type(error).__name__}: {error}")
            return
        while True:
            local.started_at = now()
            try:
                with self.lock:  # a deletion (or stop) either sees this process or keeps it from starting
                    if local.deleted or self.stopping.is_set():
                        return
                    with (local.directory / local.container / f"{local.restart_count}.log").open("ab") as log:
                        local.process = subprocess.Popen(
                            command, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=die_with_parent,
                        )  # fmt: skip
            except OSError as error:
                self.report_terminated(local, START_ERROR_EXIT_CODE, "StartError", str(error))
                return
            self.report(local, "Running", {"running": {"startedAt": local.started_at}})
            exit_code = local.process.wait()
            if local.deleted or self.stopping.is_set():
                return
            restart = local.restart_policy == "Always" or (local.restart_policy == "OnFailure" and exit_code != 0)
            if not restart:
                self.report_terminated(local, exit_code, "Completed" if exit_code == 0 else "Error", "")
                return
            local.last_state = {"terminated": terminated_state(exit_code, "Error", "", local.started_at)}
            self.report(local, "Running", {"waiting": {"reason": "CrashLoopBackOff"}})
            self.stopping.wait(min(RESTART_BACKOFF_S * 2**local.restart_count, RESTART_BACKOFF_MAX_S))
            local.restart_count += 1

    def prepare(self, local: LocalPod, pod: kubernetes.client.V1Pod) -> tuple[list[str], dict[str, str], Path]:
        """The container's command line, environment and working directory, with the volumes materialised."""
        containers = pod.spec.containers
        if len(containers) != 1:
            raise PodSetupError(f"the local executor runs single-container pods; this one has {len(containers)}")
        container = containers[0]
        local.container, local.image = container.name, container.image or ""
        (local.directory / local.container).mkdir(parents=True, exist_ok=True)
        volumes = {v.name: self.volume_dir(local, v) for v in pod.spec.volumes or []}
        mounts = {}
        for mount in container.volume_mounts or []:
            if mount.name not in volumes:
                raise PodSetupError(f"volume {mount.name!r} is not supported by the local executor")
            mounts[mount.mount_path.rstrip("/")] = volumes[mount.name] / (mount.sub_path or "")
        rewrite = path_rewriter(mounts)
        for volume in pod.spec.volumes or []:
            if volume.config_map is not None:  # the config names paths under the other mounts
                for file in volumes[volume.name].iterdir():
                    file.write_text(rewrite(file.read_text()))
        env = {name: rewrite(value) for name, value in self.container_env(pod, container).items()}
        for name in HOST_VARIABLES:
            if name in env:
                env[name] = self.loopback_if_service(env[name], local.namespace)
        if METRICS_PORT_VARIABLE in env:
            env |= {METRICS_PORT_VARIABLE: str(free_port()), METRICS_HOST_VARIABLE: LOOPBACK}
        if METRICS_DIR_VARIABLE in env:
            env[METRICS_DIR_VARIABLE] = str(local.directory / "metrics")
            Path(env[METRICS_DIR_VARIABLE]).mkdir(exist_ok=True)
        python_bin = str(Path(sys.executable).parent)
        tmp = local.directory / "tmp"
        tmp.mkdir(exist_ok=True)
        base = {"PATH": f"{python_bin}:{os.environ.get('PATH', os.defpath)}", "HOME": str(Path.home())}
        env = base | {"TMPDIR": str(tmp), "HOSTNAME": local.name} | env
        command = [rewrite(arg) for arg in [*(container.command or []), *(container.args or [])]]
        if not command:
            raise PodSetupError("the container has no command (the image's entrypoint is unknown here)")
        cwd = Path(rewrite(container.working_dir)) if container.working_dir else local.directory
        return command, env, cwd

    def volume_dir(self, local: LocalPod, volume: kubernetes.client.V1Volume) -> Path:
        directory = local.directory / "volumes" / volume.name
        if volume.persistent_volume_claim is not None:
            directory = self.work_dir / "volumes" / local.namespace / volume.persistent_volume_claim.claim_name
        directory.mkdir(parents=True, exist_ok=True)
        if volume.config_map is not None:
            data = self.core.read_namespaced_config_map(volume.config_map.name, local.namespace).data or {}
            for key, value in data.items():
                (directory / key).write_text(value)
        elif volume.secret is not None:
            data = self.core.read_namespaced_secret(volume.secret.secret_name, local.namespace).data or {}
            for key, value in data.items():
                (directory / key).write_bytes(base64.b64decode(value))
        elif volume.persistent_volume_claim is None and volume.empty_dir is None and volume.projected is None:
            raise PodSetupError(f"volume {volume.name!r}: only configMap, secret, PVC, emptyDir and projected")
        return directory

    def container_env(self, pod: kubernetes.client.V1Pod, container: kubernetes.client.V1Container) -> dict[str, str]:
        """The container's env list (values and references), the operator's variables included."""
        if container.env_from:
            raise PodSetupError("envFrom is not supported by the local executor")
        fields = {
            "metadata.name": pod.metadata.name,
            "metadata.namespace": pod.metadata.namespace,
            "metadata.uid": pod.metadata.uid,
            "status.podIP": LOOPBACK,
            "status.hostIP": LOOPBACK,
        }
        env: dict[str, str] = {}
        for var in container.env or []:
            source = var.value_from
            if source is None:
                env[var.name] = var.value or ""
            elif source.field_ref is not None and source.field_ref.field_path in fields:
                env[var.name] = fields[source.field_ref.field_path]
            elif source.config_map_key_ref is not None:
                ref = source.config_map_key_ref
                env[var.name] = self.core.read_namespaced_config_map(ref.name, pod.metadata.namespace).data[ref.key]
            elif source.secret_key_ref is not None:
                ref = source.secret_key_ref
                data = self.core.read_namespaced_secret(ref.name, pod.metadata.namespace).data
                env[var.name] = base64.b64decode(data[ref.key]).decode()
            else:
                raise PodSetupError(f"env {var.name}: this valueFrom is not supported by the local executor")
        return env

    def loopback_if_service(self, value: str, namespace: str) -> str:
        """`host[:port]` with host 127.0.0.1 when host is a Service of the namespace (`name[.namespace[.svc...]]`).
        The operator creates a job's Services just after its pods, so this waits for the Service a while, as the
        worker's init container waits for the master's DNS name."""
        host, colon, port = value.partition(":")
        name, _, rest = host.partition(".")
        if (rest and not rest.startswith(namespace)) or is_ip_address(host):
            return value
        deadline = time.monotonic() + SERVICE_WAIT_S
        while True:
            try:
                self.core.read_namespaced_service(name, namespace)
                return f"{LOOPBACK}{colon}{port}"
            except kubernetes.client.ApiException as error:
                if error.status != 404:
                    raise
            if time.monotonic() > deadline or self.stopping.wait(0.5):
                return value

    # -- status ---------------------------------------------------------------------------------------------------

    def report_terminated(self, local: LocalPod, exit_code: int, reason: str, message: str) -> None:
        phase = "Succeeded" if exit_code == 0 else "Failed"
        state = {"terminated": terminated_state(exit_code, reason, message, local.started_at or now())}
        self.report(local, phase, state, message)

    def report(self, local: LocalPod, phase: str, state: dict[str, Any], message: str = "") -> None:
        if local.deleted:
            return
        running = "running" in state
        status = {
            "phase": phase,
            "hostIP": LOOPBACK,
            "hostIPs": [{"ip": LOOPBACK}],
            "podIP": LOOPBACK,
            "podIPs": [{"ip": LOOPBACK}],
            "startTime": local.started_at or now(),
            "conditions": [{"type": "Ready", "status": str(running), "lastTransitionTime": now()}],
            "containerStatuses": [
                {
                    "name": local.container or "unknown",
                    "image": local.image,
                    "imageID": "",
                    "containerID": f"local://{local.process.pid}" if local.process else "",
                    "ready": running,
                    "started": running,
                    "restartCount": local.restart_count,
                    "state": state,
                    "lastState": local.last_state,
                }
            ],
        }
        if message:
            status["message"] = message
        try:
            pod = self.core.read_namespaced_pod(local.name, local.namespace)
            if pod.metadata.uid != local.uid:
                return
            status["initContainerStatuses"] = [
                {
                    "name": c.name,
                    "image": c.image or "",
                    "imageID": "",
                    "ready": True,
                    "restartCount": 0,
                    "state": {"terminated": terminated_state(0, "Completed", "", local.started_at or now())},
                }
                for c in pod.spec.init_containers or []
            ]
            self.core.patch_namespaced_pod_status(local.name, local.namespace, {"status": status})
        except kubernetes.client.ApiException as error:
            if error.status != 404:  # a pod deleted meanwhile has no status to report
                raise


def is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def terminated_state(exit_code: int, reason: str, message: str, started_at: str) -> dict[str, Any]:
    return {"exitCode": exit_code, "reason": reason, "message": message, "startedAt": started_at, "finishedAt": now()}


def path_rewriter(mounts: dict[str, Path]) -> Any:
    """Replaces each mount path, where it appears as a whole path prefix, by its local directory."""
    if not mounts:
        return lambda text: text
    paths = sorted(mounts, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w./-])(" + "|".join(re.escape(p) for p in paths) + r")(?=/|$|[^\w.-])")
    return lambda text: pattern.sub(lambda m: str(mounts[m.group(1)]), text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, required=True)
    args = parser.parse_args()
    executor = PodExecutor(args.kubeconfig, args.work_dir)

    def on_signal(signum: int, _frame: Any) -> None:
        executor.stop()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    executor.run()


if __name__ == "__main__":
    main()

"""The local pod executor: a minimal kubelet for the e2e control plane, running pods as local processes.

It registers a Node (`ddpjob-e2e-node`), watches every pod, binds each unbound pod to that node through the
pods/binding subresource (no scheduler runs here), starts the pod's container command as a local process group
and reports the pod's status through the pods/status subresource (Running, then Succeeded/Failed with the exit
code), so the training operator reconciles PyTorchJobs for real. What a node would provide is stood in for like
this:

- volumes: a ConfigMap or Secret is written to a per-pod directory, as are a projected volume's service account
  tokens (TokenRequests) and ConfigMap keys; a PersistentVolumeClaim is a directory per
  claim shared by all pods (like ReadWriteMany); an emptyDir is a per-pod directory. Each mount path is replaced
  by its local directory wherever it appears as a path in the command, the env values and the ConfigMap files
  (training.yaml names the checkpoint directory under the claim's mount path): ctl/pod.py, the code `ctl run`
  starts its nodes from the rendered pods with.
- networking: each pod gets an address of its own from 10.244.0.0/16, added to `lo` for the pod's lifetime
  (tests/e2e/pod_network.py) and reported as its podIP (and as the `status.podIP` env field), so the API server's
  pods/proxy reaches it. The trainer's metrics endpoint listens there (DDPJOB_METRICS_HOST), on the port its pod
  spec declares. Where addresses cannot be added (no CAP_NET_ADMIN), pods share loopback instead, as they did
  before: podIP 127.0.0.1 (which pods/proxy refuses) and a free metrics port per pod; the log says so once.
  Either way the host part of MASTER_ADDR, PET_MASTER_ADDR and PET_RDZV_ENDPOINT, and of the URL in
  KUBEFLOW_TRAINER_SERVER_URL, when it names a Service as cluster DNS resolves names (`svc[.namespace[.svc...]]`,
  as the v1 operator sets it, or a pod's `hostname.subdomain` under its headless Service, as Trainer v2 and JobSet
  do: `<job>-node-0-0.<job>`), becomes 127.0.0.1 (no Service proxy or DNS runs here); nothing else is rewritten.
  The pod starts once that Service exists (as the operator's init container waits for the master's DNS name).
  Pods of one headless Service share a free port in place of PET_MASTER_PORT (Trainer v2 fixes it at 29500, which
  two jobs running at once on this one machine would both bind). PROMETHEUS_MULTIPROC_DIR is a per-pod directory.
- env: values, ConfigMap and Secret keys, and the downward API's fields, labels and annotations (Trainer v2's
  PET_NODE_RANK is the Job's completion-index annotation).
- images: the command runs from this Python environment (its bin directory, with torchrun, first on PATH).
  Security contexts are not applied (processes run as the executor's user).
- init containers (the operator's wait-for-master-DNS) are reported completed without running: the address they
  wait for is the loopback rewrite above.
- termination messages: with terminationMessagePolicy FallbackToLogsOnError, a failed container's last log lines
  (80 lines, 2,048 bytes at most), as a kubelet does when the container wrote no termination message file.
- restarts: restartPolicy OnFailure/Always restarts the container in place after a kubelet's crash-loop back-off
  (restartCount + 1); the pod stays Running meanwhile. A container ends with its main process: what is left of
  its process group is killed then, as a container runtime ends a container's processes.
- deletion: a deleted pod's process group gets SIGTERM, then SIGKILL after terminationGracePeriodSeconds.

Each container's output is kept as a kubelet keeps it: stdout and stderr are pipes, drained into one file per
(re)start in the CRI log format (`<RFC 3339 time> stdout|stderr F|P <line>`, tests/e2e/container_logs.py):
`<work-dir>/pods/<namespace>/<pod>-<uid>/<container>/<restart count>.log`.

The kubelet API: an HTTPS server on loopback (the port is the Node's kubeletEndpoint; the certificate is the
control plane's, and the API server's client certificate is required) that serves, as a kubelet does,
`GET /containerLogs/{namespace}/{pod}/{container}`, which the API server's pods/log proxies to: the current run's
log (during a crash-loop back-off, the run that just ended); `previous=true` the run before (400 when there was
none); tailLines, limitBytes, sinceSeconds/sinceTime and timestamps; `follow=true` streams new lines until the
run's process has exited (a deleted pod's, once it has stopped) and its output is all read. 404 for a pod or
container it does not know.

Once the Node is registered and the server listens, it writes `<work-dir>/pod-executor.ready`: JSON with the
node's name, the kubelet port and whether pods have addresses of their own (`podAddresses`, and why not).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import ipaddress
import json
import os
import platform
import select
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kubernetes
import urllib3
from container_logs import LogOptions, LogOptionsError, LogWriter, flag, plain_text, stream_log
from local_processes import LOOPBACK, die_with_parent, free_port, terminate_group
from pod_network import POD_CIDR, AddressesUnavailable, PodAddresses

from ctl.pod import PodSetupError, Volume, image_path, local_container, the_container
from trainer.names import METRICS_DIR_ENV, METRICS_HOST_ENV, METRICS_PORT_ENV, PROGRESS_URL_ENV

NODE_NAME = "ddpjob-e2e-node"
MAX_PODS = 110  # the kubelet's default
HOST_VARIABLES = ("MASTER_ADDR", "PET_MASTER_ADDR", "PET_RDZV_ENDPOINT")
URL_VARIABLES = (PROGRESS_URL_ENV,)  # Trainer v2's status server (TrainJobStatus)
MASTER_PORT_VARIABLE = "PET_MASTER_PORT"
START_ERROR_EXIT_CODE = 128  # what a kubelet reports for a container that could not start
# How long a pod's start waits for the Service its master address names (the operator creates it after the pods).
SERVICE_WAIT_S = 60.0
# A kubelet's crash-loop back-off: 10 s, doubled per restart, at most 5 min.
RESTART_BACKOFF_S = 10.0
RESTART_BACKOFF_MAX_S = 300.0
# A kubelet's termination message from a failed container's log (FallbackToLogsOnError): its tail, this long at most.
TERMINATION_MESSAGE_LINES = 80
TERMINATION_MESSAGE_BYTES = 2048
# How long an ended container's output may take to reach its log file.
LOG_DRAIN_S = 10.0


class KubeletError(Exception):
    """A kubelet API request refused: the HTTP status and the kubelet's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def log(message: str) -> None:
    print(f"pod-executor: {message}", file=sys.stderr, flush=True)


@dataclass
class ContainerRun:
    """One start of a pod's container: its process and its log file (one per start, as a kubelet keeps)."""

    process: subprocess.Popen
    log: LogWriter
    started_at: str

    @property
    def container_id(self) -> str:
        return f"local://{self.process.pid}"


@dataclass
class LocalPod:
    """One pod's local state: its directory, address, container runs and what was reported."""

    namespace: str
    name: str
    uid: str
    directory: Path
    restart_policy: str
    grace_s: float
    container: str  # the one container run here
    containers: tuple[str, ...]  # every container name of the spec (init containers too)
    fallback_to_logs: bool = False  # terminationMessagePolicy FallbackToLogsOnError
    image: str = ""
    address: str = LOOPBACK
    runs: list[ContainerRun] = field(default_factory=list)
    previous_run: ContainerRun | None = None  # the ended run that lastState describes
    restart_count: int = 0
    started_at: str = ""
    last_state: dict[str, Any] = field(default_factory=dict)
    deleted: bool = False
    ended: bool = False  # reported terminated
    finished: bool = False  # its processes have stopped, its address is gone: nothing of it runs here any more
    wakeup: threading.Event = field(default_factory=threading.Event)  # deleted, or the executor stopping

    @property
    def process(self) -> subprocess.Popen | None:
        return self.runs[-1].process if self.runs else None


class PodExecutor:
    def __init__(self, kubeconfig: Path, work_dir: Path, tls: ssl.SSLContext) -> None:
        self.client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        self.core = kubernetes.client.CoreV1Api(self.client)
        self.work_dir = work_dir
        self.pods: dict[str, LocalPod] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.kubelet = KubeletServer(self, tls)
        self.addresses: PodAddresses | None = None  # None: pods share loopback
        self.master_ports: dict[tuple[str, str], int] = {}  # (namespace, headless Service): the port its pods share
        self.network_note = ""

    # -- the node -------------------------------------------------------------------------------------------------

    def run(self) -> None:
        self.addresses = self.pod_network()
        threading.Thread(target=self.kubelet.serve_forever, name="kubelet-api", daemon=True).start()
        self.register_node()
        self.write_ready_file()
        self.watch()

    def pod_network(self) -> PodAddresses | None:
        """Addresses of their own for the pods when this machine lets the executor add them; else None (pods
        share loopback), said once in the log."""
        addresses = PodAddresses(self.work_dir / "pod-addresses")
        try:
            addresses.probe()
        except AddressesUnavailable as error:
            self.network_note = f"pods share loopback, without addresses of their own: {error}"
            log(f"{self.network_note}; pods/proxy cannot reach them (podIP 127.0.0.1), metrics get a free port")
            return None
        return addresses

    def register_node(self) -> None:
        """The Node the API server finds this kubelet through: pods/log goes to its InternalIP address and the
        kubelet endpoint's port (pkg/kubelet/client). Ready, with this machine's CPUs and memory; no node
        controller runs here, so it needs no heartbeats."""
        capacity = {"cpu": str(os.cpu_count() or 1), "memory": f"{memory_kib()}Ki", "pods": str(MAX_PODS)}
        status = {
            "addresses": [{"type": "InternalIP", "address": LOOPBACK}, {"type": "Hostname", "address": NODE_NAME}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet.server_address[1]}},
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "the ddpjob e2e pod executor is running",
                    "lastHeartbeatTime": now(),
                    "lastTransitionTime": now(),
                }
            ],
            "nodeInfo": {
                "operatingSystem": "linux",
                "architecture": platform.machine(),
                "kernelVersion": platform.release(),
            },
        }
        labels = {"kubernetes.io/hostname": NODE_NAME, "kubernetes.io/os": "linux"}
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE_NAME, "labels": labels}, "status": status}
        try:
            self.core.create_node(node)  # a Node's status is set on create (a kubelet registers this way)
        except kubernetes.client.ApiException as error:
            if error.status != 409:
                raise
            self.core.patch_node_status(NODE_NAME, {"status": status})

    def write_ready_file(self) -> None:
        """What the control plane reads once the executor is up; written whole (renamed into place)."""
        ready = {
            "node": NODE_NAME,
            "kubeletPort": self.kubelet.server_address[1],
            "podAddresses": self.addresses is not None,
            "podNetwork": self.network_note or f"an address of {POD_CIDR} per pod, on lo",
        }
        partial = self.work_dir / "pod-executor.ready.partial"
        partial.write_text(json.dumps(ready))
        partial.rename(self.work_dir / "pod-executor.ready")

    # -- the watch loop -------------------------------------------------------------------------------------------

    def watch(self) -> None:
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
                    log(f"watch interrupted ({error}); listing again")
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
        if pod.spec.node_name not in (None, "", NODE_NAME):  # another node's pod: not for this kubelet
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
                container=pod.spec.containers[0].name,
                containers=tuple(c.name for c in [*pod.spec.containers, *(pod.spec.init_containers or [])]),
                fallback_to_logs=pod.spec.containers[0].termination_message_policy == "FallbackToLogsOnError",
            )
            self.pods[uid] = local
        threading.Thread(target=self.run_pod, args=(local, pod), name=pod.metadata.name, daemon=True).start()

    def delete(self, uid: str) -> None:
        """A pod deleted (or gone): its processes are stopped. Once nothing of it runs here, its API object is
        removed (finish_deletion): by run_pod, or here when the pod had finished already."""
        with self.lock:
            local = self.pods.get(uid)
            if local is None or local.deleted:
                return
            local.deleted = True
            local.wakeup.set()
            process = local.process
            finished = local.finished
        if finished:
            threading.Thread(target=self.finish_deletion, args=(local,), daemon=True).start()
        elif process is not None:
            threading.Thread(target=terminate_group, args=(process, local.grace_s), daemon=True).start()

    def stop(self) -> None:
        with self.lock:
            self.stopping.set()
            for local in self.pods.values():
                local.wakeup.set()
            running = [p.process for p in self.pods.values() if p.process is not None and p.process.poll() is None]
        stopping = [threading.Thread(target=terminate_group, args=(process, 5.0)) for process in running]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()
        if self.addresses is not None:
            self.addresses.release_all()

    # -- one pod ------------------------------------------------------------------------------------------------

    def run_pod(self, local: LocalPod, pod: kubernetes.client.V1Pod) -> None:
        """The pod's life on this node; its address goes when the pod ends, is deleted, or the executor stops."""
        try:
            self.run_containers(local, pod)
        finally:
            if self.addresses is not None and local.address != LOOPBACK:
                try:
                    self.addresses.release(local.address)
                except AddressesUnavailable as error:
                    log(f"pod {local.namespace}/{local.name}: {error}")
            with self.lock:  # a deletion either sees the pod finished, or is seen here
                local.finished = True
                deleted = local.deleted and not self.stopping.is_set()
            if deleted:
                self.finish_deletion(local)

    def finish_deletion(self, local: LocalPod) -> None:
        """Removes a deleted pod from the API once its processes have stopped, as a kubelet does (status
        manager): the API server deletes a pod bound to a node that is not finished only after its grace
        period, or when the node's kubelet deletes it again with grace period 0. The pod's uid is the
        precondition, so that a pod recreated under the same name stays."""
        try:
            options = {"gracePeriodSeconds": 0, "preconditions": {"uid": local.uid}}
            self.core.delete_namespaced_pod(local.name, local.namespace, body=options)
        except kubernetes.client.ApiException as error:
            if error.status not in (404, 409):  # gone already, or a new pod of that name
                raise

    def run_containers(self, local: LocalPod, pod: kubernetes.client.V1Pod) -> None:
        try:
            self.bind(local, pod)
            if self.addresses is not None:
                local.address = self.addresses.allocate()
            command, env, cwd = self.prepare(local, pod)
        except Exception as error:  # whatever stops the setup (a missing key, a bad subPath) fails the pod, with it
            self.report_terminated(local, START_ERROR_EXIT_CODE, "StartError", f"{type(error).__name__}: {error}")
            return
        while True:
            try:
                run = self.start_run(local, command, env, cwd)
            except OSError as error:
                self.report_terminated(local, START_ERROR_EXIT_CODE, "StartError", str(error))
                return
            if run is None:
                return
            self.report(local, "Running", {"running": {"startedAt": run.started_at}})
            exit_code = self.wait_for_end(run)
            if local.deleted or self.stopping.is_set():
                return
            restart = local.restart_policy == "Always" or (local.restart_policy == "OnFailure" and exit_code != 0)
            if not restart:
                message = termination_message(run, local.fallback_to_logs) if exit_code else ""
                self.report_terminated(local, exit_code, "Completed" if exit_code == 0 else "Error", message)
                return
            local.previous_run = run
            local.last_state = {
                "terminated": terminated_state(exit_code, "Error", "", run.started_at, run.container_id)
            }
            self.report(local, "Running", {"waiting": {"reason": "CrashLoopBackOff"}})
            local.wakeup.wait(min(RESTART_BACKOFF_S * 2**local.restart_count, RESTART_BACKOFF_MAX_S))
            local.restart_count += 1

    def bind(self, local: LocalPod, pod: kubernetes.client.V1Pod) -> None:
        """Assigns the pod to this node, as a scheduler would (none runs here): the API server finds the kubelet
        of a pod for pods/log through its spec.nodeName. The pod's uid is a precondition, so that a pod recreated
        under the same name is not bound by mistake."""
        if pod.spec.node_name:
            return
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": local.name, "uid": local.uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": NODE_NAME},
        }
        # Not preloaded: the client would read the answer (a Status) as a V1Binding, and fail on its missing target.
        self.core.create_namespaced_pod_binding(local.name, local.namespace, binding, _preload_content=False)

    def start_run(self, local: LocalPod, command: list[str], env: dict[str, str], cwd: Path) -> ContainerRun | None:
        """Starts the container (again), its stdout and stderr piped into this start's log file. None when the
        pod was deleted, or the executor is stopping, meanwhile."""
        with self.lock:  # a deletion (or stop) either sees this process or keeps it from starting
            if local.deleted or self.stopping.is_set():
                return None
            local.started_at = now()
            process = subprocess.Popen(
                command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=die_with_parent,
            )  # fmt: skip
            pipes = {"stdout": process.stdout, "stderr": process.stderr}
            run = ContainerRun(
                process,
                LogWriter(local.directory / local.container / f"{local.restart_count}.log", pipes),
                local.started_at,
            )
            local.runs.append(run)
        return run

    def wait_for_end(self, run: ContainerRun) -> int:
        """The run's exit code, once its output is all in its log file: 128 + N for a main process ended by signal
        N (137 for SIGKILL: the OOM killer's), as container runtimes report it. The container ends with its main
        process: what is left of its process group is killed (a straggler would keep the pipes open)."""
        returncode = run.process.wait()
        exit_code = 128 - returncode if returncode < 0 else returncode
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.process.pid, signal.SIGKILL)
        if not run.log.wait(LOG_DRAIN_S):
            log(f"{run.log.path}: output still open {LOG_DRAIN_S:.0f} s after the container ended")
        return exit_code

    def prepare(self, local: LocalPod, pod: kubernetes.client.V1Pod) -> tuple[list[str], dict[str, str], Path]:
        """The container's command line, environment and working directory, with the volumes materialised: the
        code `ctl run` starts its nodes with (ctl/pod.py)."""
        spec = self.client.sanitize_for_serialization(pod.spec)  # camelCase, as rendered
        if the_container(spec).get("envFrom"):
            raise PodSetupError("envFrom is not supported by the local executor")
        local.image = the_container(spec).get("image", "")
        (local.directory / local.container).mkdir(parents=True, exist_ok=True)

        def reference(name: str, source: dict[str, Any]) -> str:
            return self.env_reference(pod.metadata.namespace, name, source)

        container = local_container(
            spec, lambda volume: self.volume_dir(local, pod, volume), self.fields(local, pod), reference
        )
        env = container.env
        for name in HOST_VARIABLES:
            if name in env:
                env[name], service = self.loopback_if_service(env[name], local)
                if service and name == "PET_MASTER_ADDR" and MASTER_PORT_VARIABLE in env:
                    env[MASTER_PORT_VARIABLE] = str(self.master_port(local.namespace, service))
        for name in URL_VARIABLES:
            if name in env:
                url = urllib.parse.urlsplit(env[name])
                netloc, _ = self.loopback_if_service(url.netloc, local)
                env[name] = urllib.parse.urlunsplit(url._replace(netloc=netloc))
        if METRICS_PORT_ENV in env:
            env |= self.metrics_endpoint(local, env[METRICS_PORT_ENV])
        if METRICS_DIR_ENV in env:
            env[METRICS_DIR_ENV] = str(local.directory / "metrics")
            Path(env[METRICS_DIR_ENV]).mkdir(exist_ok=True)
        tmp = local.directory / "tmp"
        tmp.mkdir(exist_ok=True)
        base = {"PATH": image_path(os.environ.get("PATH", os.defpath)), "HOME": str(Path.home())}
        env = base | {"TMPDIR": str(tmp), "HOSTNAME": local.name} | env
        return container.command, env, container.working_dir or local.directory

    def metrics_endpoint(self, local: LocalPod, port: str) -> dict[str, str]:
        """Where the trainer serves its metrics: on the pod's address and the port of its spec, as in a cluster;
        on loopback, where all pods share the ports, a free port of its own."""
        if local.address != LOOPBACK:
            return {METRICS_HOST_ENV: local.address, METRICS_PORT_ENV: port}
        return {METRICS_HOST_ENV: LOOPBACK, METRICS_PORT_ENV: str(free_port())}

    def volume_dir(self, local: LocalPod, pod: kubernetes.client.V1Pod, volume: Volume) -> Path:
        directory = local.directory / "volumes" / volume["name"]
        if "persistentVolumeClaim" in volume:
            directory = self.work_dir / "volumes" / local.namespace / volume["persistentVolumeClaim"]["claimName"]
        directory.mkdir(parents=True, exist_ok=True)
        if "configMap" in volume:
            data = self.core.read_namespaced_config_map(volume["configMap"]["name"], local.namespace).data or {}
            for key, value in data.items():
                (directory / key).write_text(value)
        elif "secret" in volume:
            data = self.core.read_namespaced_secret(volume["secret"]["secretName"], local.namespace).data or {}
            for key, value in data.items():
                (directory / key).write_bytes(base64.b64decode(value))
        elif "projected" in volume:
            self.project(local, pod, volume["projected"].get("sources") or [], directory)
        elif not {"persistentVolumeClaim", "emptyDir"} & set(volume):
            raise PodSetupError(f"volume {volume['name']!r}: only configMap, secret, PVC, emptyDir and projected")
        return directory

    def project(self, local: LocalPod, pod: kubernetes.client.V1Pod, sources: list[Any], directory: Path) -> None:
        """A projected volume as a kubelet fills it: service account tokens (a TokenRequest for the pod's service
        account with the source's audience, bound to the pod), ConfigMap keys (waited for a while, as a kubelet
        retries the mount) and downward API fields; e.g. Trainer v2's status server token and CA, or the API
        access volume of a pod that mounts its service account token."""
        for source in sources:
            if projection := source.get("serviceAccountToken"):
                spec = {
                    "audiences": [projection["audience"]] if projection.get("audience") else None,
                    "expirationSeconds": projection.get("expirationSeconds", 3600),
                    "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": local.name, "uid": local.uid},
                }
                account = pod.spec.service_account_name or "default"
                request = self.core.create_namespaced_service_account_token(account, local.namespace, {"spec": spec})
                (directory / projection["path"]).write_text(request.status.token)
            elif projection := source.get("configMap"):
                data = self.wait_for_config_map(local, projection["name"], projection.get("optional", False))
                items = {i["key"]: i["path"] for i in projection.get("items") or []} or {key: key for key in data}
                for key, path in items.items():
                    if key in data:
                        (directory / path).write_text(data[key])
            elif projection := source.get("downwardAPI"):
                fields = self.fields(local, pod)
                for item in projection.get("items") or []:
                    (directory / item["path"]).write_text(fields.get(item.get("fieldRef", {}).get("fieldPath"), ""))

    def wait_for_config_map(self, local: LocalPod, name: str, optional: bool) -> dict[str, str]:
        deadline = time.monotonic() + SERVICE_WAIT_S
        while True:
            try:
                return self.core.read_namespaced_config_map(name, local.namespace).data or {}
            except kubernetes.client.ApiException as error:
                if error.status != 404:
                    raise
            if optional:
                return {}
            if time.monotonic() > deadline or local.wakeup.wait(0.5):
                raise PodSetupError(f"configmap {name!r} not found (a projected volume of the pod)")

    def fields(self, local: LocalPod, pod: kubernetes.client.V1Pod) -> dict[str, str]:
        """The fieldRefs a container's env may name, as this node answers them: the pod's labels and
        annotations too (Trainer v2's PET_NODE_RANK is the Job's completion-index annotation)."""
        metadata = {
            f"metadata.{kind}['{key}']": value
            for kind, values in (("labels", pod.metadata.labels), ("annotations", pod.metadata.annotations))
            for key, value in (values or {}).items()
        }
        return metadata | {
            "metadata.name": pod.metadata.name,
            "metadata.namespace": pod.metadata.namespace,
            "metadata.uid": pod.metadata.uid,
            "spec.nodeName": NODE_NAME,
            "status.podIP": local.address,
            "status.podIPs": local.address,
            "status.hostIP": LOOPBACK,
            "status.hostIPs": LOOPBACK,
        }

    def env_reference(self, namespace: str, name: str, source: dict[str, Any]) -> str:
        """A configMapKeyRef or secretKeyRef, read from the API; any other valueFrom fails the pod."""
        if ref := source.get("configMapKeyRef"):
            return self.core.read_namespaced_config_map(ref["name"], namespace).data[ref["key"]]
        if ref := source.get("secretKeyRef"):
            return base64.b64decode(self.core.read_namespaced_secret(ref["name"], namespace).data[ref["key"]]).decode()
        raise PodSetupError(f"env {name}: this valueFrom is not supported by the local executor")

    def loopback_if_service(self, value: str, local: LocalPod) -> tuple[str, str]:
        """`host[:port]` with host 127.0.0.1 when host names a Service as cluster DNS resolves it, with the name of
        the headless Service when host is one of its pods (`hostname.subdomain`; else ""). Controllers create the
        Services just after the pods, so this waits for the Service a while, as the v1 worker's init container
        waits for the master's DNS name."""
        host, colon, port = value.partition(":")
        labels = host.split(".")
        if is_ip_address(host):
            return value, ""
        # svc, svc.ns, svc.ns.svc[.cluster.local]; or hostname.subdomain[.ns[.svc[.cluster.local]]].
        cluster_suffix = len(labels) >= 3 and labels[2] == "svc"
        pod_of_service = len(labels) >= 2 and not cluster_suffix and (len(labels) > 2 or labels[1] != local.namespace)
        service = labels[1] if pod_of_service else labels[0]
        rest = labels[2:] if pod_of_service else labels[1:]
        namespace = rest[0] if rest else local.namespace
        deadline = time.monotonic() + SERVICE_WAIT_S
        while True:
            try:
                self.core.read_namespaced_service(service, namespace)
                return f"{LOOPBACK}{colon}{port}", service if pod_of_service else ""
            except kubernetes.client.ApiException as error:
                if error.status != 404:
                    raise
            if time.monotonic() > deadline or local.wakeup.wait(0.5):  # waited enough, or deleted, or stopping
                return value, ""

    def master_port(self, namespace: str, service: str) -> int:
        """The port the pods of a headless Service use for their master's, the same for each of its pods."""
        with self.lock:
            return self.master_ports.setdefault((namespace, service), free_port())

    # -- container logs -------------------------------------------------------------------------------------------

    def log_run(self, namespace: str, name: str, container: str, previous: bool) -> ContainerRun:
        """The run whose log a kubelet serves (validateContainerLogStatus, pkg/kubelet/kubelet_pods.go): the
        latest, running or ended (in a crash-loop back-off, the one that just failed); with `previous`, the
        ended run that the container's lastState describes. Refusals in the kubelet's words."""
        local = self.find_pod(namespace, name)
        if local is None:
            raise KubeletError(404, f'pod "{name}" does not exist')
        if container not in local.containers:
            raise KubeletError(404, f'container "{container}" not found in pod "{name}"')
        ran = container == local.container  # init containers are reported completed, never run
        if previous:
            if local.previous_run is None or not ran:
                raise KubeletError(400, f'previous terminated container "{container}" in pod "{name}" not found')
            return local.previous_run
        if ran and local.runs:
            return local.runs[-1]
        if local.ended or not ran:
            raise KubeletError(400, f'container "{container}" in pod "{name}" is terminated')
        raise KubeletError(400, f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating')

    def find_pod(self, namespace: str, name: str) -> LocalPod | None:
        """The newest pod of that name (a deleted one is known until it is replaced: it may still be stopping)."""
        with self.lock:
            return next((p for p in reversed(self.pods.values()) if (p.namespace, p.name) == (namespace, name)), None)

    # -- status ---------------------------------------------------------------------------------------------------

    def report_terminated(self, local: LocalPod, exit_code: int, reason: str, message: str) -> None:
        local.ended = True
        phase = "Succeeded" if exit_code == 0 else "Failed"
        container_id = local.runs[-1].container_id if local.runs else ""
        state = {"terminated": terminated_state(exit_code, reason, message, local.started_at or now(), container_id)}
        self.report(local, phase, state, message)

    def report(self, local: LocalPod, phase: str, state: dict[str, Any], message: str = "") -> None:
        if local.deleted:
            return
        running = "running" in state
        status = {
            "phase": phase,
            "hostIP": LOOPBACK,
            "hostIPs": [{"ip": LOOPBACK}],
            "podIP": local.address,
            "podIPs": [{"ip": local.address}],
            "startTime": local.started_at or now(),
            "conditions": [{"type": "Ready", "status": str(running), "lastTransitionTime": now()}],
            "containerStatuses": [
                {
                    "name": local.container,
                    "image": local.image,
                    "imageID": "",
                    "containerID": local.runs[-1].container_id if local.runs else "",
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


def termination_message(run: ContainerRun, fallback_to_logs: bool) -> str:
    """A failed container's termination message, as a kubelet makes it with FallbackToLogsOnError (no container
    here writes a termination message file): its last 80 lines of output, at most their last 2,048 bytes."""
    if not fallback_to_logs:
        return ""
    tail = "".join(plain_text([run.log.path]).splitlines(keepends=True)[-TERMINATION_MESSAGE_LINES:])
    return tail.encode()[-TERMINATION_MESSAGE_BYTES:].decode(errors="replace")


def is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def terminated_state(
    exit_code: int, reason: str, message: str, started_at: str, container_id: str = ""
) -> dict[str, Any]:
    state = {"exitCode": exit_code, "reason": reason, "message": message, "startedAt": started_at, "finishedAt": now()}
    return state | ({"containerID": container_id} if container_id else {})


def memory_kib() -> int:
    """This machine's memory (MemTotal of /proc/meminfo), as a kubelet reports the node's capacity."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1])
    return 0


class KubeletServer(ThreadingHTTPServer):
    """The kubelet's HTTPS API on loopback, as much of it as the API server uses here: /containerLogs."""

    daemon_threads = True

    def __init__(self, executor: PodExecutor, tls: ssl.SSLContext) -> None:
        super().__init__((LOOPBACK, 0), KubeletHandler)
        self.executor = executor
        # The handshake happens in each request's thread (KubeletHandler.setup), not in the accepting one.
        self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log(f"kubelet API: {client_address}: {sys.exc_info()[1]!r}")


class KubeletHandler(BaseHTTPRequestHandler):
    """GET /containerLogs/{namespace}/{pod}/{container}: a container run's log, as pkg/kubelet/server serves it
    (chunked, each piece sent as soon as it is read)."""

    protocol_version = "HTTP/1.1"
    timeout = 60  # a client that stops reading, or never finishes its handshake, does not hold a thread forever
    server: KubeletServer

    def setup(self) -> None:
        super().setup()
        self.connection.do_handshake()

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        parts = [urllib.parse.unquote(part) for part in url.path.split("/")]
        if len(parts) != 5 or parts[:2] != ["", "containerLogs"] or not all(parts[2:]):
            self.answer(404, "404 page not found")
            return
        namespace, pod, container = parts[2:]
        query = {name: values[0] for name, values in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
        try:
            options = LogOptions.from_query(query, time.time_ns())
            run = self.server.executor.log_run(namespace, pod, container, flag(query, "previous"))
        except (KubeletError, LogOptionsError) as error:
            self.answer(error.status, str(error))
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            stream_log(run.log.path, options, self.send_chunk, run.log.done, self.client_gone)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client went away (ssl.SSLError is an OSError too)
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        message = format % args
        if not message.startswith("Request timed out"):  # an idle keep-alive connection closed: nothing wrong
            log(f"kubelet API: {message}")

    def answer(self, status: int, message: str) -> None:
        body = message.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_chunk(self, data: bytes) -> None:
        if data:  # an empty chunk would end the response
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def client_gone(self) -> bool:
        """Whether the client closed the connection (it sends nothing more after its GET, so anything readable
        means it is going); a follow stops waiting then."""
        return bool(select.select([self.connection], [], [], 0)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, required=True)
    # The kubelet's own flags: its serving certificate, and the CA its clients' certificates must come from.
    parser.add_argument("--tls-cert-file", type=Path, required=True)
    parser.add_argument("--tls-private-key-file", type=Path, required=True)
    parser.add_argument("--client-ca-file", type=Path, required=True)
    args = parser.parse_args()
    executor = PodExecutor(args.kubeconfig, args.work_dir, kubelet_tls(args))

    def on_signal(signum: int, _frame: Any) -> None:
        executor.stop()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # The main thread only waits, in short steps: Python runs signal handlers in the main thread, and one blocked
    # in a read (the watch) runs them only when the read returns, which may be much later than the signal when
    # another thread took it. The executor's end is that thread's end (an error), or a signal's.
    node = threading.Thread(target=executor.run, name="node")
    node.start()
    while node.is_alive():
        node.join(0.5)
    sys.exit(1)


def kubelet_tls(args: argparse.Namespace) -> ssl.SSLContext:
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(args.tls_cert_file, args.tls_private_key_file)
    tls.load_verify_locations(args.client_ca_file)
    tls.verify_mode = ssl.CERT_REQUIRED
    return tls


if __name__ == "__main__":
    main()

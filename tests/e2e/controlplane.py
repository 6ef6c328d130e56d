"""A real Kubernetes control plane and node on this machine: etcd, kube-apiserver, the PyTorchJob, JobSet,
Trainer v2 and Kueue CRDs, kube-controller-manager (the controllers in CONTROLLERS), kube-scheduler, the Kubeflow
training operator (v1.9), the JobSet controller (v0.12), the Kubeflow Trainer v2 controller manager (v2.3, its
TrainJobStatus feature on), Kueue's controller manager (v0.17, admitting PyTorchJobs and TrainJobs), and one real
node (tests/e2e/node.py: kubelet, containerd and runc, the CNI bridge, kube-proxy, CoreDNS) whose pods run in
containers of the project's image (`make image`).

    .venv/bin/python tests/e2e/controlplane.py up      # prints `export KUBECONFIG=...`, runs until Ctrl-C

So a PyTorchJob becomes pods and Services (the operator), a TrainJob a JobSet (Trainer v2), a JobSet Indexed batch
Jobs and a headless Service (JobSet), a Job pods (the Job controller); the scheduler binds pods to the node, whose
kubelet runs them; deleting a job removes what it made (owner references; a foreground deletion ends once they are
gone), and a deleted namespace is emptied and removed.

The webhooks of Trainer v2, JobSet and Kueue are registered as their releases ship them (their modules' kustomize
manifests and patches), each pointing at its server's 127.0.0.1 URL with this plane's CA as the bundle; the
servers present a certificate of that CA (their own certificate management is off). Kueue's CRDs are its bases
without the conversion webhooks of its release: everything here speaks its storage version, v1beta2.

The API server listens on this machine's end of the node's link (node.HOST_ADDRESS), where the node's kubelet,
kube-proxy and CoreDNS reach it with client certificates of the plane's CA (the kubelet as
system:node:<node>, under the Node authorizer and NodeRestriction); it reaches the kubelet's HTTPS API (pods/log,
exec) at the Node's InternalIP with its own client certificate. Needs root (namespaces, mounts, cgroups).

Every process runs in its own process group with a parent-death signal, and `ControlPlane.stop` (also run at
exit and on SIGTERM) stops the node (which restores what it changed on this machine), then ends each group, so
nothing outlives the harness.
"""

from __future__ import annotations

import atexit
import base64
import datetime
import ipaddress
import os
import secrets
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import node
import yaml
from cluster_binaries import CACHE, Binaries, ensure_binaries
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from local_processes import LOOPBACK, start_process, terminate_group, wait_until
from oci import busybox_image

from ctl.cluster import Target, apply
from ctl.jobs import apply_job
from ctl.kinds import KINDS
from ctl.processes import free_port

ADMIN_USER = "ddpjob-e2e-admin"
PLANE_STOP_GRACE_S = 2
# The controller-manager's own identity, bound by the API server's bootstrap RBAC policy (role and binding
# system:kube-controller-manager); its controllers act as their kube-system service accounts.
CONTROLLER_MANAGER_USER = "system:kube-controller-manager"
# What the tier needs of a controller-manager: owner references followed (pods and Services of a deleted job,
# foreground deletions finished), deleted namespaces emptied and removed, and a deleted claim's
# kubernetes.io/pvc-protection finalizer removed once no pod uses it (else its namespace stays Terminating).
# The Job controller runs the batch Jobs a JobSet creates (Indexed: each pod gets its completion index); the root
# CA publisher gives every namespace the kube-root-ca.crt ConfigMap that a pod's API access volume projects.
# For the node: its not-ready taint (which the kubelet registers it with) lifted once it is Ready, EndpointSlices
# of Services (kube-proxy and CoreDNS read them), every namespace's `default` ServiceAccount, claims bound to
# volumes (and a volume's protection finalizer removed once released), finished pods collected.
CONTROLLERS = (
    "garbage-collector-controller",
    "namespace-controller",
    "persistentvolumeclaim-protection-controller",
    "job-controller",
    "root-ca-certificate-publisher-controller",
    "node-lifecycle-controller",
    "endpointslice-controller",
    "serviceaccount-controller",
    "persistentvolume-binder-controller",
    "persistentvolume-protection-controller",
    "pod-garbage-collector-controller",
)
# The components that authenticate with a client certificate of the plane's CA (pki), each with its kubeconfig.
CERTIFICATE_USERS = ("kubelet-client", "kube-proxy", "kube-scheduler", "coredns")
# A user with no rights but those k8s/rbac.yaml gives its group, for checking that the Role is enough for ctl.
RESTRICTED_USER, RESTRICTED_GROUP = "ddpjob-e2e-user", "ddpjob-users"
OPERATOR_NAMESPACE = "kubeflow"
# cmd/training-operator.v1 defaults: the Secret its cert rotator fills and the Service name in its certificate.
OPERATOR_WEBHOOK_SECRET = "training-operator-webhook-cert"
OPERATOR_WEBHOOK_DNS = f"training-operator.{OPERATOR_NAMESPACE}.svc"
# A directory fixed in both operators' code, so shared by every control plane on the machine: the v1 operator's
# cert rotator only checks that tls.crt exists there (pkg/cert), so a public certificate is left there; Trainer
# v2.3's status server serves the pair it finds there (pkg/util/cert certDir), so its own plane's pair is
# bind-mounted there in its private mount namespace.
SHARED_CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")
# controller-runtime's webhook server's pair, under $TMPDIR.
WEBHOOK_CERT_DIR = Path("k8s-webhook-server/serving-certs")
# Where a pod's service account token is (the status server reads it at start to find the token issuer).
SERVICE_ACCOUNT_DIR = Path("/run/secrets/kubernetes.io/serviceaccount")
# Trainer v2.3's defaults (pkg/util/cert, its Configuration's certManagement): the namespace it takes itself to run
# in outside a pod, the Secret whose ca.crt its TrainJobStatus plugin hands to the pods, and the Service name in
# the status server's URL.
TRAINER_NAMESPACE = "kubeflow-system"
TRAINER_WEBHOOK_SECRET = "kubeflow-trainer-webhook-cert"
TRAINER_SERVICE = "kubeflow-trainer-controller-manager"
TRAINER_SERVICE_DNS = f"{TRAINER_SERVICE}.{TRAINER_NAMESPACE}.svc"
# Where the modules keep their CRDs and webhook kustomizations (JobSet and Kueue: the same kubebuilder layout).
TRAINER_CRDS, TRAINER_WEBHOOKS = "manifests/base/crds", "manifests/base/webhook"
KUBEBUILDER_CRDS, KUBEBUILDER_WEBHOOKS = "config/components/crd/bases", "config/components/webhook"
# JobSet's and Kueue's releases prefix their objects' names (config/default's namePrefix); Trainer's patches name
# its own.
JOBSET_NAME_PREFIX, KUEUE_NAME_PREFIX = "jobset-", "kueue-"
# Kueue's release namespace (its webhooks' namespaceSelector leaves it out) and its release's Configuration.
KUEUE_NAMESPACE = "kueue-system"
KUEUE_CONFIG = "config/components/manager/controller_manager_config.yaml"
# Where Kueue reads its metrics server's pair when its own certificate management is off (cmd/kueue: fixed, and
# read at start even with metrics off).
KUEUE_METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
# How k8s/README.md installs the operator: k8s/operator's kustomization, whose Deployment patch gives it flags and
# mounts the ConfigMap made of that directory's files (the init container template of Worker pods).
OPERATOR_OVERLAY = Path(__file__).resolve().parents[2] / "k8s" / "operator"
STARTUP_TIMEOUT_S = 120
# containerd's content and snapshots, kept between runs (by containerd's version): the training image is imported
# once per content.
CONTAINERD_ROOT = CACHE / "containerd"


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


def new_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def write_key(key: rsa.RSAPrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def issue_certificate(
    directory: Path,
    name: str,
    common_name: str,
    sans: list[x509.GeneralName],
    ca: tuple[x509.Certificate, rsa.RSAPrivateKey] | None,
    groups: tuple[str, ...] = (),
) -> tuple[x509.Certificate, rsa.RSAPrivateKey, KeyPair]:
    """A certificate valid for a day: self-signed CA when `ca` is None, else one signed by it, for a server (its
    `sans`) or a client (the API server takes the common name as the user, each organization as a group)."""
    key = new_key()
    subject = x509.Name(
        [
            *(x509.NameAttribute(NameOID.ORGANIZATION_NAME, group) for group in groups),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca[0].subject if ca else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca[1] if ca else key, hashes.SHA256())
    pair = KeyPair(directory / f"{name}.crt", directory / f"{name}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_key(key, pair.key)
    return cert, key, pair


@dataclass
class ControlPlane:
    """A running control plane; `kubeconfig` is an admin (system:masters) kubeconfig for it, `user_kubeconfig`
    one of a user in group ddpjob-users (rights only where a RoleBinding grants them). `node`: the real node its
    pods run on (none for a plane without the operators)."""

    work_dir: Path
    kubeconfig: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    node: node.Node | None = None
    address: str = LOOPBACK  # the API server's
    webhook_ports: dict[str, int] = field(default_factory=dict)  # by controller manager

    def claim_dir(self, namespace: str, claim: str) -> Path:
        """The directory of the local volume bound to a PersistentVolumeClaim (node.provision)."""
        assert self.node is not None, "a plane without the operators runs no pods"
        return self.node.volume_dir(namespace, claim)

    @property
    def user_kubeconfig(self) -> Path:
        return self.work_dir / "kubeconfig-user"

    def kubeconfig_of(self, component: str) -> Path:
        """The kubeconfig of a component that authenticates with its client certificate (pki's `component`)."""
        return self.work_dir / f"kubeconfig-{component}"

    @property
    def controller_manager_kubeconfig(self) -> Path:
        return self.work_dir / "kubeconfig-controller-manager"

    def api_client(self) -> kubernetes.client.ApiClient:
        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))

    @property
    def pki_dir(self) -> Path:
        """The CA and the certificates it issued (`pki`): `<name>.crt` and `<name>.key`."""
        return self.work_dir / "pki"

    def stop(self) -> None:
        # The node first (it ends the pods' containers), then the managers, the controller-manager, the API
        # server, etcd: the reverse of the start.
        if self.node is not None:
            self.node.stop()
        # A plane is thrown away with its directory, so its processes get 2 s, not 10: the controller-manager, the
        # JobSet controller and etcd each used the whole 10 before the SIGKILL (20-30 s a plane, 3 planes a run).
        for name in reversed(list(self.processes)):
            terminate_group(self.processes.pop(name), grace_s=PLANE_STOP_GRACE_S)


def pki(directory: Path) -> dict[str, KeyPair]:
    """The plane's CA and what it issues: the API server's serving certificate (by loopback, by the host end of the
    node's link, and as the `kubernetes` Service) and its client certificate for the kubelet, the kubelet's and
    the controller-manager's serving certificates, the node components' client certificates (the kubelet as
    system:node:<node>, kube-proxy, the scheduler and CoreDNS, each a user the API server's bootstrap RBAC or
    node.cluster_objects gives its rights), the webhook servers' certificate; and the service-account signing
    key."""
    directory.mkdir(parents=True)
    ca_cert, ca_key, ca = issue_certificate(directory, "ca", "ddpjob-e2e-ca", [], None)
    authority = (ca_cert, ca_key)
    loopback = [x509.IPAddress(ipaddress.ip_address(LOOPBACK)), x509.DNSName("localhost")]
    kubernetes_service = ipaddress.ip_network(node.SERVICE_CIDR)[1]
    apiserver_names = [
        *loopback,
        x509.IPAddress(ipaddress.ip_address(node.HOST_ADDRESS)),
        x509.IPAddress(kubernetes_service),
        *(x509.DNSName(name) for name in ("kubernetes", "kubernetes.default", "kubernetes.default.svc")),
    ]
    issued = {
        "apiserver": ("kube-apiserver", apiserver_names, ()),
        "apiserver-kubelet-client": ("kube-apiserver-kubelet-client", [], ()),
        "kubelet": (node.NODE_NAME, [x509.IPAddress(ipaddress.ip_address(node.NODE_IP))], ()),
        "kubelet-client": (f"system:node:{node.NODE_NAME}", [], ("system:nodes",)),
        "kube-proxy": ("system:kube-proxy", [], ()),
        "kube-scheduler": ("system:kube-scheduler", loopback, ()),
        "coredns": (node.COREDNS_USER, [], ()),
        "kube-controller-manager": ("kube-controller-manager", loopback, ()),
        # One pair for every webhook server (and Trainer v2's status server): by Service name or by 127.0.0.1.
        "webhook": (
            OPERATOR_WEBHOOK_DNS,
            [x509.DNSName(OPERATOR_WEBHOOK_DNS), x509.DNSName(TRAINER_SERVICE_DNS), *loopback],
            (),
        ),
    }
    pairs = {"ca": ca}
    for name, (common_name, sans, groups) in issued.items():
        pairs[name] = issue_certificate(directory, name, common_name, sans, authority, groups)[2]
    service_accounts = KeyPair(directory / "sa.pub", directory / "sa.key")
    sa_key = new_key()
    write_key(sa_key, service_accounts.key)
    service_accounts.cert.write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return pairs | {"service-accounts": service_accounts}


def write_kubeconfig(path: Path, server: str, ca: Path, user: str, credentials: str | KeyPair) -> None:
    """A kubeconfig for `user` with a bearer token, or a client certificate (KeyPair)."""
    if isinstance(credentials, KeyPair):
        authentication = {"client-certificate": str(credentials.cert), "client-key": str(credentials.key)}
    else:
        authentication = {"token": credentials}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "ddpjob-e2e", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": authentication}],
        "contexts": [{"name": "ddpjob-e2e", "context": {"cluster": "ddpjob-e2e", "user": user}}],
        "current-context": "ddpjob-e2e",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)


def start_etcd(plane: ControlPlane, binary: Path) -> str:
    client_url = f"http://{LOOPBACK}:{free_port()}"
    peer_url = f"http://{LOOPBACK}:{free_port()}"
    log = plane.work_dir / "etcd.log"
    command = [
        str(binary),
        "--name=ddpjob-e2e",
        f"--data-dir={plane.work_dir / 'etcd'}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=ddpjob-e2e={peer_url}",
        "--log-level=warn",
        # A throwaway store: no fsync on every write (the test machine's disk is shared).
        "--unsafe-no-fsync",
    ]
    plane.processes["etcd"] = process = start_process(command, log)

    def healthy() -> bool:
        with urllib.request.urlopen(f"{client_url}/health", timeout=2) as response:
            return b'"true"' in response.read()

    wait_until(healthy, "etcd", STARTUP_TIMEOUT_S, process, log)
    return client_url


def start_apiserver(plane: ControlPlane, binary: Path, etcd_url: str, certs: dict[str, KeyPair]) -> None:
    """The API server on `plane.address`: the host end of the node's link when there is a node (its kubelet,
    kube-proxy and CoreDNS connect from there), else loopback."""
    port = free_port()
    token, user_token, manager_token = (secrets.token_hex(16) for _ in range(3))
    tokens = plane.work_dir / "tokens.csv"
    tokens.write_text(
        f'{token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n'
        f'{user_token},{RESTRICTED_USER},{RESTRICTED_USER},"{RESTRICTED_GROUP}"\n'
        f"{manager_token},{CONTROLLER_MANAGER_USER},{CONTROLLER_MANAGER_USER}\n"
    )
    tokens.chmod(0o600)
    log = plane.work_dir / "kube-apiserver.log"
    command = [
        str(binary),
        f"--etcd-servers={etcd_url}",
        f"--bind-address={plane.address}",
        f"--advertise-address={plane.address}",
        f"--secure-port={port}",
        f"--tls-cert-file={certs['apiserver'].cert}",
        f"--tls-private-key-file={certs['apiserver'].key}",
        f"--token-auth-file={tokens}",
        # Client certificates: the node's components.
        f"--client-ca-file={certs['ca'].cert}",
        # The Node authorizer and NodeRestriction: the kubelet may touch its own Node and its pods only.
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        f"--service-account-key-file={certs['service-accounts'].cert}",
        f"--service-account-signing-key-file={certs['service-accounts'].key}",
        # The API server itself: Trainer v2's status server discovers the issuer's keys there (OIDC discovery).
        f"--service-account-issuer=https://{plane.address}:{port}",
        f"--service-cluster-ip-range={node.SERVICE_CIDR}",
        # pods/log, exec: to the kubelet at the Node's InternalIP (its bridge address), its certificate checked.
        "--kubelet-preferred-address-types=InternalIP",
        f"--kubelet-certificate-authority={certs['ca'].cert}",
        f"--kubelet-client-certificate={certs['apiserver-kubelet-client'].cert}",
        f"--kubelet-client-key={certs['apiserver-kubelet-client'].key}",
        # Nothing here needs the `kubernetes` Service's endpoints (pods do not call the API server).
        "--endpoint-reconciler-type=none",
        "--profiling=false",
        "--v=1",
    ]
    plane.processes["kube-apiserver"] = process = start_process(command, log)
    server = f"https://{plane.address}:{port}"
    write_kubeconfig(plane.kubeconfig, server, certs["ca"].cert, ADMIN_USER, token)
    write_kubeconfig(plane.user_kubeconfig, server, certs["ca"].cert, RESTRICTED_USER, user_token)
    write_kubeconfig(
        plane.controller_manager_kubeconfig, server, certs["ca"].cert, CONTROLLER_MANAGER_USER, manager_token
    )
    for component in CERTIFICATE_USERS:
        write_kubeconfig(plane.kubeconfig_of(component), server, certs["ca"].cert, component, certs[component])
    client = plane.api_client()

    def ready() -> bool:
        return client.call_api("/readyz", "GET", auth_settings=["BearerToken"], _preload_content=False)[1] == 200

    wait_until(ready, "kube-apiserver", STARTUP_TIMEOUT_S, process, log)


def start_controller_manager(plane: ControlPlane, binary: Path, certs: dict[str, KeyPair]) -> None:
    """The CONTROLLERS, run by system:kube-controller-manager; each controller uses its own kube-system service
    account's token (as kubeadm runs it), which has the rights to delete what it must (the manager's own role only
    reads). Its HTTPS port (a certificate of this plane's CA) answers /healthz to anyone."""
    port = free_port()
    log = plane.work_dir / "kube-controller-manager.log"
    kubeconfig = plane.controller_manager_kubeconfig
    command = [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        # Tokens are checked by TokenReview; the API server publishes no client CA to look up (no client certs).
        "--authentication-skip-lookup",
        f"--controllers={','.join(CONTROLLERS)}",
        f"--root-ca-file={certs['ca'].cert}",
        "--use-service-account-credentials=true",
        "--leader-elect=false",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={port}",
        f"--tls-cert-file={certs['kube-controller-manager'].cert}",
        f"--tls-private-key-file={certs['kube-controller-manager'].key}",
        "--profiling=false",
        "--v=1",
    ]
    plane.processes["kube-controller-manager"] = process = start_process(command, log)
    context = ssl.create_default_context(cafile=str(certs["ca"].cert))

    def healthy() -> bool:
        url = f"https://{LOOPBACK}:{port}/healthz"
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return response.status == 200 and response.read() == b"ok"

    wait_until(healthy, "kube-controller-manager", STARTUP_TIMEOUT_S, process, log)


def server_side_apply(client: kubernetes.client.ApiClient, obj: dict[str, Any], dry_run: bool = False) -> Any:
    """`ctl`'s own server-side apply, in the object's namespace (cluster-scoped objects ignore it); a job as
    `ctl submit` applies it (again while its operator's webhook has not yet seen its runtime).
    Returns the object as the API server stored it (or would have, with `dry_run`)."""
    target = Target(client, obj["metadata"].get("namespace", "default"))
    return (apply_job if obj["kind"] in KINDS else apply)(target, obj, dry_run)


def install_crds(plane: ControlPlane, crd_files: list[Path]) -> None:
    """Applies every CRD, then waits until each is established."""
    crds = [yaml.safe_load(crd_file.read_text()) for crd_file in crd_files]
    client = plane.api_client()
    for crd in crds:
        server_side_apply(client, crd)
    extensions = kubernetes.client.ApiextensionsV1Api(client)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for name in [crd["metadata"]["name"] for crd in crds]:
        while True:
            status = extensions.read_custom_resource_definition(name).status
            if any(c.type == "Established" and c.status == "True" for c in (status.conditions or [])):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"CRD {name} not established after {STARTUP_TIMEOUT_S} s")
            time.sleep(0.2)


def job_set_and_trainer_crds(binaries: Binaries) -> list[Path]:
    """JobSet's CRD and Trainer v2's (TrainJob, TrainingRuntime, ClusterTrainingRuntime), from their modules."""
    return [
        *sorted((binaries.jobset_source / KUBEBUILDER_CRDS).glob("*.yaml")),
        *sorted((binaries.trainer_source / TRAINER_CRDS).glob("trainer.kubeflow.org_*.yaml")),
    ]


def kueue_crds(binaries: Binaries) -> list[Path]:
    """Kueue's (ClusterQueue, LocalQueue, Workload, ResourceFlavor, ...), from its module."""
    return sorted((binaries.kueue_source / KUBEBUILDER_CRDS).glob("kueue.x-k8s.io_*.yaml"))


def ensure_namespace(client: kubernetes.client.ApiClient, namespace: str) -> None:
    """The namespace and its `default` ServiceAccount (the controller-manager's serviceaccount-controller, which
    would create the latter, does not run here)."""
    for obj in (
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": namespace}},
    ):
        server_side_apply(client, obj)


def operator_flags(overlay: Path = OPERATOR_OVERLAY) -> list[str]:
    """The flags k8s/operator's Deployment patch gives the operator, with the mounted ConfigMap's directory read
    from the overlay directory itself (where its configMapGenerator takes the files from)."""
    patch = yaml.safe_load((overlay / "deployment-patch.yaml").read_text())
    (container,) = patch["spec"]["template"]["spec"]["containers"]
    (mount,) = container["volumeMounts"]
    return [arg.replace(mount["mountPath"], str(overlay)) for arg in container["args"]]


def start_operator(plane: ControlPlane, binary: Path, certs: dict[str, KeyPair], init_image: str) -> None:
    """The operator as k8s/operator installs it, but for the image of the init container it adds to Worker pods
    (its default, alpine from a registry, cannot be pulled here)."""
    client = plane.api_client()
    ensure_namespace(client, OPERATOR_NAMESPACE)
    # The rotator fills the Secret itself, but only an existing one.
    kubernetes.client.CoreV1Api(client).create_namespaced_secret(
        OPERATOR_NAMESPACE, {"metadata": {"name": OPERATOR_WEBHOOK_SECRET}}
    )
    SHARED_CERT_DIR.mkdir(parents=True, exist_ok=True)
    if not (SHARED_CERT_DIR / "tls.crt").exists():
        (SHARED_CERT_DIR / "tls.crt").write_bytes(certs["webhook"].cert.read_bytes())
    operator_tmp = webhook_tmpdir(plane, "training-operator", certs)
    probe = f"{LOOPBACK}:{free_port()}"
    log = plane.work_dir / "training-operator.log"
    command = [
        str(binary),
        "--enable-scheme=pytorchjob",
        "--metrics-bind-address=0",  # off
        f"--health-probe-bind-address={probe}",
        f"--webhook-server-port={free_port()}",
        "--leader-elect=false",
        f"--pytorch-init-container-image={init_image}",
        *operator_flags(),
    ]
    env = os.environ | {"KUBECONFIG": str(plane.kubeconfig), "MY_POD_NAMESPACE": OPERATOR_NAMESPACE}
    plane.processes["training-operator"] = process = start_process(command, log, env | {"TMPDIR": str(operator_tmp)})
    wait_until(readyz(probe), "training operator", STARTUP_TIMEOUT_S, process, log)


def readyz(address: str) -> Callable[[], bool]:
    """A controller-runtime manager's readiness (its health probe's /readyz): certificates ready and the webhook
    server listening, i.e. controllers set up."""

    def ready() -> bool:
        with urllib.request.urlopen(f"http://{address}/readyz", timeout=2) as response:
            return response.status == 200

    return ready


def write_serving_pair(directory: Path, pair: KeyPair) -> None:
    """tls.crt and tls.key, each replaced whole (a certificate watcher never reads half a file)."""
    directory.mkdir(parents=True, exist_ok=True)
    for source, name in ((pair.cert, "tls.crt"), (pair.key, "tls.key")):
        partial = directory / f".{name}.{os.getpid()}"
        partial.write_bytes(source.read_bytes())
        partial.chmod(0o600)
        partial.replace(directory / name)


def webhook_tmpdir(plane: ControlPlane, name: str, certs: dict[str, KeyPair]) -> Path:
    """A TMPDIR for a controller-runtime manager: its webhook server reads its pair from
    $TMPDIR/k8s-webhook-server/serving-certs (controller-runtime's default)."""
    tmp = plane.work_dir / f"{name}-tmp"
    write_serving_pair(tmp / WEBHOOK_CERT_DIR, certs["webhook"])
    return tmp


def json_patch(obj: Any, operations: list[dict[str, Any]]) -> None:
    """RFC 6902's add and replace, the operations kustomize patches of the two modules use."""
    for operation in operations:
        *parents, key = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
        parent = obj
        for part in parents:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        if operation["op"] not in ("add", "replace"):
            raise ValueError(f"json patch operation {operation['op']!r} is not supported")
        if isinstance(parent, list) and operation["op"] == "add":
            parent.insert(len(parent) if key == "-" else int(key), operation["value"])
        elif isinstance(parent, list):
            parent[int(key)] = operation["value"]
        else:
            parent[key] = operation["value"]


def shipped_webhooks(directory: Path, name_prefix: str, port: int, ca: Path) -> list[dict[str, Any]]:
    """The webhook configurations of a kustomization directory (its resources with its JSON patches applied),
    their clients pointed at https://127.0.0.1:port with `ca` as the bundle."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    configurations = [
        obj
        for resource in kustomization["resources"]
        for obj in yaml.safe_load_all((directory / resource).read_text())
        if obj and obj["kind"].endswith("WebhookConfiguration")
    ]
    for patch in kustomization.get("patches") or []:
        if "path" in patch:  # a JSON patch file and its target (Trainer's, JobSet's)
            target = patch["target"]
            for obj in configurations:
                name = obj["metadata"]["name"]
                if obj["kind"] == target["kind"] and target.get("name", name) == name:
                    json_patch(obj, yaml.safe_load((directory / patch["path"]).read_text()))
            continue
        # An inline strategic merge patch of webhooks (Kueue's namespaceSelectors): merged by the webhook's name.
        merge = yaml.safe_load(patch["patch"])
        for obj in configurations:
            if (obj["kind"], obj["metadata"]["name"]) == (merge["kind"], merge["metadata"]["name"]):
                by_name = {webhook["name"]: webhook for webhook in obj["webhooks"]}
                for webhook in merge["webhooks"]:
                    by_name[webhook["name"]].update(webhook)
    bundle = base64.b64encode(ca.read_bytes()).decode()
    for obj in configurations:
        obj["metadata"]["name"] = name_prefix + obj["metadata"]["name"]
        for webhook in obj["webhooks"]:
            path = webhook["clientConfig"]["service"]["path"]
            webhook["clientConfig"] = {"url": f"https://{LOOPBACK}:{port}{path}", "caBundle": bundle}
    return configurations


def start_manager(
    plane: ControlPlane, name: str, command: list[str], config: dict[str, Any], certs: dict[str, KeyPair]
) -> Callable[[], None]:
    """Starts a controller-runtime manager with `config` (its --config file) given a health probe address and a
    webhook port on loopback; returns the wait for its readiness, so that several start at once."""
    probe, webhook_port = f"{LOOPBACK}:{free_port()}", free_port()
    config = config | {
        "health": {"healthProbeBindAddress": probe},
        "webhook": config.get("webhook", {}) | {"host": LOOPBACK, "port": webhook_port},
        "metrics": {"bindAddress": "0"},  # off
    }
    config_file = plane.work_dir / f"{name}.yaml"
    config_file.write_text(yaml.safe_dump(config))
    log = plane.work_dir / f"{name}.log"
    env = os.environ | {"KUBECONFIG": str(plane.kubeconfig), "TMPDIR": str(webhook_tmpdir(plane, name, certs))}
    plane.processes[name] = process = start_process([*command, f"--config={config_file}"], log, env)
    plane.webhook_ports[name] = webhook_port
    return lambda: wait_until(readyz(probe), name, STARTUP_TIMEOUT_S, process, log)


def start_jobset(plane: ControlPlane, binary: Path, certs: dict[str, KeyPair]) -> Callable[[], None]:
    config = {
        "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
    }
    return start_manager(plane, "jobset", [str(binary), "--zap-log-level=info"], config, certs)


def start_kueue(plane: ControlPlane, source: Path, binary: Path, certs: dict[str, KeyPair]) -> Callable[[], None]:
    """Kueue's controller manager with its release's Configuration (its integrations: PyTorchJobs, TrainJobs,
    JobSets, batch Jobs, ...; each admitted only with its queue label, since manageJobsWithoutQueueName is off), but
    what this plane sets: no leader election, its own serving pair, and no on-demand visibility API server (it
    would need the API server's aggregation layer, and binds a fixed port). It finds that pair at
    KUEUE_METRICS_CERT_DIR in a private mount namespace, where a read-only overlay adds the folder to /etc (this
    machine's /etc is left as it is)."""
    ensure_namespace(plane.api_client(), KUEUE_NAMESPACE)
    etc = plane.work_dir / "kueue-etc"
    write_serving_pair(etc / KUEUE_METRICS_CERT_DIR.relative_to("/etc"), certs["webhook"])
    overlay = 'mount -t overlay overlay -o lowerdir="$0":/etc /etc && exec "$@"'
    command = ["unshare", "--mount", "--propagation=private", "sh", "-c", overlay, str(etc), str(binary)]
    config = yaml.safe_load((source / KUEUE_CONFIG).read_text()) | {
        "namespace": KUEUE_NAMESPACE,
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        # Its default is /tmp's folder, not $TMPDIR's: shared by every plane on the machine.
        "webhook": {"certDir": str(webhook_tmpdir(plane, "kueue", certs) / WEBHOOK_CERT_DIR)},
        "featureGates": {"VisibilityOnDemand": False},
    }
    return start_manager(plane, "kueue", [*command, "--zap-log-level=info"], config, certs)


def start_trainer(plane: ControlPlane, binary: Path, certs: dict[str, KeyPair]) -> Callable[[], None]:
    """Trainer v2's controller manager, its TrainJobStatus feature on: it gives each TrainJob's pods the status
    server's URL (its Service's name, created here as a release does, whose endpoint is this machine's end of the
    node's link, where the status server listens), its CA (the Secret's ca.crt) and a token. The status server
    reads its pair and, to find the token issuer, the pod's own service account token at fixed paths, which it
    gets in a private mount namespace (SERVICE_ACCOUNT_DIR, SHARED_CERT_DIR)."""
    client = plane.api_client()
    ensure_namespace(client, TRAINER_NAMESPACE)
    core = kubernetes.client.CoreV1Api(client)
    data = {"ca.crt": certs["ca"].cert, "tls.crt": certs["webhook"].cert, "tls.key": certs["webhook"].key}
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": TRAINER_WEBHOOK_SECRET, "namespace": TRAINER_NAMESPACE},
        "type": "kubernetes.io/tls",
        "data": {key: base64.b64encode(path.read_bytes()).decode() for key, path in data.items()},
    }
    status_port = free_port()  # it listens on every interface: a port of its own for each plane
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": TRAINER_SERVICE, "namespace": TRAINER_NAMESPACE},
        "spec": {"ports": [{"name": "status", "port": status_port, "targetPort": status_port}]},
    }
    # A Service without a selector: its endpoint is given, as for a server outside the cluster.
    endpoints = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": TRAINER_SERVICE,
            "namespace": TRAINER_NAMESPACE,
            "labels": {"kubernetes.io/service-name": TRAINER_SERVICE},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [node.HOST_ADDRESS], "conditions": {"ready": True}}],
        "ports": [{"name": "status", "port": status_port, "protocol": "TCP"}],
    }
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": TRAINER_SERVICE, "namespace": TRAINER_NAMESPACE},
    }
    for obj in (secret, service, endpoints, account):
        server_side_apply(client, obj)
    config = {
        "apiVersion": "config.trainer.kubeflow.org/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "certManagement": {"enable": False},
        "statusServer": {"port": status_port},
        "featureGates": {"TrainJobStatus": True},
    }
    token = core.create_namespaced_service_account_token(
        TRAINER_SERVICE, TRAINER_NAMESPACE, {"spec": {"expirationSeconds": 86400}}
    ).status.token
    account_dir = plane.work_dir / "trainer-service-account"
    account_dir.mkdir()
    (account_dir / "token").write_text(token)
    (account_dir / "namespace").write_text(TRAINER_NAMESPACE)
    serving = webhook_tmpdir(plane, "trainer-controller-manager", certs) / WEBHOOK_CERT_DIR
    mounts = (
        f"mount -t tmpfs tmpfs {SERVICE_ACCOUNT_DIR.parents[2]} && mkdir -p {SERVICE_ACCOUNT_DIR}"
        f' && cp "$0"/* {SERVICE_ACCOUNT_DIR} && mkdir -p {SHARED_CERT_DIR}'
        f' && mount --bind "$1" {SHARED_CERT_DIR} && shift && exec "$@"'
    )
    command = ["unshare", "--mount", "--propagation=private", "sh", "-c", mounts, str(account_dir), str(serving),
               str(binary)]  # fmt: skip
    return start_manager(plane, "trainer-controller-manager", command, config, certs)


def install_webhooks(plane: ControlPlane, binaries: Binaries, certs: dict[str, KeyPair]) -> None:
    client = plane.api_client()
    for source, directory, prefix, manager in (
        (binaries.trainer_source, TRAINER_WEBHOOKS, "", "trainer-controller-manager"),
        (binaries.jobset_source, KUBEBUILDER_WEBHOOKS, JOBSET_NAME_PREFIX, "jobset"),
        (binaries.kueue_source, KUBEBUILDER_WEBHOOKS, KUEUE_NAME_PREFIX, "kueue"),
    ):
        for obj in shipped_webhooks(source / directory, prefix, plane.webhook_ports[manager], certs["ca"].cert):
            server_side_apply(client, obj)


def start_scheduler(plane: ControlPlane, binary: Path) -> None:
    port = free_port()
    kubeconfig = plane.kubeconfig_of("kube-scheduler")
    command = [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--leader-elect=false",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={port}",
        "--v=1",
    ]
    log = plane.work_dir / "kube-scheduler.log"
    plane.processes["kube-scheduler"] = process = start_process(command, log)
    context = ssl._create_unverified_context()  # its self-signed serving certificate; only /healthz is read

    def healthy() -> bool:
        with urllib.request.urlopen(f"https://{LOOPBACK}:{port}/healthz", timeout=2, context=context) as response:
            return response.status == 200

    wait_until(healthy, "kube-scheduler", STARTUP_TIMEOUT_S, process, log)


def start_node(
    plane: ControlPlane, binaries: Binaries, certs: dict[str, KeyPair], images: list[node.NodeImage]
) -> None:
    assert plane.node is not None
    node.start(
        plane.node,
        binaries,
        CONTAINERD_ROOT / binaries.containerd.name,
        plane.api_client(),
        node.KubeletFiles(
            kubeconfig=plane.kubeconfig_of("kubelet-client"),
            serving_cert=certs["kubelet"].cert,
            serving_key=certs["kubelet"].key,
            client_ca=certs["ca"].cert,
        ),
        kube_proxy_kubeconfig=plane.kubeconfig_of("kube-proxy"),
        coredns_kubeconfig=plane.kubeconfig_of("coredns"),
        images=images,
    )


def node_images(directory: Path) -> list[node.NodeImage]:
    """What the node's pods run: the training image (`make image`) and the operator's init container image."""
    sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/, as pytest has it, for `up`
    from image import ensure_image

    training = ensure_image()
    busybox = busybox_image(node.BUSYBOX, directory)
    return [node.NodeImage(training.archive, training.reference), node.NodeImage(busybox.archive, busybox.reference)]


def start(work_dir: Path | None = None, binaries: Binaries | None = None, with_operator: bool = True) -> ControlPlane:
    """Build (first time) and start everything; stopped again at exit, on SIGTERM, or by `stop()`.
    Without `with_operator`: etcd, the API server and the controller-manager only (no job CRDs, operators, node or
    pods)."""
    binaries = binaries or ensure_binaries()
    work_dir = work_dir or Path(tempfile.mkdtemp(prefix="ddpjob-e2e-"))
    plane = ControlPlane(work_dir=work_dir, kubeconfig=work_dir / "kubeconfig")
    atexit.register(plane.stop)
    stop_on_sigterm(plane)
    try:
        if with_operator:
            if os.geteuid() != 0:
                raise RuntimeError("the control-plane tier runs a real node (kubelet, containerd, namespaces): root")
            images = node_images(work_dir / "images")
            # The node's namespaces and link first: the API server listens on this machine's end of the link.
            plane.node = node.make_namespaces(work_dir / "node", binaries.pause)
            plane.address = node.HOST_ADDRESS
        certs = pki(plane.pki_dir)
        start_apiserver(plane, binaries.kube_apiserver, start_etcd(plane, binaries.etcd), certs)
        if with_operator:
            install_crds(plane, [binaries.pytorchjob_crd, *job_set_and_trainer_crds(binaries), *kueue_crds(binaries)])
        # After the CRDs: the garbage collector knows the jobs' kinds from its first discovery (else after its
        # resync).
        start_controller_manager(plane, binaries.kube_controller_manager, certs)
        if with_operator:
            start_scheduler(plane, binaries.kube_scheduler)
            # Both managers start while the v1 operator does; their webhooks are registered once they serve them.
            ready = [
                start_jobset(plane, binaries.jobset_controller, certs),
                start_trainer(plane, binaries.trainer_controller_manager, certs),
                start_kueue(plane, binaries.kueue_source, binaries.kueue, certs),
            ]
            start_operator(plane, binaries.training_operator, certs, init_image=images[1].reference)
            for wait in ready:
                wait()
            install_webhooks(plane, binaries, certs)
            start_node(plane, binaries, certs, images)
    except BaseException:
        plane.stop()
        raise
    return plane


def stop_on_sigterm(plane: ControlPlane) -> None:
    """SIGTERM stops the control plane, then exits as the signal would have. (SIGINT raises KeyboardInterrupt,
    which runs the fixture's finalizer or, for `up`, the atexit hook.) A handler already there is kept: the test
    run's (tests/conftest.py) turns SIGTERM into KeyboardInterrupt, which stops the run and runs the finalizer, where
    SystemExit would fail one test and the run go on."""

    def handler(signum: int, _frame: Any) -> None:
        plane.stop()
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, handler)


def main(argv: list[str]) -> int:
    if argv != ["up"]:
        print("usage: .venv/bin/python tests/e2e/controlplane.py up", file=sys.stderr)
        return 2
    plane = start()
    print(f"export KUBECONFIG={plane.kubeconfig}", flush=True)
    print(f"# logs and volumes: {plane.work_dir}; Ctrl-C stops everything", file=sys.stderr, flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        plane.stop()
        print(f"# stopped; logs, volumes and keys stay in {plane.work_dir}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

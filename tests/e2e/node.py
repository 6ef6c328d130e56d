"""A real Kubernetes node for the control-plane tier: kubelet, containerd with runc, the CNI bridge, kube-proxy and
CoreDNS (all at the tier's versions, tests/e2e/cluster_binaries.py), with the pods in containers of the project's
image.

The node is a host of its own on this machine: its processes run in a network and a mount namespace made for it
(`unshare`), joined to this machine by a veth link (HOST_ADDRESS here, NODE_LINK_ADDRESS there), so that what a
node changes machine-wide stays in those namespaces and goes with them: iptables chains (kubelet, kube-proxy),
`net.ipv4.ip_forward`, the bridge and the pods' network namespaces, and every mount (containerd's snapshots, the
kubelet's volumes; the namespace's `/` is rshared, as on a real node, so mount propagation works). /run, /var/lib
and /var/log are tmpfs in it: the kubelet's and containerd's fixed paths there (the device-plugin socket,
/var/log/containers, runc's state, CNI's cache) never touch this machine's. What does stay machine-wide are the
cgroups under CGROUP_ROOT and the host end of the link with its route: `Node.stop` ends every process in the
node's namespaces (shims and containers included) and removes both, and `leftovers()` checks that nothing is left.

Pods get addresses from POD_CIDR on the bridge, whose address (NODE_IP) is the Node's InternalIP (the kubelet
refuses a loopback one); this machine routes POD_CIDR over the link, so the API server (pods/log, exec) and
Prometheus reach pods by their IPs. Pods have no default route: besides each other they reach only the service
CIDR and this machine's end of the link (the Trainer v2 status server), never an address outside the machine.

Images come from no registry: the pause and busybox images are written here (tests/e2e/oci.py), the training
image by `make image` (tests/image.py); each OCI archive is imported into containerd once (its root is cached by
containerd's version, so a 6 GB image is imported once per content, not per run).

Storage: a default StorageClass whose provisioner is `Node.provision` (a thread here, as a CSI driver's external
provisioner would be): each claim of the class gets a local PersistentVolume on this node, a directory under
`<work dir>/volumes/<namespace>/<claim>` bound to it (ReadWriteMany as far as one node goes); the kubelet applies
the pods' fsGroup to it. A released volume is deleted with its directory.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from cluster_binaries import Binaries
from local_processes import die_with_parent, start_process, terminate_group, wait_until
from oci import pause_image

NODE_NAME = "ddpjob-e2e-node"
# The link between this machine and the node's network namespace; the API server listens on HOST_ADDRESS.
HOST_LINK, NODE_LINK = "ddpjob-e2e-host", "ddpjob-e2e-node"
HOST_ADDRESS, NODE_LINK_ADDRESS, LINK_PREFIX = "10.87.0.1", "10.87.0.2", 30
BRIDGE = "ddpjob-e2e0"
CNI_NETWORK = "ddpjob-e2e"
NODE_IP = "10.88.0.1"
POD_CIDR = "10.88.0.0/16"
SERVICE_CIDR = "10.96.0.0/16"
CLUSTER_DOMAIN = "cluster.local"
KUBELET_PORT = 10250
KUBE_PROXY_HEALTH_PORT = 10256
# The kubelet's cgroups (cgroupfs driver) under every v1 hierarchy: pre-made, as the kubelet expects.
CGROUP_ROOT = "ddpjob-e2e-node"
CGROUPS = Path("/sys/fs/cgroup")
STORAGE_CLASS = "ddpjob-e2e-local"
PROVISIONER = "ddpjob.e2e/local-directory"
RUNC = Path("/usr/sbin/runc")
CNI_PLUGINS = Path("/usr/lib/cni")
BUSYBOX = Path("/bin/busybox")
STARTUP_TIMEOUT_S = 120
# The holder process of the namespaces: it makes the node's mount namespace a host of its own, then waits.
HOLDER_SCRIPT = (
    "mount --make-rshared / && mount -t tmpfs -o mode=755 node-run /run"
    " && mount -t tmpfs node-lib /var/lib && mount -t tmpfs node-log /var/log"
    ' && ip link set lo up && touch "$1" && exec "$0"'
)


class NodeError(RuntimeError):
    """A command in the node failed, or the node could not start: the message says which, and why."""


@dataclass
class Node:
    directory: Path
    holder: subprocess.Popen
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    stopping: threading.Event = field(default_factory=threading.Event)
    provisioner: threading.Thread | None = None
    images: dict[str, str] = field(default_factory=dict)  # what `start` imported: manifest digest by reference

    def in_node(self, command: list[str]) -> list[str]:
        """`command` run in the node's network and mount namespaces."""
        return ["nsenter", f"--target={self.holder.pid}", "--net", "--mount", "--", *command]

    def run(self, command: list[str], timeout_s: float = 120) -> str:
        result = subprocess.run(self.in_node(command), capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise NodeError(f"{' '.join(command)}: {result.stderr.strip() or result.stdout.strip()}")
        return result.stdout

    @property
    def containerd_socket(self) -> Path:
        return self.directory / "containerd.sock"

    def ctr(self, ctr: Path, *args: str, timeout_s: float = 900) -> str:
        return self.run([str(ctr), f"--address={self.containerd_socket}", "--namespace=k8s.io", *args], timeout_s)

    def held_images(self, ctr: Path) -> list[tuple[str, str]]:
        """containerd's images: (name, manifest digest) each; the CRI plugin names each image by its ID too."""
        return [
            (name, digest) for name, _, digest, *_ in map(str.split, self.ctr(ctr, "images", "ls").splitlines()[1:])
        ]

    def allocated_addresses(self) -> set[str]:
        """The pod addresses CNI's host-local IPAM has handed out and not yet released (a file per address)."""
        allocations = self.directory / "cni-ipam" / CNI_NETWORK
        names = os.listdir(allocations) if allocations.exists() else []
        return {name for name in names if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", name)}

    def volume_dir(self, namespace: str, claim: str) -> Path:
        return self.directory.parent / "volumes" / namespace / claim

    def stop(self) -> None:
        # Once: a second call (an atexit hook after the fixture's) must not take the machine state of a node that
        # started since, which has the same link name.
        if self.stopping.is_set():
            return
        self.stopping.set()
        for name in reversed(list(self.processes)):
            terminate_group(self.processes.pop(name))
        # Shims and containers were started by containerd but are not its children by the time it ends: every
        # process in the node's namespaces goes, then the namespaces with the holder.
        kill_namespace_members(self.holder.pid)
        terminate_group(self.holder)
        remove_machine_state()
        if self.provisioner is not None:
            self.provisioner.join(timeout=5)


def namespace_of(pid: int | str, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:  # gone, or a kernel thread
        return None


def kill_namespace_members(holder: int) -> None:
    """SIGKILL to every process in the holder's mount namespace but the holder, until none is left."""
    namespace = namespace_of(holder, "mnt")
    if namespace is None:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        members = [
            int(pid)
            for pid in os.listdir("/proc")
            if pid.isdigit() and int(pid) != holder and namespace_of(pid, "mnt") == namespace
        ]
        if not members:
            return
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def cgroup_dirs() -> list[Path]:
    """CGROUP_ROOT in every hierarchy of this machine: the kubelet's cgroupfs driver uses every v1 one, and makes its
    cgroups in the v2 one of this hybrid layout (`unified`, no controllers) too (`kubepods/...` is seen there)."""
    return [
        hierarchy / CGROUP_ROOT
        for hierarchy in sorted(CGROUPS.iterdir())
        if hierarchy.is_dir() and not hierarchy.is_symlink()
    ]


def cgroup_processes() -> list[int]:
    pids: set[int] = set()
    for directory in cgroup_dirs():
        for procs in directory.rglob("cgroup.procs") if directory.exists() else []:
            with contextlib.suppress(OSError):
                pids |= {int(pid) for pid in procs.read_text().split()}
    return sorted(pids)


def remove_machine_state() -> None:
    """What the node leaves outside its namespaces: processes still in its cgroups (none once the namespaces are
    empty, unless a previous run was killed outright), the cgroups, and the host end of the link (gone with the
    node's network namespace, unless that outlived a killed run)."""
    for pid in cgroup_processes():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for directory in cgroup_dirs():
        if directory.exists():
            # Children first; a cgroup whose last process just died may need a moment to be removable.
            for child in [*sorted(directory.rglob("*"), key=lambda p: len(p.parts), reverse=True), directory]:
                if child.is_dir():
                    for _ in range(50):
                        try:
                            child.rmdir()
                            break
                        except OSError:
                            time.sleep(0.1)
    subprocess.run(["ip", "link", "delete", HOST_LINK], capture_output=True)


def machine_state() -> dict[str, str]:
    """What a node would change machine-wide if it were not in namespaces of its own: IP forwarding and the
    iptables chains (the kubelet's and kube-proxy's KUBE-* ones)."""
    chains = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    return {
        "net.ipv4.ip_forward": Path("/proc/sys/net/ipv4/ip_forward").read_text().strip(),
        "iptables chains": " ".join(sorted(set(re.findall(r"^:(\S+)", chains, re.MULTILINE)))),
    }


def leftovers(before: dict[str, str] | None = None) -> list[str]:
    """What of a node is still on this machine: empty once `Node.stop` is done; with `before` (machine_state() at
    the start), what differs from it too."""
    found = [str(d) for d in cgroup_dirs() if d.exists()]
    if subprocess.run(["ip", "link", "show", HOST_LINK], capture_output=True).returncode == 0:
        found.append(f"link {HOST_LINK}")
    routes = subprocess.run(["ip", "route", "show", POD_CIDR], capture_output=True, text=True).stdout.strip()
    if routes:
        found.append(f"route {routes}")
    mounts = Path("/proc/self/mountinfo").read_text()
    found += [f"mount {line.split()[4]}" for line in mounts.splitlines() if "ddpjob-e2e" in line.split()[4]]
    found += [f"process {pid}" for pid in cgroup_processes()]
    if before is not None:
        now = machine_state()
        found += [f"{key}: {before[key]!r} then, {now[key]!r} now" for key in before if now[key] != before[key]]
    return found


def start_in_node(node: Node, name: str, command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    node.processes[name] = process = start_process(node.in_node(command), node.directory / f"{name}.log", env)
    return process


def wait_for(node: Node, name: str, check: Callable[[], bool], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    wait_until(check, name, timeout_s, node.processes[name], node.directory / f"{name}.log")


def make_namespaces(directory: Path, pause: Path) -> Node:
    """The holder of the node's namespaces, its mounts made, and the link to this machine."""
    directory.mkdir(parents=True)
    if leftovers():
        remove_machine_state()
    ready = directory / "namespaces.ready"
    holder = subprocess.Popen(
        ["unshare", "--net", "--mount", "--propagation=private", "--fork", "--kill-child",
         "sh", "-c", HOLDER_SCRIPT, str(pause), str(ready)],
        stdin=subprocess.DEVNULL,
        stdout=(directory / "namespaces.log").open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # SIGKILL: unshare ignores SIGTERM while it waits for its child (which --kill-child ends with it).
        preexec_fn=lambda: die_with_parent(signal.SIGKILL),
    )  # fmt: skip
    node = Node(directory, holder)
    deadline = time.monotonic() + 30
    while not ready.exists():
        if holder.poll() is not None or time.monotonic() > deadline:
            raise NodeError(f"the node's namespaces: {(directory / 'namespaces.log').read_text().strip()}")
        time.sleep(0.05)
    # unshare itself entered the namespaces before it forked the script: it is the one to join.
    host = subprocess.run
    host(["ip", "link", "add", HOST_LINK, "type", "veth", "peer", "name", NODE_LINK, "netns", str(holder.pid)],
         check=True, capture_output=True)  # fmt: skip
    host(["ip", "addr", "add", f"{HOST_ADDRESS}/{LINK_PREFIX}", "dev", HOST_LINK], check=True, capture_output=True)
    host(["ip", "link", "set", HOST_LINK, "up"], check=True, capture_output=True)
    host(["ip", "route", "add", POD_CIDR, "via", NODE_LINK_ADDRESS], check=True, capture_output=True)
    for command in (
        ["ip", "addr", "add", f"{NODE_LINK_ADDRESS}/{LINK_PREFIX}", "dev", NODE_LINK],
        ["ip", "link", "set", NODE_LINK, "up"],
        # The bridge exists before the kubelet starts, its address the node IP; the CNI bridge plugin reuses it.
        ["ip", "link", "add", BRIDGE, "type", "bridge"],
        ["ip", "addr", "add", f"{NODE_IP}/{ipaddress.ip_network(POD_CIDR).prefixlen}", "dev", BRIDGE],
        ["ip", "link", "set", BRIDGE, "up"],
        ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"],
    ):
        node.run(command)
    return node


def containerd_config(node: Node, root: Path, sandbox_image: str) -> Path:
    runtime = "plugins.'io.containerd.cri.v1.runtime'"
    config = f"""version = 3
root = "{root}"
state = "{node.directory / "containerd"}"
# NRI would listen on a fixed path; the node needs no plugins.
disabled_plugins = ["io.containerd.nri.v1.nri"]

[grpc]
  address = "{node.containerd_socket}"

[ttrpc]
  address = "{node.containerd_socket}.ttrpc"

[{runtime}]
  # No CAP_SYS_RESOURCE here: a negative oom_score_adj (the kubelet's for guaranteed pods) cannot be set, so it
  # is raised to containerd's own instead of failing every sandbox.
  restrict_oom_score_adj = true

[{runtime}.containerd]
  default_runtime_name = "runc"

[{runtime}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{runtime}.containerd.runtimes.runc.options]
  BinaryName = "{RUNC}"
  SystemdCgroup = false

[{runtime}.cni]
  bin_dirs = ["{CNI_PLUGINS}"]
  conf_dir = "{node.directory / "cni"}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{sandbox_image}"
"""
    path = node.directory / "containerd.toml"
    path.write_text(config)
    return path


def cni_config(node: Node) -> None:
    """The bridge plugin on BRIDGE with addresses from POD_CIDR; routes to the service CIDR and to this machine's
    end of the link only: no default route, so pods reach nothing outside the machine."""
    link = str(ipaddress.ip_interface(f"{HOST_ADDRESS}/{LINK_PREFIX}").network)
    config = {
        "cniVersion": "1.0.0",
        "name": CNI_NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_IP}]],
                    "routes": [{"dst": SERVICE_CIDR}, {"dst": link}],
                    "dataDir": str(node.directory / "cni-ipam"),
                },
            }
        ],
    }
    (node.directory / "cni").mkdir()
    (node.directory / "cni" / "10-ddpjob-e2e.conflist").write_text(json.dumps(config, indent=2))


def start_containerd(node: Node, containerd: Path, shim: Path, root: Path, sandbox_image: str) -> None:
    # containerd finds its shim by name on PATH; runc and the CNI plugins by configured paths.
    bin_dir = node.directory / "bin"
    bin_dir.mkdir()
    (bin_dir / "containerd-shim-runc-v2").symlink_to(shim)
    root.mkdir(parents=True, exist_ok=True)
    cni_config(node)
    config = containerd_config(node, root, sandbox_image)
    env = os.environ | {"PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    start_in_node(node, "containerd", [str(containerd), f"--config={config}", "--log-level=warn"], env)
    wait_for(node, "containerd", node.containerd_socket.exists)


def archive_manifest_digest(archive: Path) -> str:
    """The digest of the one image manifest an OCI archive's index.json names."""
    import tarfile

    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        assert member is not None
        (manifest,) = json.load(member)["manifests"]
    return manifest["digest"]


def remove_containers(node: Node, ctr: Path) -> None:
    """The containers an earlier node left in containerd's store (its pods' when it stopped; every one of a run that
    was killed), which no kubelet will remove: each keeps its snapshot and, under it, the layers of the image it ran,
    one replaced since included (~540 MB for each replaced content)."""
    if containers := node.ctr(ctr, "containers", "ls", "-q").split():
        try:
            node.ctr(ctr, "containers", "rm", *containers)
        except NodeError as error:  # ctr removes the others; what stays is said, and the node starts all the same
            print(f"node: an earlier node's container stays in containerd: {error}", file=sys.stderr, flush=True)


def remove_other_images(node: Node, ctr: Path) -> None:
    """Every image but those the node imported, with the layers only they use. The CRI plugin names an image by its
    ID (`sha256:...`) too, and that name stays when its reference moves to the next content: each change of the
    training image kept the previous one's changed layers (~540 MB)."""
    stale = [name for name, digest in node.held_images(ctr) if digest not in node.images.values()]
    if stale:
        node.ctr(ctr, "images", "rm", "--sync", *stale)


def fully_qualified(reference: str) -> str:
    """An image reference as containerd names it (and the kubelet asks for it): `ddpjob:0.1.0` is
    `docker.io/library/ddpjob:0.1.0`, `org/x:1` is `docker.io/org/x:1`; one with a registry host stays."""
    first, _, rest = reference.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return reference
    return f"docker.io/{reference}" if rest else f"docker.io/library/{reference}"


def import_image(node: Node, ctr: Path, archive: Path, reference: str) -> None:
    """The archive's image in containerd's k8s.io namespace as `reference`, unless it is there already."""
    reference = fully_qualified(reference)
    digest = node.images[reference] = archive_manifest_digest(archive)
    if (reference, digest) in node.held_images(ctr):
        return
    started = time.monotonic()
    # Through the node's mount namespace: the archive's path is this machine's (only /run, /var/lib and /var/log
    # differ there). Only the unpacked layers are kept (which ctr does only with --local, client-side): the
    # archive's blobs would double the image's ~6 GB.
    node.ctr(ctr, "images", "import", "--local", "--snapshotter=overlayfs", "--discard-unpacked-layers", str(archive))
    if (reference, digest) not in (held := node.held_images(ctr)):
        raise NodeError(f"{archive} imported, but not as {reference} {digest}: containerd has {held}")
    print(f"node: imported {reference} in {time.monotonic() - started:.0f} s", flush=True)


def make_cgroup_root() -> None:
    """CGROUP_ROOT in every v1 hierarchy; cpuset's needs the CPUs and memory nodes of its parent to hold tasks."""
    for directory in cgroup_dirs():
        directory.mkdir(exist_ok=True)
        if directory.parent.name == "cpuset" or (directory.parent / "cpuset.cpus").exists():
            for name in ("cpuset.cpus", "cpuset.mems"):
                (directory / name).write_text((directory.parent / name).read_text())


@dataclass(frozen=True)
class KubeletFiles:
    """What the kubelet is given: its kubeconfig (a client certificate of system:node:NODE_NAME), its serving pair
    (for the API server's pods/log and exec) and the CA that signs the clients it accepts (the API server's)."""

    kubeconfig: Path
    serving_cert: Path
    serving_key: Path
    client_ca: Path


def start_kubelet(node: Node, kubelet: Path, files: KubeletFiles) -> None:
    (node.directory / "resolv.conf").write_text("")  # pods get cluster DNS only: no search path of this machine's
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # This machine has cgroup v1 (hybrid): deprecated, still supported when asked for.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{CGROUP_ROOT}",
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{node.containerd_socket}",
        "address": NODE_IP,
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzPort": 0,
        "tlsCertFile": str(files.serving_cert),
        "tlsPrivateKeyFile": str(files.serving_key),
        # Only clients with a certificate of the plane's CA (the API server's kubelet client) may call it.
        "authentication": {
            "x509": {"clientCAFile": str(files.client_ca)},
            "webhook": {"enabled": False},
            "anonymous": {"enabled": False},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDomain": CLUSTER_DOMAIN,
        "clusterDNS": [NODE_IP],
        "resolvConf": str(node.directory / "resolv.conf"),
        "volumePluginDir": str(node.directory / "volume-plugins"),
        # The disk is shared with everything else on this machine: evict only when it is really full, and never
        # collect the training image (imported once, ~6 GB).
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
        "serializeImagePulls": False,
        "nodeStatusUpdateFrequency": "2s",
        "syncFrequency": "10s",
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
    }
    config_file = node.directory / "kubelet.yaml"
    config_file.write_text(yaml.safe_dump(config))
    command = [
        str(kubelet),
        f"--config={config_file}",
        f"--kubeconfig={files.kubeconfig}",
        f"--root-dir={node.directory / 'kubelet'}",
        f"--node-ip={NODE_IP}",
        f"--hostname-override={NODE_NAME}",
        "--v=1",
    ]
    make_cgroup_root()
    start_in_node(node, "kubelet", command)


def node_ready(client: kubernetes.client.ApiClient) -> Callable[[], bool]:
    core = kubernetes.client.CoreV1Api(client)

    def ready() -> bool:
        conditions = core.read_node(NODE_NAME).status.conditions or []
        return any(c.type == "Ready" and c.status == "True" for c in conditions)

    return ready


def start_kube_proxy(node: Node, kube_proxy: Path, kubeconfig: Path) -> None:
    """kube-proxy in iptables mode, in the node's network namespace: ClusterIP Services for pods."""
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": NODE_NAME,
        "clusterCIDR": POD_CIDR,
        "bindAddress": NODE_IP,
        # In the node's network namespace: its own ports.
        "healthzBindAddress": f"{NODE_IP}:{KUBE_PROXY_HEALTH_PORT}",
        "metricsBindAddress": f"{NODE_IP}:10249",
        # Leave the kernel's conntrack table and timeouts as they are (no CAP_SYS_RESOURCE here, and not ours).
        "conntrack": {"maxPerCore": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }
    config_file = node.directory / "kube-proxy.yaml"
    config_file.write_text(yaml.safe_dump(config))
    start_in_node(node, "kube-proxy", [str(kube_proxy), f"--config={config_file}", "--v=1"])
    # Healthy once it has synced its rules (a new Service may still take a second to reach them).
    wait_for(node, "kube-proxy", lambda: http_ok(node, f"http://{NODE_IP}:{KUBE_PROXY_HEALTH_PORT}/healthz"))


def start_coredns(node: Node, coredns: Path, kubeconfig: Path) -> None:
    """Cluster DNS on NODE_IP:53 (the kubelet's clusterDNS): Services, headless Services' pods and the
    `hostname.subdomain` names JobSet gives, from the API server. No upstream: pods resolve cluster names only."""
    ready = f"{NODE_IP}:8181"
    corefile = f"""{CLUSTER_DOMAIN}:53 in-addr.arpa:53 {{
    bind {NODE_IP}
    errors
    log . "{{type}} {{name}} {{rcode}}"
    ready {ready}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa {{
        kubeconfig {kubeconfig}
        pods verified
        ttl 1
    }}
}}
"""
    config_file = node.directory / "Corefile"
    config_file.write_text(corefile)
    start_in_node(node, "coredns", [str(coredns), "-conf", str(config_file)])

    # The ready plugin answers once the kubernetes plugin has synced with the API server.
    wait_for(node, "coredns", lambda: http_ok(node, f"http://{ready}/ready"))


def http_ok(node: Node, url: str) -> bool:
    """An HTTP GET from inside the node's network namespace answers 200."""
    probe = [sys.executable, "-c", f"import urllib.request; urllib.request.urlopen({url!r}, timeout=2)"]
    return subprocess.run(node.in_node(probe), capture_output=True, timeout=10).returncode == 0


COREDNS_USER = "system:coredns"
# What the kubernetes plugin reads (CoreDNS's own deployment manifests grant the same).
COREDNS_RULES = [
    {"apiGroups": [""], "resources": ["services", "pods", "namespaces"], "verbs": ["list", "watch"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
]


def cluster_objects(client: kubernetes.client.ApiClient) -> None:
    """CoreDNS's rights and the default StorageClass of the node's local volumes."""
    rbac = kubernetes.client.RbacAuthorizationV1Api(client)
    rbac.create_cluster_role({"metadata": {"name": COREDNS_USER}, "rules": COREDNS_RULES})
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": COREDNS_USER},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": COREDNS_USER},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": COREDNS_USER}],
        }
    )
    kubernetes.client.StorageV1Api(client).create_storage_class(
        {
            "metadata": {
                "name": STORAGE_CLASS,
                "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
            },
            "provisioner": PROVISIONER,
            "reclaimPolicy": "Delete",
            "volumeBindingMode": "Immediate",
        }
    )


def local_volume(claim: kubernetes.client.V1PersistentVolumeClaim, path: Path) -> dict[str, Any]:
    meta = claim.metadata
    return {
        "metadata": {"name": f"pvc-{meta.uid}", "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER}},
        "spec": {
            "capacity": {"storage": claim.spec.resources.requests["storage"]},
            "accessModes": claim.spec.access_modes,
            "persistentVolumeReclaimPolicy": "Delete",
            "storageClassName": STORAGE_CLASS,
            "volumeMode": "Filesystem",
            "claimRef": {"namespace": meta.namespace, "name": meta.name, "uid": meta.uid},
            "local": {"path": str(path)},
            "nodeAffinity": {
                "required": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": "In", "values": [NODE_NAME]}
                        ]}
                    ]
                }
            },
        },
    }  # fmt: skip


def provision_once(node: Node, core: kubernetes.client.CoreV1Api) -> None:
    """A volume for each pending claim of STORAGE_CLASS, and released volumes deleted with their directories."""
    volumes = {v.metadata.name: v for v in core.list_persistent_volume().items}
    for claim in core.list_persistent_volume_claim_for_all_namespaces().items:
        if claim.spec.storage_class_name != STORAGE_CLASS or claim.status.phase != "Pending":
            continue
        if f"pvc-{claim.metadata.uid}" in volumes:
            continue
        path = node.volume_dir(claim.metadata.namespace, claim.metadata.name)
        path.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(kubernetes.client.ApiException):  # made meanwhile
            core.create_persistent_volume(local_volume(claim, path))
    for volume in volumes.values():
        released = volume.status.phase in ("Released", "Failed")
        if released and (volume.metadata.annotations or {}).get("pv.kubernetes.io/provisioned-by") == PROVISIONER:
            shutil.rmtree(volume.spec.local.path, ignore_errors=True)
            with contextlib.suppress(kubernetes.client.ApiException):
                core.delete_persistent_volume(volume.metadata.name)


def provision(node: Node, client: kubernetes.client.ApiClient) -> None:
    core = kubernetes.client.CoreV1Api(client)
    while not node.stopping.wait(0.5):
        try:
            provision_once(node, core)
        except Exception as error:  # the API server going away at stop, or a transient error: tried again
            if not node.stopping.is_set():
                print(f"node: provisioner: {error}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class NodeImage:
    archive: Path
    reference: str


def start(
    node: Node,
    binaries: Binaries,
    containerd_root: Path,
    client: kubernetes.client.ApiClient,
    kubelet_files: KubeletFiles,
    kube_proxy_kubeconfig: Path,
    coredns_kubeconfig: Path,
    images: list[NodeImage],
) -> None:
    """The node (its namespaces made by `make_namespaces`) Ready, with cluster DNS answering, kube-proxy running
    and every image imported. The caller stops it with `Node.stop`, also when this fails."""
    pause = pause_image(binaries.pause, node.directory / "images")
    start_containerd(node, binaries.containerd, binaries.containerd_shim, containerd_root, pause.reference)
    remove_containers(node, binaries.ctr)
    for image in [NodeImage(pause.archive, pause.reference), *images]:
        import_image(node, binaries.ctr, image.archive, image.reference)
    remove_other_images(node, binaries.ctr)
    cluster_objects(client)
    node.provisioner = threading.Thread(target=provision, args=(node, client), daemon=True, name="provisioner")
    node.provisioner.start()
    start_kubelet(node, binaries.kubelet, kubelet_files)
    start_kube_proxy(node, binaries.kube_proxy, kube_proxy_kubeconfig)
    start_coredns(node, binaries.coredns, coredns_kubeconfig)
    wait_for(node, "kubelet", node_ready(client))

"""The control plane's binaries, built from their Go modules once and cached by version outside the repo.

- kube-apiserver, kube-controller-manager, kubectl and etcd: one generated wrapper module requiring
  `k8s.io/kubernetes` (its staging modules replaced by their published v0 releases, read from upstream's own go.mod)
  and the etcd server version that Kubernetes release itself depends on; a `main` package per binary.
- the Kubeflow training operator v1, the Kubeflow Trainer v2 controller manager and the JobSet controller (the
  version Trainer v2 requires): each a generated wrapper module requiring its module, building its main package.
- versitygw, the S3 server of the object-storage tests (tests/s3server.py; the unit tier's too), the same way.
- helm, the CLI the docs give beside `ctl` (the chart's `helm template`/`lint` test, the e2e tier's `helm install`).
- Kueue's controller manager, the batch queue a spec's `queue.kueue` hands its job to, the same way.

The first build takes minutes. On a shared 2-core machine under load: kube-apiserver 3 min 56 s,
kube-controller-manager 1 min 17 s, kubectl 46 s, etcd 32 s (partly in the Go build cache already), JobSet
4 min 43 s, Trainer v2 4 min 21 s, Kueue 2 min 49 s (idle machine), plus the module downloads. Each binary missing from
`~/.cache/ddpjob/bin/<name>-<version>` is built alone; when none is missing, calls return at once.
`python tests/e2e/cluster_binaries.py` builds everything (`make e2e-binaries`, a prerequisite of `make test` and
`make e2e`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

KUBERNETES_VERSION = "v1.36.3"
# The etcd server k8s.io/kubernetes v1.36.3 itself requires (its go.mod), so the pair is one upstream tested.
ETCD_VERSION = "v3.6.8"
TRAINING_OPERATOR_VERSION = "v1.9.0"
TRAINING_OPERATOR_MODULE = "github.com/kubeflow/training-operator"
PYTORCHJOB_CRD_IN_MODULE = "manifests/base/crds/kubeflow.org_pytorchjobs.yaml"
TRAINER_VERSION = "v2.3.0"
TRAINER_MODULE = "github.com/kubeflow/trainer/v2"
# The JobSet release Trainer v2.3.0 requires (its go.mod): the controller TrainJobs are built on.
JOBSET_VERSION = "v0.12.0"
JOBSET_MODULE = "sigs.k8s.io/jobset"
# The node's container runtime: containerd 2.x implements the CRI's RuntimeConfig, which kubelet 1.36 still only
# warns about and 1.37 is expected to require (Debian's 1.6 lacks it). Its shim and ctr (image import) come along.
CONTAINERD_VERSION = "v2.4.2"
CONTAINERD_MODULE = "github.com/containerd/containerd/v2"
# btrfs snapshots need cgo; the node uses overlayfs.
CONTAINERD_TAGS = "no_btrfs"
COREDNS_VERSION = "v1.15.0"
COREDNS_MODULE = "github.com/coredns/coredns"
# The S3 server the object-storage tests run against: an S3 gateway over a POSIX directory (Apache-2.0).
VERSITYGW_VERSION = "v1.8.0"
VERSITYGW_MODULE = "github.com/versity/versitygw"
# The Helm release whose engine helm-python-sdk embeds is v4 too: the binary users install beside ctl.
HELM_VERSION = "v4.3.2"
HELM_MODULE = "helm.sh/helm/v4"
# The batch queue of `queue.kueue`: a release whose TrainJob integration speaks Trainer v2.3's runtimePatches.
KUEUE_VERSION = "v0.17.0"
KUEUE_MODULE = "sigs.k8s.io/kueue"
CACHE = Path(os.environ.get("DDPJOB_CACHE", Path.home() / ".cache" / "ddpjob"))
# Two cores and ~24 GiB here: two compile jobs keep the machine usable and the link of kube-apiserver in memory.
BUILD_PARALLELISM = "2"
BUILD_TIMEOUT_S = 3 * 3600
# A cached binary that no run has asked for in this long is removed, as Go trims its build cache of entries unused
# for days: a version bump would otherwise leave every old build behind (the whole set is about 0.9 GB), while
# two checkouts of different versions on one machine still keep theirs.
UNUSED_FOR_S = 30 * 24 * 3600

STAGING_REPLACE = re.compile(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/src/k8s\.io/[\w.-]+\s*$", re.MULTILINE)

# main.go of a Kubernetes command: cmd/<command>/app's constructor run by component-base's cli. Package-level
# `ctx` is there for the constructors that take a context (the kubelet's); an unused package variable compiles.
KUBERNETES_MAIN = """package main

import (
\t"context"
\t"os"

\t"k8s.io/component-base/cli"
\t"k8s.io/kubernetes/cmd/{command}/app"
)

var ctx = context.Background()

func main() {{
\tos.Exit(cli.Run(app.{constructor}))
}}
"""

# The Kubernetes commands built from the wrapper module: the control plane's and the node's (kubelet, kube-proxy),
# each with the call of its app package's constructor.
KUBERNETES_COMMANDS = {
    "kube-apiserver": "NewAPIServerCommand()",
    "kube-controller-manager": "NewControllerManagerCommand()",
    "kube-scheduler": "NewSchedulerCommand()",
    "kubelet": "NewKubeletCommand(ctx)",
    "kube-proxy": "NewProxyCommand()",
}

# kubectl's own main: its root command, errors printed the way kubectl prints them.
KUBECTL_MAIN = """package main

import (
\t"k8s.io/component-base/cli"
\t"k8s.io/kubectl/pkg/cmd"
\t"k8s.io/kubectl/pkg/cmd/util"
)

func main() {
\tif err := cli.RunNoErrOutput(cmd.NewDefaultKubectlCommand()); err != nil {
\t\tutil.CheckErr(err)
\t}
}
"""

ETCD_MAIN = """package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
\tetcdmain.Main(os.Args)
}
"""


# Cluster DNS with only the plugins the node's Corefile uses: CoreDNS's own main registers all ~60 of them
# (cloud providers' SDKs included), which would take several times as long to build.
COREDNS_PLUGINS = ("bind", "errors", "log", "health", "ready", "cache", "kubernetes")
COREDNS_MAIN = """package main

import (
\t"github.com/coredns/coredns/coremain"
{imports}
)

func main() {{
\tcoremain.Run()
}}
"""

# The pod sandbox's process: it holds the pod's namespaces, reaps orphans and exits on SIGTERM/SIGINT, as
# Kubernetes' pause does (no registry here to pull registry.k8s.io/pause from).
PAUSE_MAIN = """package main

import (
\t"os"
\t"os/signal"
\t"syscall"
)

func main() {
\tsignals := make(chan os.Signal, 1)
\tsignal.Notify(signals, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
\tfor sig := range signals {
\t\tif sig != syscall.SIGCHLD {
\t\t\tos.Exit(0)
\t\t}
\t\tfor {
\t\t\tif pid, _ := syscall.Wait4(-1, nil, syscall.WNOHANG, nil); pid <= 0 {
\t\t\t\tbreak
\t\t\t}
\t\t}
\t}
}
"""
PAUSE_VERSION = "1"


class BuildError(RuntimeError):
    """A binary could not be built; the message says which step failed and why."""


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kubectl: Path
    training_operator: Path
    pytorchjob_crd: Path
    trainer_controller_manager: Path
    jobset_controller: Path
    kube_scheduler: Path
    kubelet: Path
    kube_proxy: Path
    containerd: Path
    containerd_shim: Path
    ctr: Path
    coredns: Path
    pause: Path
    versitygw: Path
    helm: Path
    kueue: Path
    # The modules' source directories: their CRDs and webhook manifests, as their releases install them.
    trainer_source: Path
    jobset_source: Path
    kueue_source: Path


def go_toolchain() -> str:
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not Path(go).exists():
        raise BuildError("no Go toolchain (go on PATH or /usr/local/go/bin/go): needed to build the control plane")
    return go


def go_env() -> dict[str, str]:
    # GOWORK off: the wrapper modules stand alone; GOFLAGS replaced so a caller's -mod=vendor cannot leak in.
    return os.environ | {"GOWORK": "off", "GO111MODULE": "on", "GOFLAGS": "-mod=mod", "CGO_ENABLED": "0"}


def run_go(*args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    command = [go_toolchain(), *args]
    result = subprocess.run(
        command, cwd=cwd, env=env or go_env(), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
    )
    if result.returncode != 0:
        raise BuildError(f"`go {' '.join(args)}` failed in {cwd}:\n{result.stdout}{result.stderr}")
    return result.stdout


def download_module(module: str, version: str) -> Path:
    """The module's extracted source directory in the Go module cache."""
    return Path(json.loads(run_go("mod", "download", "-json", f"{module}@{version}", cwd=CACHE))["Dir"])


def cached(name: str, version: str) -> Path:
    return CACHE / "bin" / f"{name}-{version}"


def go_build(target: Path, package: str, flags: list[str], cwd: Path) -> Path:
    """`go build flags -o target package`, written beside the target first: a concurrent run never sees half a
    binary."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.tmp")
    run_go("build", *flags, "-o", str(staging), package, cwd=cwd)
    staging.replace(target)
    return target


def prune(used: Iterable[Path]) -> list[Path]:
    """Mark `used` as used now, and remove the cached binaries unused for UNUSED_FOR_S; returns those removed."""
    now = time.time()
    for path in used:
        os.utime(path, (now, now))
    stale = [
        path
        for path in (CACHE / "bin").iterdir()
        if not path.name.startswith(".") and path.stat().st_mtime < now - UNUSED_FOR_S  # not a build's staging
    ]
    for path in stale:
        path.unlink()
    return stale


def kubernetes_wrapper_module(version: str, etcd_version: str) -> Path:
    """The generated module that builds kube-apiserver, kube-controller-manager, kubectl and etcd."""
    upstream = (download_module("k8s.io/kubernetes", version) / "go.mod").read_text()
    staging = STAGING_REPLACE.findall(upstream)
    if not staging:
        raise BuildError(f"k8s.io/kubernetes@{version}/go.mod: no replace block for the staging modules")
    staging_version = "v0." + version.removeprefix("v1.")
    go_directive = re.search(r"^go (\S+)$", upstream, re.MULTILINE)
    if go_directive is None:
        raise BuildError(f"k8s.io/kubernetes@{version}/go.mod: no go directive")
    module = CACHE / "build" / f"control-plane-{version}"
    mains = {
        **{name: KUBERNETES_MAIN.format(command=name, constructor=call) for name, call in KUBERNETES_COMMANDS.items()},
        "kubectl": KUBECTL_MAIN,
        "etcd": ETCD_MAIN,
    }
    for name, main in mains.items():
        (module / "cmd" / name).mkdir(parents=True, exist_ok=True)
        (module / "cmd" / name / "main.go").write_text(main)
    replaces = "\n".join(f"\t{path} => {path} {staging_version}" for path in staging)
    (module / "go.mod").write_text(
        f"module ddpjob.local/control-plane\n\ngo {go_directive[1]}\n\n"
        f"require (\n\tk8s.io/kubernetes {version}\n\tgo.etcd.io/etcd/server/v3 {etcd_version}\n)\n\n"
        f"replace (\n{replaces}\n)\n"
    )
    return module


def version_ldflags(version: str) -> str:
    """The linker flags that stamp `version` into a Kubernetes command, as its release build does
    (hack/lib/version.sh): unstamped, the API server reports v0.0.0-master at /version, which Helm refuses against
    a chart's kubeVersion, and the node the same as its kubelet's version."""
    major, minor = version.removeprefix("v").split(".")[:2]
    fields = {"gitVersion": version, "gitMajor": major, "gitMinor": minor, "gitTreeState": "clean"}
    packages = ("k8s.io/client-go/pkg/version", "k8s.io/component-base/version")
    return " ".join(f"-X {package}.{key}={value}" for package in packages for key, value in fields.items())


def build_kubernetes(version: str = KUBERNETES_VERSION, etcd_version: str = ETCD_VERSION) -> dict[str, Path]:
    """etcd, kubectl and the Kubernetes commands by name, each built on the first call that lacks it. The
    Kubernetes ones are cached as `<name>-<version>-stamped`: those built before the stamp are built again."""
    stamped = f"{version}-stamped"
    targets = {
        "etcd": cached("etcd", etcd_version),
        "kubectl": cached("kubectl", stamped),
        **{name: cached(name, stamped) for name in KUBERNETES_COMMANDS},
    }
    missing = [name for name, target in targets.items() if not target.exists()]
    if missing:
        module = kubernetes_wrapper_module(version, etcd_version)
        run_go("mod", "tidy", cwd=module)
        for name in missing:
            ldflags = "-s -w" if name == "etcd" else f"-s -w {version_ldflags(version)}"
            flags = ["-p", BUILD_PARALLELISM, "-trimpath", f"-ldflags={ldflags}"]
            go_build(targets[name], f"./cmd/{name}", flags, cwd=module)
    return targets


def build_main(name: str, module: str, package: str, version: str, tags: str = "", main: str | None = None) -> Path:
    """The main package `package` of `module` at `version` (a module without replace directives), built in a
    generated wrapper module that requires it (`go install package@version` would also look up the module's
    deprecation through the proxy's version list, which the proxy may refuse); cached as `name-version`. With
    `main`, the wrapper's own main.go (importing from the module) is built instead of `package`."""
    target = cached(name, version)
    if target.exists():
        return target
    (CACHE / "build").mkdir(parents=True, exist_ok=True)  # also the working directory of `go mod download`
    upstream = (download_module(module, version) / "go.mod").read_text()
    go_directive = re.search(r"^go (\S+)$", upstream, re.MULTILINE)
    wrapper = CACHE / "build" / f"{name}-{version}"
    wrapper.mkdir(parents=True, exist_ok=True)
    (wrapper / "go.mod").write_text(
        f"module ddpjob.local/{name}\n\ngo {go_directive[1] if go_directive else '1.22.0'}\n\n"
        f"require {module} {version}\n"
    )
    if main is not None:
        (wrapper / "main.go").write_text(main)
        package = "."
    flags = ["-p", BUILD_PARALLELISM, "-trimpath", "-ldflags=-s -w", *(["-tags", tags] if tags else [])]
    return go_build(target, package, flags, cwd=wrapper)


def build_pause() -> Path:
    """The sandbox image's one binary: a module of its own, the standard library only."""
    target = cached("pause", PAUSE_VERSION)
    if target.exists():
        return target
    wrapper = CACHE / "build" / f"pause-{PAUSE_VERSION}"
    wrapper.mkdir(parents=True, exist_ok=True)
    (wrapper / "go.mod").write_text("module ddpjob.local/pause\n\ngo 1.22.0\n")
    (wrapper / "main.go").write_text(PAUSE_MAIN)
    return go_build(target, ".", ["-trimpath", "-ldflags=-s -w"], cwd=wrapper)


def containerd_command(name: str) -> Path:
    return build_main(
        name, CONTAINERD_MODULE, f"{CONTAINERD_MODULE}/cmd/{name}", CONTAINERD_VERSION, tags=CONTAINERD_TAGS
    )


def build_coredns() -> Path:
    imports = "\n".join(f'\t_ "{COREDNS_MODULE}/plugin/{plugin}"' for plugin in COREDNS_PLUGINS)
    return build_main(
        "coredns", COREDNS_MODULE, COREDNS_MODULE, COREDNS_VERSION, main=COREDNS_MAIN.format(imports=imports)
    )


def build_versitygw() -> Path:
    return build_main("versitygw", VERSITYGW_MODULE, f"{VERSITYGW_MODULE}/cmd/versitygw", VERSITYGW_VERSION)


def build_helm() -> Path:
    return build_main("helm", HELM_MODULE, f"{HELM_MODULE}/cmd/helm", HELM_VERSION)


def pytorchjob_crd(version: str = TRAINING_OPERATOR_VERSION) -> Path:
    return download_module(TRAINING_OPERATOR_MODULE, version) / PYTORCHJOB_CRD_IN_MODULE


def ensure_binaries() -> Binaries:
    (CACHE / "build").mkdir(parents=True, exist_ok=True)
    # Two builds at a time (each already compiles on both cores): while one downloads its modules or links, which
    # is mostly one core's work, the other compiles. The Kubernetes commands are the longest; the rest follow one
    # by one beside them.
    with ThreadPoolExecutor(max_workers=2) as pool:
        kubernetes = pool.submit(build_kubernetes)
        built = {
            "training_operator": pool.submit(
                build_main,
                "training-operator",
                TRAINING_OPERATOR_MODULE,
                f"{TRAINING_OPERATOR_MODULE}/cmd/training-operator.v1",
                TRAINING_OPERATOR_VERSION,
            ),
            "trainer_controller_manager": pool.submit(
                build_main,
                "trainer-controller-manager",
                TRAINER_MODULE,
                f"{TRAINER_MODULE}/cmd/trainer-controller-manager",
                TRAINER_VERSION,
            ),
            "jobset_controller": pool.submit(build_main, "jobset", JOBSET_MODULE, JOBSET_MODULE, JOBSET_VERSION),
            "containerd": pool.submit(containerd_command, "containerd"),
            "containerd_shim": pool.submit(containerd_command, "containerd-shim-runc-v2"),
            "ctr": pool.submit(containerd_command, "ctr"),
            "coredns": pool.submit(build_coredns),
            "pause": pool.submit(build_pause),
            "versitygw": pool.submit(build_versitygw),
            "helm": pool.submit(build_helm),
            "kueue": pool.submit(build_main, "kueue", KUEUE_MODULE, f"{KUEUE_MODULE}/cmd/kueue", KUEUE_VERSION),
        }
        commands = kubernetes.result()
        paths = {name: future.result() for name, future in built.items()}
    prune([*commands.values(), *paths.values()])
    return Binaries(
        etcd=commands["etcd"],
        kube_apiserver=commands["kube-apiserver"],
        kube_controller_manager=commands["kube-controller-manager"],
        kubectl=commands["kubectl"],
        kube_scheduler=commands["kube-scheduler"],
        kubelet=commands["kubelet"],
        kube_proxy=commands["kube-proxy"],
        pytorchjob_crd=pytorchjob_crd(),
        trainer_source=download_module(TRAINER_MODULE, TRAINER_VERSION),
        jobset_source=download_module(JOBSET_MODULE, JOBSET_VERSION),
        kueue_source=download_module(KUEUE_MODULE, KUEUE_VERSION),
        **paths,
    )


if __name__ == "__main__":
    try:
        print(ensure_binaries())
    except BuildError as error:
        sys.exit(f"cluster_binaries: {error}")

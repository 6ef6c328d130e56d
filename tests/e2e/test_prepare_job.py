"""The chart's prepare Job (prepare.enabled) on the control-plane tier, as a user runs it with `ctl submit`: a CPU-only
batch/v1 Job run by the Job controller prepares the data into the dataset cache on the job's claim while the
training pods wait for it; a prepare Job that dies, or finds bad data, ends the training job with the one line
that says why (trainer.workloads.wait_for).
"""

from __future__ import annotations

import json
import os
import signal
import sysconfig
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import test_control_plane
from test_control_plane import (
    EXIT_JOB_FAILED,
    EXIT_NOT_FOUND,
    JOB_TIMEOUT_S,
    KINDS,
    Cluster,
    Kind,
    assert_no_process_left,
    ctl_in,
    first_processes,
    job_spec,
    pod_logs,
    spec_file,
)

from ctl.spec import StorageSpec
from trainer.names import EXIT_BAD_INPUT, EXIT_ERROR
from trainer.prepare import MANIFEST
from trainer.spec import TimeoutsSpec
from trainer.workloads import RUN_DATASET

# The tier's fixtures: a control plane of this module's own, and a namespace per test.
cluster = test_control_plane.cluster
namespace = test_control_plane.namespace

pytestmark = pytest.mark.e2e

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CLAIM_MOUNT_PATH = StorageSpec().mount_path  # where the pods see the claim
# training.timeouts.prepareStallSeconds: how long the ranks wait for a prepare Job that shows no progress. Only that
# bound is short: the ranks' rendezvous has taken more than 10 s on the tier's node while a prepare Job tokenized on
# both cores, and it keeps longWorkSeconds' default.
PREPARE_STALL_S = 10
SIGKILLED = 128 + signal.SIGKILL  # what a node reports for a container killed by SIGKILL (OOM killer, lost node)


def prepare_job_spec(
    marker: str,
    name: str,
    corpus: list[Path],
    backoff_limit: int = 0,
    prepare_stall_s: int = TimeoutsSpec().prepare_stall_seconds,
    **values: Any,
) -> Any:
    """A tiny causal-lm job (its BPE trained while the data is prepared) on 2 pods, restartPolicy ExitCode, its
    prepare Job without retries unless `backoff_limit`, reading `corpus` from its claim (copied there first: the
    tier's claim is a local directory)."""
    training = {
        "task": "causal-lm",
        "tokenizer": {"vocabSize": 300},
        "timeouts": {"prepareStallSeconds": prepare_stall_s},
    }
    prepare = {"enabled": True, "cpu": "250m", "memory": "1Gi", "backoffLimit": backoff_limit}
    train = [f"{CLAIM_MOUNT_PATH}/corpus/{path.name}" for path in corpus]
    return job_spec(marker, train, training, name=name, restartPolicy="ExitCode", prepare=prepare, **values)


def put_on_claim(cluster: Cluster, namespace: str, name: str, files: dict[str, bytes]) -> Path:
    """The files in the job's claim, under corpus/: in the directory of the local volume the node's provisioner
    binds to the claim once it is created (the pods' fsGroup makes them theirs)."""
    claim = cluster.plane.claim_dir(namespace, f"{name}-checkpoints")
    (claim / "corpus").mkdir(parents=True)
    for file_name, data in files.items():
        (claim / "corpus" / file_name).write_bytes(data)
    return claim


def in_pod(claim: Path, path: Path) -> Path:
    """Where a pod sees a path of the claim: under the chart's default mount path."""
    return Path(CLAIM_MOUNT_PATH) / path.relative_to(claim)


def batch_job(cluster: Cluster, namespace: str, name: str) -> kubernetes.client.V1Job:
    return kubernetes.client.BatchV1Api(cluster.client()).read_namespaced_job(name, namespace)


def finished_batch_job(cluster: Cluster, namespace: str, name: str) -> kubernetes.client.V1Job:
    """The Job once the Job controller has called it Complete or Failed (a minute at most)."""
    deadline = time.monotonic() + 60
    job = batch_job(cluster, namespace, name)
    while job_finished(job) is None and time.monotonic() < deadline:
        time.sleep(0.5)
        job = batch_job(cluster, namespace, name)
    return job


def job_finished(job: kubernetes.client.V1Job) -> str | None:
    """Complete or Failed once the Job controller says so."""
    true = {c.type for c in job.status.conditions or [] if c.status == "True"}
    return next((state for state in ("Complete", "Failed") if state in true), None)


def prepare_pods(cluster: Cluster, namespace: str, job: str) -> list[kubernetes.client.V1Pod]:
    selector = f"batch.kubernetes.io/job-name={job}"
    return kubernetes.client.CoreV1Api(cluster.client()).list_namespaced_pod(namespace, label_selector=selector).items


def skip_on_external_cluster(cluster: Cluster) -> None:
    if cluster.plane is None:
        pytest.skip("writes the corpus to the job's claim directly: needs the local control plane's claim directory")


@pytest.mark.parametrize("kind", KINDS)
def test_prepare_job_prepares_the_data_the_training_pods_read(
    cluster: Cluster, namespace: str, tmp_path: Path, kind: Kind
) -> None:
    """`ctl submit` with prepare.enabled: the prepare Job runs (the Job controller's pod, CPU only), writes the dataset
    into the cache on the claim, the training pods wait for it and train on it without preparing anything
    themselves; the run records the dataset the manifest describes."""
    skip_on_external_cluster(cluster)
    marker = uuid.uuid4().hex
    name = f"prep-{marker[:6]}"
    corpus = sorted((STDLIB / "json").glob("*.py"))
    claim = put_on_claim(cluster, namespace, name, {path.name: path.read_bytes() for path in corpus})
    spec = spec_file(tmp_path, prepare_job_spec(marker, name, corpus, apiKind=kind.api.kind))
    ctl = ctl_in(cluster.kubeconfig, namespace, tmp_path)

    submitted = ctl("submit", str(spec))
    assert submitted.returncode == 0, submitted.stderr
    assert submitted.stdout.splitlines() == [f"{kind.resource}/{name}"], submitted.stdout
    done = ctl("wait", name, "--timeout", str(JOB_TIMEOUT_S))
    assert done.returncode == 0, done.stderr + pod_logs(cluster, namespace)

    # The ranks go on once the manifest is written: the Job's pod may still be exiting when training is done.
    prepare = finished_batch_job(cluster, namespace, f"{name}-prepare")
    assert job_finished(prepare) == "Complete" and prepare.status.succeeded == 1
    (pod,) = prepare_pods(cluster, namespace, f"{name}-prepare")
    (container,) = pod.spec.containers
    assert container.name == "prepare" and container.command[:3] == ["python", "-m", "trainer.prepare"]
    assert "nvidia.com/gpu" not in (container.resources.limits or {})

    (entry,) = (claim / "_datasets").glob("causal-lm-*")
    manifest = json.loads((entry / MANIFEST).read_text())
    recorded = json.loads((claim / name / RUN_DATASET).read_text())
    assert (recorded["fingerprint"], recorded["entry"]) == (manifest["fingerprint"], str(in_pod(claim, entry)))
    assert entry.name == f"causal-lm-{manifest['fingerprint']}"
    assert [Path(s["path"]).name for s in manifest["sources"]["train"]] == [p.name for p in corpus]
    assert manifest["splits"]["train"]["tokens"] > 0
    # Nothing of the Job's bookkeeping is left next to the entry (its progress line, an error).
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]
    assert json.loads((claim / name / "report.json").read_text())["steps"] == 5
    status = json.loads(ctl("status", name, "-o", "json").stdout)
    assert (status["prepare"]["name"], status["prepare"]["state"]) == (f"{name}-prepare", "Succeeded"), status
    assert f"\n  prepare: job/{name}-prepare Succeeded\n" in ctl("status", name).stdout

    logs = pod_logs(cluster, namespace)
    assert f"prepared {in_pod(claim, entry)} in " in logs, logs
    prepared_by_job = prepare_log(cluster, namespace, pod)
    # One tokenizing process for the pod's 250m CPU limit (trainer.cpus), not one per core of the node.
    assert f"preparing {in_pod(claim, entry)} with 1 process(es)" in prepared_by_job, prepared_by_job
    training_logs = logs.replace(prepared_by_job, "")
    # Each rank found the Job's manifest, or waited for it (the Job may finish before torch is imported).
    assert "preparing " not in training_logs, training_logs
    for rank in (0, 1):
        waited = f"rank {rank}: waiting for the prepare Job {name}-prepare "
        prepared = f"rank {rank}: prepared data {in_pod(claim, entry)} "
        assert prepared in training_logs or waited in training_logs, training_logs

    # Submitted again with --replace: the job and its finished prepare Job go, new ones come. The wait for the old
    # job's pods leaves out the prepare Job's pod, which carries the job label too (a TrainJob's waited 300 s for it).
    replaced = ctl("submit", str(spec), "--replace")
    assert replaced.returncode == 0, replaced.stderr + pod_logs(cluster, namespace)
    old_uid = pod.metadata.uid
    assert until(lambda: [p for p in prepare_pods(cluster, namespace, f"{name}-prepare") if p.metadata.uid != old_uid])
    # ctl delete takes the new prepare Job's pod with it: a batch Job's deletion orphans its pods by default.
    deleted = ctl("delete", name, "-y")
    assert deleted.returncode == 0, deleted.stderr
    assert until(lambda: not prepare_pods(cluster, namespace, f"{name}-prepare")), "the prepare pod was left"
    assert_no_process_left(cluster, marker)


def until(found: Callable[[], Any], timeout_s: float = 60) -> Any:
    """What `found` returns once it is true, or its last answer after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (answer := found()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return answer


def prepare_log(cluster: Cluster, namespace: str, pod: kubernetes.client.V1Pod) -> str:
    return kubernetes.client.CoreV1Api(cluster.client()).read_namespaced_pod_log(
        pod.metadata.name, namespace, container="prepare"
    )


def test_a_prepare_job_killed_outright_ends_the_training_job_with_one_line_naming_it(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """The prepare pod's process killed by SIGKILL (as the OOM killer or a lost node ends it) while it tokenizes, the
    Job out of retries: its progress line stops, every rank gives up after training.timeouts.prepareStallSeconds with
    exit code 1 and one line naming the Job, the dataset and what to run next; under restartPolicy ExitCode the job
    fails without a retry. `ctl wait` exits 100, `ctl status` shows the Job killed and failed, `ctl logs` the line."""
    skip_on_external_cluster(cluster)
    marker = uuid.uuid4().hex
    name = f"kill-{marker[:6]}"
    corpus = sorted((STDLIB / "email").glob("*.py"))  # ~600 KB: a few seconds of work, the Job is killed amid it
    claim = put_on_claim(cluster, namespace, name, {path.name: path.read_bytes() for path in corpus})
    spec = spec_file(tmp_path, prepare_job_spec(marker, name, corpus, prepare_stall_s=PREPARE_STALL_S))
    ctl = ctl_in(cluster.kubeconfig, namespace, tmp_path)

    assert ctl("submit", str(spec)).returncode == 0
    progress = sigkill_prepare_pod_once_it_shows_progress(claim / "_datasets", marker, f"{name}-prepare-")
    fingerprint = progress.name.removeprefix(".causal-lm-").removesuffix(".progress")
    entry = claim / "_datasets" / f"causal-lm-{fingerprint}"

    failed = ctl("wait", name, "--timeout", str(JOB_TIMEOUT_S))
    assert failed.returncode == EXIT_JOB_FAILED, failed.stderr + pod_logs(cluster, namespace)
    assert not entry.exists() and progress.exists()  # killed before it finished, its last progress line left
    (pod,) = prepare_pods(cluster, namespace, f"{name}-prepare")
    assert (pod.status.phase, pod.status.container_statuses[0].state.terminated.exit_code) == ("Failed", SIGKILLED)

    line = (
        f"error: the prepare Job {name}-prepare has not prepared dataset {fingerprint} ({in_pod(claim, entry)}): no"
        " progress from"
        f" it for {PREPARE_STALL_S} s (training.timeouts.prepareStallSeconds), after "
    )
    said = ctl("logs", name).stdout.splitlines()[-1]  # rank 0's pod's last line (after torchrun's report)
    assert said.startswith(line) and said.endswith(
        f" s of waiting; see `kubectl logs job/{name}-prepare`, or prepare it with `ctl prepare SPEC`, then start the"
        " job again"
    ), said

    # ctl status: the prepare Job killed and failed, and the training pod's root cause (its termination message).
    status = json.loads(ctl("status", name, "-o", "json").stdout)
    prepare = status["prepare"]
    assert (status["state"], prepare["name"], prepare["state"], prepare["reason"]) == (
        "Failed",
        f"{name}-prepare",
        "Failed",
        "BackoffLimitExceeded",
    ), status
    # Killed: no root cause of its own (its log's last line is whatever it was doing).
    assert (prepare["pod"]["phase"], prepare["pod"]["exitCode"], prepare["pod"]["message"]) == (
        "Failed",
        SIGKILLED,
        None,
    ), status
    master = next(p for p in status["pods"] if p["node"] == "master-0")
    assert (master["exitCode"], master["restarts"], master["message"]) == (EXIT_ERROR, 0, said), status
    table = ctl("status", name).stdout
    assert f"\n  prepare: job/{name}-prepare Failed (exit code {SIGKILLED}; BackoffLimitExceeded: " in table, table
    assert f"\n  {name}-master-0: {said}\n" in table, table
    assert_no_process_left(cluster, marker)


def sigkill_prepare_pod_once_it_shows_progress(cache: Path, marker: str, pod_prefix: str) -> Path:
    """SIGKILL to the prepare pod's main process (the container's first: its parent is not in the job) as soon as
    its progress file appears next to the dataset entry; that file."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        shown = list(cache.glob(".causal-lm-*.progress")) if cache.exists() else []
        if shown:
            (main,) = [
                pid for pid, env in first_processes(marker).items() if env.get("HOSTNAME", "").startswith(pod_prefix)
            ]
            os.kill(main, signal.SIGKILL)
            return shown[0]
        time.sleep(0.02)
    raise AssertionError(f"the prepare Job showed no progress in {JOB_TIMEOUT_S} s")


def test_bad_data_found_by_the_prepare_job_reaches_the_user_as_one_line(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """An undecodable file in the corpus: the prepare Job fails on it with exit code 2 and leaves its one line for the
    training pods, whose ranks exit 2 with it (bad input: the job fails, no retry). `ctl wait` exits 100; `ctl
    status` shows the exit codes and the line; rank 0's log ends with the line naming the key and the file. Fixed,
    `ctl submit --replace` prepares again and trains."""
    skip_on_external_cluster(cluster)
    marker = uuid.uuid4().hex
    name = f"bad-{marker[:6]}"
    corpus = sorted((STDLIB / "json").glob("*.py"))
    files = {path.name: path.read_bytes() for path in corpus} | {"latin1.py": "café = 1\n".encode("latin-1")}
    claim = put_on_claim(cluster, namespace, name, files)
    # A retry left: bad data is not retried all the same (the Job's podFailurePolicy).
    spec = spec_file(tmp_path, prepare_job_spec(marker, name, [*corpus, Path("latin1.py")], backoff_limit=1))
    ctl = ctl_in(cluster.kubeconfig, namespace, tmp_path)

    assert ctl("submit", str(spec)).returncode == 0
    failed = ctl("wait", name, "--timeout", str(JOB_TIMEOUT_S))
    assert failed.returncode == EXIT_JOB_FAILED, failed.stderr + pod_logs(cluster, namespace)

    line = f"error: training.data.train: {in_pod(claim, claim / 'corpus' / 'latin1.py')} is not UTF-8 text (byte 3)"
    assert ctl("logs", name).stdout.splitlines()[-1] == line
    status = json.loads(ctl("status", name, "-o", "json").stdout)
    master = next(p for p in status["pods"] if p["node"] == "master-0")
    assert (status["state"], master["exitCode"], master["restarts"]) == ("Failed", EXIT_BAD_INPUT, 0), status
    assert master["message"] == line, status
    prepare = status["prepare"]
    assert (prepare["state"], prepare["reason"]) == ("Failed", "PodFailurePolicy"), status
    assert (prepare["pod"]["exitCode"], prepare["pod"]["message"]) == (EXIT_BAD_INPUT, line), status
    assert len(prepare_pods(cluster, namespace, f"{name}-prepare")) == 1
    assert f"\n  {name}-master-0: {line}\n" in ctl("status", name).stdout
    assert not list((claim / "_datasets").glob("causal-lm-*"))  # nothing a later run would trust

    # The file fixed, the spec submitted again: a new prepare Job prepares it (the failed one would never run again),
    # and the job succeeds. Its pod template changed, which the old Job's cannot: the dry run checks a creation.
    (claim / "corpus" / "latin1.py").write_text("café = 1\n", encoding="utf-8")
    changed = ("--set", "prepare.memory=1100Mi")
    replaced = ctl("submit", str(spec), *changed, "--replace", "--wait", "--timeout", str(JOB_TIMEOUT_S))
    assert replaced.returncode == 0, replaced.stderr + pod_logs(cluster, namespace)
    # The ranks go on once the manifest is written: the Job's pod may still be exiting when training is done.
    assert job_finished(finished_batch_job(cluster, namespace, f"{name}-prepare")) == "Complete"
    assert json.loads(ctl("status", name, "-o", "json").stdout)["prepare"]["state"] == "Succeeded"
    assert len(list((claim / "_datasets").glob(f"causal-lm-*/{MANIFEST}"))) == 1
    assert ctl("wait", "no-such-job").returncode == EXIT_NOT_FOUND
    assert_no_process_left(cluster, marker)

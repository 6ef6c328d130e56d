"""Hung and slow ranks on real runs (`ctl run`, two gloo ranks): a slowed rank shows in the straggler
metric and in `ctl status`'s progress; a rank stopped with SIGSTOP fails the job through the watchdog, which
names it and its last step, dumps stacks and exits retryably; running the job again resumes bitwise exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import MARKER_ENV, REPO, processes_with_marker, rank_log, run_ctl, start_ctl, trainer_pids, wait_for
from prometheus_client.parser import text_string_to_metric_families
from test_chart import objects, pod_templates, spec_of, trainer_container
from test_checkpoint import EVERY, STEPS, assert_bitwise_equal, training, weights
from test_checkpoint import uninterrupted as uninterrupted  # the fixture: an uninterrupted run of the same spec
from torch.distributed import HashStore

from ctl.processes import free_port
from ctl.progress import metrics_progress
from ctl.tables import progress_text
from trainer.checkpoint import step_name
from trainer.dist import Dist, StopRequest
from trainer.frozen import beat_path
from trainer.names import EXIT_HUNG, FREEZE_RANK_ENV, HEARTBEAT_DIR_ENV, SLOW_RANK_ENV
from trainer.spec import TimeoutsSpec
from trainer.watchdog import Watchdog

SLOWDOWN = 0.5  # seconds rank 1 sleeps in every step: slow enough to stand out, and to stop it mid-run
FLOOR = 5  # timeouts.hangFloorSeconds


@dataclass
class Hung:
    output: str  # `ctl run`'s stdout and stderr
    returncode: int
    stopped_after: int  # rank 1's last completed step when it was stopped, from its own metrics
    metrics: str  # node 0's metrics page (both ranks) while rank 1 was the slow one
    spec: Path
    run_dir: Path
    marker: str


def samples(text: str, name: str) -> dict[str, float]:
    """{rank: value} of one metric in a metrics page."""
    return {
        sample.labels["rank"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


@pytest.fixture(scope="module")
def hung(tmp_path_factory: pytest.TempPathFactory, corpus_file: Path) -> Hung:
    """`ctl run` with rank 1 slowed down; once the straggler shows and a checkpoint exists, rank 1 is SIGSTOPped."""
    tmp = tmp_path_factory.mktemp("hung")
    run_dir = tmp / "run"
    spec = {
        "name": "hang",
        "procsPerNode": 2,
        "terminationGracePeriodSeconds": 8,  # torchrun waits 3 s for a stopped worker before killing it
        "training": training(corpus_file, run_dir, timeouts={"hangFloorSeconds": FLOOR}),
    }
    spec_path = tmp / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    marker = uuid.uuid4().hex
    env = os.environ | {"OMP_NUM_THREADS": "1", MARKER_ENV: marker, SLOW_RANK_ENV: f"1:{SLOWDOWN}"}
    process = start_ctl("run", str(spec_path), cwd=tmp, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        endpoint = wait_for(
            "node 0's metrics endpoint",
            lambda: next((m.group(1) for line in lines if (m := re.search(r"metrics of node 0 at (\S+)", line))), None),
            deadline,
        )

        def straggler_seen() -> str | None:
            with urllib.request.urlopen(endpoint, timeout=5) as response:  # not up yet: wait_for goes on
                text = response.read().decode()
            saved = samples(text, "ddpjob_checkpoint_step").get("0", 0) >= EVERY
            slow = samples(text, "ddpjob_step_time_ratio_to_median").get("1", 0) > 1.3
            return text if saved and slow and samples(text, "ddpjob_slowest_rank").get("0") == 1 else None

        # The first readings include the first step, alike on both ranks; rank 1's sleep shows from then on.
        metrics = wait_for("rank 1 to stand out as the slowest, and a checkpoint", straggler_seen, deadline)
        (rank_1,) = trainer_pids(marker, rank=1, local_rank=1)
        os.kill(rank_1, signal.SIGSTOP)
        with urllib.request.urlopen(endpoint, timeout=5) as response:
            stopped_after = int(samples(response.read().decode(), "ddpjob_step")["1"])
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
        reader.join(timeout=10)
    assert not processes_with_marker(marker), "a process of the hung run outlived `ctl run`"
    return Hung("".join(lines), process.returncode, stopped_after, metrics, spec_path, run_dir, marker)


def test_a_slowed_rank_raises_its_step_time_ratio_and_ctl_status_names_it(hung: Hung) -> None:
    ratios = samples(hung.metrics, "ddpjob_step_time_ratio_to_median")
    # Two ranks: the median is their mean, so the slow one is above 1 and the other below.
    assert ratios["1"] > 1.3 and ratios["0"] < 0.7, ratios
    progress = metrics_progress(hung.metrics)
    assert progress is not None and progress.slowest_rank is not None and progress.slowest_rank.rank == 1
    ratio = progress.slowest_rank.step_time_ratio_to_median  # rank 0's copy: maybe from another poll than rank 1's
    assert ratio > 1.3 and f"slowest rank 1 ({ratio:.2f}x the median)" in progress_text(progress)


def test_a_stopped_rank_fails_the_job_retryably_naming_it_and_a_rerun_resumes_exactly(
    hung: Hung, uninterrupted: dict[str, torch.Tensor]
) -> None:
    output = hung.output
    assert hung.returncode == 1, output
    report = re.search(r"ctl: the job hung \(exit code (\d+), retryable\).*: (hang: .*)", output)
    assert report and int(report.group(1)) == EXIT_HUNG, output
    named = re.search(r"rank 1: stopped responding after step (\d+)", report.group(2))
    assert named, report.group(2)
    # The others finished the step with rank 1's gradients; rank 1 may have been stopped before its optimizer step.
    assert int(named.group(1)) in (hung.stopped_after, hung.stopped_after + 1), (hung.stopped_after, report.group(2))
    assert f"at least training.timeouts.hangFloorSeconds = {FLOOR}" in report.group(2)
    # Rank 0 (the one not stopped) dumped its Python stacks into its log: its training thread waits in the gradient
    # all-reduce.
    log = rank_log(hung.run_dir, 0, 0)
    dump = log.read_text()[log.read_text().index("Python stacks of every thread of this rank") :]
    assert re.search(r'File ".*trainer/loop\.py", line \d+ in train', dump), dump

    saved = sorted(int(p.name[5:]) for p in hung.run_dir.glob("step-*"))
    assert saved and saved[-1] < STEPS and not (hung.run_dir / "final").exists()
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    rerun = run_ctl("run", str(hung.spec), cwd=hung.spec.parent, env=env)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"resuming from {step_name(saved[-1])}:" in rerun.stdout
    assert_bitwise_equal(weights(hung.run_dir), uninterrupted)


def launch_two_nodes(
    tmp_path: Path, corpus_file: Path, env: dict[str, str], **overrides: Any
) -> tuple[list[subprocess.Popen], Path]:
    """Two nodes as on a cluster, each its own launcher with nothing above it (no `ctl run` to end the other node),
    one rank each; (the launchers, the run directory)."""
    run_dir = tmp_path / "run"
    config = tmp_path / "training.yaml"
    section = training(corpus_file, run_dir, timeouts={"hangFloorSeconds": FLOOR}, **overrides)
    config.write_text(yaml.safe_dump(section))
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"} | env
    launch = [sys.executable, "-m", "trainer.launch", "--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1"]
    launch.append(f"--master-port={free_port()}")
    trainer = ["-m", "trainer", "--config", str(config)]
    nodes = [
        subprocess.Popen(
            [*launch, f"--node-rank={node}", *trainer], env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True
        )
        for node in (0, 1)
    ]
    return nodes, run_dir


def node_outputs(nodes: list[subprocess.Popen], marker: str) -> list[str]:
    """Each node's stderr once it has exited; whatever is left of the run is killed."""
    try:
        return [node.communicate(timeout=120)[1] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
        for pid in processes_with_marker(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def assert_exited_hung(output: str) -> None:
    assert output.splitlines()[-1].startswith("trainer.launch: a rank's watchdog found the job hung"), output


def assert_killed_by_its_launcher(output: str, rank: int) -> None:
    """The node's launcher killed its rank for a stale heartbeat, held to the step's limit, and exited hung."""
    killed = re.search(
        rf"\[rank {rank}\] hang: rank {rank} stopped responding \(no heartbeat for \d+ s, the last after step \d+;"
        r".*its node's launcher killed it",
        output,
    )
    assert killed and f"at least training.timeouts.hangFloorSeconds = {FLOOR}" in killed.group(0), output
    assert_exited_hung(output)


def test_a_rank_frozen_whole_is_killed_by_its_own_nodes_launcher_and_both_nodes_exit_hung(
    tmp_path: Path, corpus_file: Path
) -> None:
    """Rank 1's whole process is stopped, watchdog included. Node 0's rank finds the job hung and its node exits
    EXIT_HUNG; node 1's launcher finds its rank's heartbeat stale, kills it and exits EXIT_HUNG too, so that
    restartPolicy ExitCode recreates both pods (a pod left with a stopped rank never exits, and the recreated
    pods would wait for it at the rendezvous)."""
    marker = uuid.uuid4().hex
    # Steps long enough to stop rank 1 amid the run.
    nodes, run_dir = launch_two_nodes(tmp_path, corpus_file, {MARKER_ENV: marker, SLOW_RANK_ENV: f"1:{SLOWDOWN}"})
    try:
        wait_for("a checkpoint", lambda: next(run_dir.glob("step-*"), None), time.monotonic() + 180)
        (rank_1,) = trainer_pids(marker, rank=1)
        os.kill(rank_1, signal.SIGSTOP)
    finally:
        outputs = node_outputs(nodes, marker)
    assert [node.returncode for node in nodes] == [EXIT_HUNG, EXIT_HUNG], outputs
    assert "[rank 0] hang: rank 0 completed no step for" in outputs[0], outputs[0]
    assert_killed_by_its_launcher(outputs[1], rank=1)


@pytest.mark.parametrize("frozen", [1, 0])
def test_a_rank_frozen_as_its_peer_starts_an_evaluation_is_killed_first_and_the_peer_still_exits_hung(
    tmp_path: Path, corpus_file: Path, frozen: int
) -> None:
    """Rank `frozen` stops itself (the test hook) right after step 6, which its peer follows with a periodic
    evaluation: the peer is held to longWorkSeconds there, the frozen rank's last heartbeat to the step's limit. The
    frozen rank's launcher kills it first, so the peer's evaluation all-reduce fails (connection reset) before its
    watchdog could call the job hung; the peer finds the frozen rank's heartbeat stale and exits EXIT_HUNG all the
    same, not 1 (which restartPolicy ExitCode would not retry: the e2e frozen-rank job failed so when its stop landed
    just before a checkpoint). With rank 0 frozen, its node's launcher, whose torchrun agent serves the rendezvous
    store, stays up for the peer to read it."""
    peer = 1 - frozen
    marker = uuid.uuid4().hex
    env = {MARKER_ENV: marker, FREEZE_RANK_ENV: f"{frozen}:6"}
    nodes, _ = launch_two_nodes(tmp_path, corpus_file, env, evalEvery=6, logEvery=5)  # step 6: no log reduction
    outputs = node_outputs(nodes, marker)
    assert [node.returncode for node in nodes] == [EXIT_HUNG, EXIT_HUNG], outputs
    assert re.search(
        rf"\[rank {peer}\] hang: rank {peer}'s collective failed \(.*\); behind: rank {frozen}: stopped responding"
        r" after step 6 .*the other 1 rank\(s\): last step 6, evaluation",
        outputs[peer],
    ), outputs[peer]
    assert_exited_hung(outputs[peer])
    assert_killed_by_its_launcher(outputs[frozen], frozen)


# Rank 0 of 2, its store torch's in-process one: rank 1's heartbeat, written on a clock an hour ahead, never changes.
WATCHING_A_FROZEN_RANK = """
import json, time, torch
from torch.distributed import HashStore
from trainer.dist import Dist
from trainer.spec import TimeoutsSpec
from trainer.watchdog import Watchdog, heartbeat_key

store = HashStore()
timeouts = TimeoutsSpec(hangFloorSeconds=2)  # a poll of 0.5 s
dist = Dist(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"), timeouts=timeouts, store=store)
frozen = {"step": 8, "phase": "compute", "busy": None, "limit": 2.0, "time": time.time() + 3600}
store.set(heartbeat_key(1), json.dumps(frozen))
print(time.time(), flush=True)
with Watchdog(dist, None, metrics=None) as watchdog:
    watchdog.step_done(8, 0.01)
    with watchdog.long_work("checkpoint save"):
        time.sleep(60)
"""


def test_a_rank_finds_the_next_rank_frozen_from_its_heartbeat_in_the_store_while_itself_waits_in_long_work() -> None:
    """Rank 1 froze where its launcher's kill reaches none of rank 0's waits: rank 0 at a save's barrier, on the store
    (rank 1 frozen as it started the save, its last heartbeat still at the step's limit), or in an NCCL collective.
    Rank 0 is held to longWorkSeconds there, so its own watch finds nothing for 30 minutes; but it reads rank 1's
    heartbeat in the store every poll, and once nothing new came for rank 1's limit plus the launcher's margin, it
    calls the job hung (into the store, for every rank) and exits EXIT_HUNG. A real run cannot stop a rank there on
    demand: the collectives before a save fail with a killed peer (the tests above)."""
    result = subprocess.run(
        [sys.executable, "-c", WATCHING_A_FROZEN_RANK],
        env=os.environ | {"PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == EXIT_HUNG, result.stderr
    assert re.search(
        r"^\[rank 0\] hang: rank 1 stopped responding \(no new heartbeat for [45] s, the last after step 8; its limit"
        r" 2 s\): process stopped or frozen, or its node is gone; found by rank 0$",
        result.stderr,
        re.MULTILINE,
    ), result.stderr
    # Rank 1's limit, 4 polls (its launcher kills it then), at most a poll more to read it, and 2 polls of grace.
    assert 2 + 6 * 0.5 <= time.time() - float(result.stdout) <= 2 + 7 * 0.5 + 2


def test_the_launchers_heartbeat_leaves_the_long_work_limit_as_soon_as_the_work_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank frozen just after a checkpoint save is held to the step's limit, not to longWorkSeconds: the beat its
    launcher reads changes when the save ends, not a poll later (the e2e frozen-rank job waited 30 minutes so)."""
    monkeypatch.setenv(HEARTBEAT_DIR_ENV, str(tmp_path))
    timeouts = TimeoutsSpec(hangFloorSeconds=FLOOR)
    dist = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), timeouts=timeouts, store=HashStore())

    def limit() -> float | None:
        beat = beat_path(tmp_path, os.getpid())  # replaced atomically, never removed while watched
        return json.loads(beat.read_text())["limit"] if beat.exists() else None

    with Watchdog(dist, None, metrics=None) as watchdog:
        watchdog.step_done(1, 0.01)
        with watchdog.long_work("checkpoint save"):
            wait_for("the save's beat", lambda: limit() == timeouts.long_work_seconds, time.monotonic() + 30)
        assert limit() == FLOOR
    assert not beat_path(tmp_path, os.getpid()).exists()  # a rank no longer watched leaves no beat


def test_pods_get_the_nccl_flight_recorder_by_default_and_the_spec_env_overrides_it() -> None:
    def env(**values: Any) -> dict[str, list[str]]:
        template = pod_templates(objects(spec_of(**values))["PyTorchJob"])["Master"]
        names: dict[str, list[str]] = {}
        for var in trainer_container(template)["env"]:
            names.setdefault(var["name"], []).append(var.get("value"))
        return names

    defaults = env(storage={"mountPath": "/ckpt"})
    assert defaults["TORCH_NCCL_DUMP_ON_TIMEOUT"] == ["1"] and defaults["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == ["3"]
    assert int(defaults["TORCH_FR_BUFFER_SIZE"][0]) > 0
    # The traces land in the run directory on the shared volume, one file per rank.
    assert defaults["TORCH_FR_DUMP_TEMP_FILE"] == ["/ckpt/job/nccl_trace_rank_"]
    # One entry per name (server-side apply rejects duplicates), the spec's value.
    overridden = env(env=[{"name": "TORCH_FR_BUFFER_SIZE", "value": "0"}])
    assert overridden["TORCH_FR_BUFFER_SIZE"] == ["0"]


def test_between_log_steps_the_stop_flag_is_checked_as_often_as_the_grace_period_needs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A quarter of torchrun's shutdown timeout (4 s here) between checks: with 0.3 s steps, every third step."""
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "4")
    stop = StopRequest(Dist(0, 0, 1, torch.device("cpu")))
    assert not any(stop.agreed(step, 0.3, None) for step in range(1, 11))  # checked at 1, 4, 7 and 10
    stop.request(signal.SIGTERM, None)
    # Asked during step 11: the ranks act on it at the next check, 13, not at once; a log step's reduction checks too.
    assert [stop.agreed(step, 0.3, None) for step in (11, 12, 13)] == [False, False, True]
    assert stop.agreed(14, 0.3, [1.0, 0.3]) and not StopRequest(stop.dist).agreed(1, 0.3, [0.0, 0.3])

"""Every bench script runs here as `make bench` runs it, at toy size, so a bench that breaks fails the suite.

Only the output is checked: the JSON line parses and its figures are finite numbers. What they are is the
bench's business, never a test's (timing). A peer run that fails once is run again, and says so.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, tiny_spec


def run_bench(script: str, *args: str) -> dict[str, Any]:
    """`python bench/SCRIPT ARGS` from the repository root; its last line of output, read as JSON. It leaves nothing
    in the temporary directory (a fresh one) but torch's compile cache, which is kept across runs by design."""
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(
            [sys.executable, str(REPO / "bench" / script), *args],
            cwd=REPO,
            env=os.environ | {"TMPDIR": tmp},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        left = [p for p in Path(tmp).iterdir() if not p.name.startswith("torchinductor_")]  # torch's own cache
        assert left == [], f"{script} left these in the temporary directory"
    return json.loads(result.stdout.splitlines()[-1])


def numbers(value: Any) -> list[float]:
    """Every number in a JSON value (not the booleans)."""
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers(v)]
    return [value] if isinstance(value, int | float) and not isinstance(value, bool) else []


def assert_finite(result: dict[str, Any], *ratios: str) -> None:
    for name in ratios:
        assert isinstance(result[name], int | float), name
    assert numbers(result) and all(math.isfinite(n) for n in numbers(result)), result


def test_make_bench_runs_every_bench_script() -> None:
    """Each has its test below; the peers run under throughput.py."""
    recipe = re.search(r"^bench:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert recipe, "the Makefile's bench target"
    run = re.findall(r"\$\(BIN\)/python bench/(\w+\.py)", recipe.group(1))
    assert sorted(run) == sorted(p.name for p in (REPO / "bench").glob("*.py") if p.name != "peers.py")


def test_throughput_runs_ddpjob_and_both_peers() -> None:
    result = run_bench("throughput.py", "--toy")
    assert set(result["tokens_per_second"]) == {"ddpjob", "reference", "hf-trainer"}
    assert_finite(result, "ratio_vs_reference", "ratio_vs_hf_trainer", "cpu_ratio_vs_reference")
    # Never 0 or below: the ranks' time left the sum when they exited before a step line came (bench/throughput.py).
    assert all(seconds > 0 for seconds in result["cpu_seconds_per_step"].values()), result
    assert result["retried"] == []


def test_nanogpt_bench_runs_ddpjob_and_the_reference_at_1_and_2_processes() -> None:
    result = run_bench("nanogpt.py", "--toy")
    assert [r["configuration"] for r in result["results"]] == ["p1-eager", "p2-eager"]
    for configuration in result["results"]:
        assert_finite(configuration, "wall_seconds_ratio", "final_val_loss_ratio", "cpu_seconds_per_step_ratio")
        assert configuration["ddpjob"]["cpu_seconds_per_step"] > 0, configuration
        assert configuration["reference"]["cpu_seconds_per_step"] > 0, configuration
    assert result["retried"] == []


def test_each_nanogpt_round_of_ddpjob_trains_in_a_run_directory_of_its_own(tmp_path: Path) -> None:
    """In the round before's directory, `ctl run` resumes a finished run: a round that trains nothing."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from nanogpt import commands
    finally:
        sys.path.remove(str(REPO / "bench"))
    run_dirs = {tuple(commands(tmp_path, "p1-eager", 1, n)["ddpjob"]) for n in (1, 2)}
    assert len(run_dirs) == 2


def test_checkpoint_bench_saves_sync_and_async_to_the_disk_and_a_bucket() -> None:
    result = run_bench("checkpoint.py", "--layers", "1", "--embd", "64", "--repeats", "1", "--event-files", "2", "6")
    assert_finite(result, "async_stall_ratio")
    assert set(result["s3_vs_local_stall_ratio"]) == {"sync", "async"}
    assert set(result["event_upload_seconds"]) == {"2", "6"}
    assert_finite(result, "event_upload_ratio")
    assert_finite(result, "resume_check_ratio")
    assert set(result["resume_seconds"]) == {"checked", "unchecked"}


def test_cli_bench_times_ctl() -> None:
    result = run_bench("cli.py", "--repeats", "1")
    assert len(result) == 2
    assert_finite(result)


def test_metrics_overhead_bench(tmp_path: Path, corpus_file: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec(corpus_file)))
    assert_finite(run_bench("metrics_overhead.py", "--spec", str(spec)), "overhead_ratio")


def test_data_bench_runs_the_reference_prepare_a_first_start_a_restart_and_the_order() -> None:
    result = run_bench("data.py", "--small-mb", "1", "--large-mb", "2")
    assert {"reference", "first_start", "restart"} <= set(result["small"])
    assert_finite(result["ratios"], "first_start_vs_reference_wall", "restart_first_step_large_vs_small")
    assert_finite(result["ratios"], "order_largest_vs_smallest", "order_largest_vs_reference")
    assert_finite(result)


def test_compile_cache_bench_starts_from_scratch_and_from_the_volumes_cache() -> None:
    result = run_bench("compile_cache.py", "--rounds", "1", "--layers", "1", "--steps", "2")
    assert [len(result["rounds"][where]) for where in ("scratch", "volume")] == [1, 1]
    assert_finite(result["ratios"], "first_step_s_volume_vs_scratch", "wall_s_volume_vs_scratch")
    assert_finite(result)


@pytest.fixture
def throughput(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(REPO))
    from bench import throughput

    return throughput


def fails_once(tmp_path: Path) -> list[str]:
    """A run that fails the first time it runs (a line on stderr, exit 3) and succeeds after."""
    marker = tmp_path / "failed-once"
    script = (
        f"import pathlib, sys\nmarker = pathlib.Path({str(marker)!r})\n"
        "if not marker.exists():\n    marker.touch()\n    sys.exit('gloo: connection closed by peer')\n"
        "print('step 1')\n"
    )
    return [sys.executable, "-c", script]


def test_a_failed_peer_run_is_run_again_once_and_says_why(throughput: Any, tmp_path: Path, capsys) -> None:
    retried: list[dict] = []
    run = throughput.measure_with_retry(
        "hf-trainer", fails_once(tmp_path), cwd=tmp_path, warmup=0, last_step=1, round_number=2, retried=retried
    )
    assert run.step_times.keys() == {1}
    assert retried == [{"round": 2, "runner": "hf-trainer", "failure": "exit code 1"}]
    said = capsys.readouterr().err
    assert "round 2 hf-trainer: failed (exit code 1), running it again once" in said
    assert "gloo: connection closed by peer" in said

    # ddpjob's own runs are never retried; nor is a peer's a second time.
    for runner in ("ddpjob", "reference"):
        (tmp_path / "failed-once").unlink(missing_ok=True)
        always = [sys.executable, "-c", "raise SystemExit(4)"]
        first = fails_once(tmp_path) if runner == "ddpjob" else always
        with pytest.raises(throughput.RunFailed):
            throughput.measure_with_retry(
                runner, first, cwd=tmp_path, warmup=0, last_step=1, round_number=1, retried=retried
            )
    assert len(retried) == 2


def test_a_worker_killed_by_a_signal_is_named_from_torchrun_s_report(throughput: Any, tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text("import os\nif os.environ['RANK'] == '1':\n    os.abort()\n")
    command = [*throughput.torchrun(tmp_path, 2), str(worker)]
    with pytest.raises(throughput.RunFailed) as failed:
        throughput.measure("reference", command, cwd=tmp_path, warmup=0, last_step=1)
    assert failed.value.how == "exit code 1, rank 1 signal SIGABRT"


# A run's process tree as a trainer under torchrun is: a worker that uses CPU time and exits, its step lines passed
# on later (torchrun's relay reads the workers' logs every 0.1 s), the last one after the worker has exited.
EXITED_WORKER = """
import os, time
pid = os.fork()
if pid == 0:
    time.sleep(1.0)  # after the first line has been read
    started = time.process_time()
    while time.process_time() - started < 0.3:
        pass
    os._exit(0)
print("step 1", flush=True)
while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
    time.sleep(0.01)
print("step 2", flush=True)  # the worker has exited, not yet reaped
os.waitpid(pid, 0)
print("step 3", flush=True)  # reaped: its time is now its parent's children's
"""


@pytest.mark.parametrize("last_step", [2, 3], ids=["exited", "reaped"])
def test_a_worker_s_cpu_time_stays_counted_after_it_exits(throughput: Any, tmp_path: Path, last_step: int) -> None:
    run = throughput.measure(
        "ddpjob", [sys.executable, "-c", EXITED_WORKER], cwd=tmp_path, warmup=0, last_step=last_step
    )
    (first, _), (last, _) = sorted(run.usage.items())
    assert (first, last) == (1, last_step)
    assert run.usage_per_step().cpu_seconds * (last - first) >= 0.25  # the worker's 0.3 s, less a tick or two


def test_a_window_whose_lines_came_at_once_is_refused_not_divided_by(throughput: Any) -> None:
    run = throughput.Run("ddpjob", step_times={3: 9.0, 6: 9.001})
    run.usage = {3: throughput.Usage(4.0, 10), 6: throughput.Usage(4.0, 10)}
    with pytest.raises(
        RuntimeError, match=r"ddpjob: steps 3 to 6 used no CPU time between their lines, which came 1 ms"
    ):
        run.usage_per_step()


def test_each_round_starts_with_the_next_runner(throughput: Any) -> None:
    runners = throughput.commands(Path("work"), 2)
    orders = [[name for name, _ in throughput.in_turn(runners, n)] for n in (1, 2, 3, 4)]
    assert orders == [
        ["ddpjob", "reference", "hf-trainer"],
        ["reference", "hf-trainer", "ddpjob"],
        ["hf-trainer", "ddpjob", "reference"],
        ["ddpjob", "reference", "hf-trainer"],
    ]
    assert dict(throughput.in_turn(runners, 2)) == runners  # each with its own command

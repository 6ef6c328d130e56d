"""`ctl run` end to end: a real multi-process run, its run directory, and failures that clean up."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import (
    CTL,
    REPO,
    import_hook,
    processes_with_marker,
    rank_log,
    run_ctl,
    scratch_folders,
    start_ctl,
    tensorboard_scalars,
    tiny_spec,
    trainer_pids,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from ctl.processes import PORTS_FROM, ephemeral_ports_start, free_port


def test_run_writes_a_loadable_final_model_and_report(tmp_path, write_spec, corpus_file, marked_env) -> None:
    env, marker = marked_env
    spec = tiny_spec(corpus_file, sample={"prompt": "def ", "maxNewTokens": 20}) | {"procsPerNode": 2}
    result = run_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "tiny"
    assert "[rank 0] step 5/5 | loss " in result.stdout
    assert f"[rank 0] run directory: {run_dir}" in result.stdout
    assert "[rank 0] sample:\n[rank 0] def " in result.stdout
    # Rank 1's own output is in its log, not on the terminal.
    assert "rank 1 of 2" not in result.stdout + result.stderr
    rank1 = rank_log(run_dir, 0, 1)
    assert rank1.read_text().startswith("rank 1 of 2 on ")

    report = json.loads((run_dir / "report.json").read_text())
    assert report["task"] == "char-gpt" and report["world_size"] == 2 and report["steps"] == 5
    assert report["samples"] == 5 * 2 * 4 and report["tokens"] == 5 * 2 * 4 * 32
    assert report["perplexity"] > 1 and report["eval_tokens"] > 0

    # final/ is a plain transformers export: load it without this project and generate.
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    text = "import json\n"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == text and ids.shape[1] == len(text)
    generated = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert generated.shape[1] == len(text) + 10
    assert tokenizer.model_max_length == model.config.n_positions  # so `truncation=True` fits a text to the model
    assert len(tokenizer(text * 100, truncation=True).input_ids) == model.config.n_positions

    # TensorBoard (reportTo's default) read back with its own reader: every logged value, at its step.
    scalars = tensorboard_scalars(run_dir)
    logged = [float(m) for m in re.findall(r"\[rank 0\] step \d+/5 \| loss (\S+)", result.stdout)]
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5]
    assert [value for _, value in scalars["train/loss"]] == pytest.approx(logged, abs=6e-5)  # float32, 4 decimals
    for tag in ("train/accuracy", "train/learning_rate", "train/grad_norm", "train/tokens_per_second"):
        assert [step for step, _ in scalars[tag]] == [1, 2, 3, 4, 5], tag
    assert scalars["checkpoint/size_bytes"][0][0] == 5 and scalars["checkpoint/size_bytes"][0][1] > 0
    assert [step for step, _ in scalars["eval/loss"]] == [5]  # keepBest evaluates at the final checkpoint
    assert processes_with_marker(marker) == []

    # The same command again resumes the finished run: no step to take, and the report keeps the training loss of
    # its last interval, which the checkpoint holds (it was NaN, which is not JSON).
    again = run_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=env)
    assert again.returncode == 0 and "[rank 0] resuming from step-00000005" in again.stdout, again.stderr
    rewritten = json.loads((run_dir / "report.json").read_text(), parse_constant=lambda word: pytest.fail(word))
    assert rewritten["train_loss"] == report["train_loss"] == pytest.approx(logged[-1], abs=6e-5)
    assert rewritten["steps"] == 5 and rewritten["perplexity"] == report["perplexity"]


def test_missing_data_file_fails_every_rank_with_one_clear_line(tmp_path, write_spec, corpus_file, marked_env) -> None:
    env, marker = marked_env
    missing = tmp_path / "no-such-corpus.txt"
    spec = tiny_spec(corpus_file, data={"train": str(missing)}) | {"nodes": 2, "procsPerNode": 1}
    result = run_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert (result.stdout, result.stderr) == ("", f"error: training.data.train: no file matches '{missing}'\n")
    assert not (tmp_path / "runs").exists()
    assert processes_with_marker(marker) == []


@contextlib.contextmanager
def two_nodes_training(
    tmp_path: Path, write_spec, corpus_file: Path, env: dict[str, str], marker: str
) -> Iterator[tuple[subprocess.Popen, int]]:
    """A long 2-node `ctl run` once it trains: (ctl, rank 1's trainer pid); ctl is killed if still running after.
    A stop kills what is left 10 s after SIGTERM (terminationGracePeriodSeconds: a hung rank never exits)."""
    spec = tiny_spec(corpus_file, maxSteps=100_000) | {"nodes": 2, "procsPerNode": 1}
    spec["terminationGracePeriodSeconds"] = 10
    ctl = start_ctl("run", str(write_spec(spec)), cwd=tmp_path, env=env, merge_stderr=False)
    try:
        assert ctl.stdout is not None
        for line in ctl.stdout:
            if "| loss " in line:
                break
        deadline = time.monotonic() + 30
        while not (rank1 := trainer_pids(marker, rank=1)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rank1, "rank 1's trainer process not found"
        yield ctl, rank1[0]
    finally:
        if ctl.poll() is None:
            ctl.kill()


@pytest.mark.timeout(300)
def test_a_crashed_node_stops_the_whole_run(tmp_path, write_spec, corpus_file, marked_env) -> None:
    env, marker = marked_env
    with two_nodes_training(tmp_path, write_spec, corpus_file, env, marker) as (ctl, rank1):
        os.kill(rank1, signal.SIGKILL)
        _, stderr = ctl.communicate(timeout=120)
    assert ctl.returncode == 1
    # Rank 1's death, not rank 0's lost connection to it; its log and everyone's named.
    failed = re.search(r"^error: rank 1 on node 1 \(tiny-worker-0\) failed: killed by SIGKILL \((.*)\)$", stderr, re.M)
    # A killed process left no traceback: its output is what the file holds.
    assert failed and failed.group(1).startswith(f"output in {tmp_path / 'runs' / 'tiny' / 'logs'}"), stderr
    assert processes_with_marker(marker) == []


@pytest.mark.timeout(300)
def test_a_killed_node_is_said_to_be_killed_by_its_signal(tmp_path, write_spec, corpus_file, marked_env) -> None:
    """The node itself (its launcher, torchrun's agent) killed, as the OOM killer or a node's loss would: no record of
    its own, so ctl names the signal. It said `exited with code 137`."""
    env, marker = marked_env
    with two_nodes_training(tmp_path, write_spec, corpus_file, env, marker) as (ctl, rank1):
        launcher = int(Path(f"/proc/{rank1}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent
        os.kill(launcher, signal.SIGKILL)
        _, stderr = ctl.communicate(timeout=120)
    assert ctl.returncode == 1
    assert re.search(
        r"^error: node 1 \(tiny-worker-0\) failed: killed by SIGKILL \(logs of every rank in ", stderr, re.M
    ), stderr
    assert processes_with_marker(marker) == []


# Rank 1's Trainer.train raises an exception nothing in the trainer expects (a bug, a library's error), from a
# sitecustomize module every Python process of the run imports.
RAISE_IN_RANK_1 = import_hook(
    "trainer.loop",
    """
    def train(self):
        raise RuntimeError("unexpected in rank 1")

    module.Trainer.train = train
    """,
    when='os.environ.get("RANK") == "1"',
)


def test_a_rank_s_exception_names_the_file_with_its_traceback(tmp_path, write_spec, corpus_file, marked_env) -> None:
    env, marker = marked_env
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(RAISE_IN_RANK_1)
    spec = tiny_spec(corpus_file) | {"nodes": 2, "procsPerNode": 1}
    result = subprocess.run(
        [*CTL, "run", str(write_spec(spec))],
        cwd=tmp_path,
        env=env | {"PYTHONPATH": f"{tmp_path / 'hook'}{os.pathsep}{REPO}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    failed = re.search(
        r"^error: rank 1 on node 1 \(tiny-worker-0\) failed: RuntimeError: unexpected in rank 1"
        r" \(traceback in (\S+); logs of every rank in \S+\)$",
        result.stderr,
        re.M,
    )
    assert failed, result.stderr
    assert "Traceback (most recent call last)" in Path(failed.group(1)).read_text(), failed.group(1)
    assert processes_with_marker(marker) == []


def test_spec_values_reach_the_trainer_unchanged(tmp_path, write_spec, corpus_file) -> None:
    """--set overrides apply to the run (here: the step count and the run directory)."""
    spec_file = write_spec(tiny_spec(corpus_file))
    result = run_ctl("run", str(spec_file), "--set", "training.maxSteps=2", "--run-dir", "elsewhere", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "elsewhere" / "report.json").read_text())
    assert report["steps"] == 2 and report["world_size"] == 1
    assert yaml.safe_load(spec_file.read_text())["training"]["maxSteps"] == 5


@pytest.mark.timeout(300)
def test_interrupting_a_hung_run_leaves_no_process_behind(
    tmp_path, temporary, write_spec, corpus_file, marked_env
) -> None:
    """Ctrl-C while rank 1 hangs (SIGSTOP): SIGTERM cannot finish the run, so after the grace period
    ctl kills the agents and the workers torchrun started in sessions of their own. The killed agents' heartbeat
    folders stay in $TMPDIR (they ran no exit handler) until the next launcher there removes them."""
    env, marker = marked_env
    # torchrun would kill the hung rank itself, 5 s before the grace period ends: here it would wait longer than
    # the grace period, so that ctl kills the agents, as it does an agent that is stuck itself.
    env |= {"TMPDIR": str(temporary), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60"}
    with two_nodes_training(tmp_path, write_spec, corpus_file, env, marker) as (ctl, rank1):
        os.kill(rank1, signal.SIGSTOP)  # rank 0 now waits for it in its next collective
        time.sleep(1)
        ctl.send_signal(signal.SIGINT)
        _, stderr = ctl.communicate(timeout=120)
    assert ctl.returncode == 130 and "ctl: interrupted (SIGINT): stopped" in stderr
    assert "ctl: killed the nodes 10 s after SIGTERM, before they had all saved and exited" in stderr
    assert processes_with_marker(marker) == []
    assert scratch_folders(temporary), "no agent was killed: nothing left to remove"
    (tmp_path / "done.py").write_text("print('done')\n")
    launch = [sys.executable, "-m", "trainer.launch", "--standalone", "done.py"]
    done = subprocess.run(launch, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert scratch_folders(temporary) == []


def test_the_trainer_runs_as_one_process_without_torchrun(tmp_path: Path, corpus_file: Path) -> None:
    """`python -m trainer` alone (no process group, so no store and no watchdog threads) finishes a run."""
    training = tiny_spec(corpus_file, checkpoint={"dir": str(tmp_path / "run")})["training"]
    config = tmp_path / "training.yaml"
    config.write_text(yaml.safe_dump(training), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "--config", str(config)], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "final" / "config.json").is_file()


def test_ports_ctl_run_picks_lie_below_those_the_kernel_gives_outgoing_connections() -> None:
    """`ctl run`'s rendezvous and metrics ports are picked seconds before their servers bind them; from the kernel's
    range for outgoing connections, one of the run's own connections took a metrics port meanwhile (EADDRINUSE)."""
    ports = {free_port() for _ in range(20)}
    assert all(PORTS_FROM <= port < ephemeral_ports_start() for port in ports), ports
    assert len(ports) > 1  # random, not one port for every caller
    # Never one port twice, though none is bound yet: a run's rendezvous port given again as its metrics port failed
    # the metrics server with EADDRINUSE (about one run in 10,000 at random; two draws of 2,000 would collide).
    many = [free_port() for _ in range(2000)]
    assert len(set(many)) == len(many)


def test_free_port_gives_no_port_twice_where_it_takes_the_kernels_pick(monkeypatch) -> None:
    """Where the range below the kernel's is empty, free_port takes the kernel's pick, which repeats (here about 34
    in 1,000 draws): such a port too is given once."""
    monkeypatch.setattr("ctl.processes.ephemeral_ports_start", lambda: PORTS_FROM)
    many = [free_port() for _ in range(1000)]
    assert len(set(many)) == len(many)
    assert all(port >= ephemeral_ports_start() for port in many)

"""Training throughput of this project's trainer against a bare DDP loop and transformers' Trainer.

One workload, three ways, in one invocation, interleaved A/B/C/B/C/A/C/A/B so that machine drift
hits all three alike and none always runs first: GPT-2 causal LM from a config on Python's
standard library sources, the same tokenizer, blocks, global batch, optimizer (AdamW, no weight
decay, clip 1.0) and step count.

- ddpjob:     `ctl run` of a job spec, as users start it (its final evaluation, checkpoint and
              export included in the wall time: that is what a run costs);
- reference:  a minimal DDP loop under torchrun (`bench/peers.py reference`);
- hf-trainer: transformers' `Trainer` under torchrun (`bench/peers.py hf-trainer`).

Every runner prints one line per optimizer step from rank 0; this driver timestamps the lines
as they arrive. Steady-state tokens/s leaves out the first `--warmup` steps; the wall time is
from process start to exit. Peak RSS is the largest sum over the run's processes; CPU s/step
the CPU time all of them (workers, torchrun agents, `ctl`) used per step over the same steps as
tokens/s: the host's share of a step on a GPU, all of it on a CPU; faults/step their minor page
faults over those steps: memory the kernel hands out afresh each step instead of malloc reusing
it. Each ratio is also given round by round, where the runners ran back to back.

    python bench/throughput.py                     # CPU: 2 processes, gloo, 4 x 256 GPT-2, block 256
    python bench/throughput.py --device cuda       # every GPU, NCCL, GPT-2 124M, block 1024,
                                                   # bf16 + fused AdamW + torch.compile, MFU reported
    python bench/throughput.py --fast              # CPU with bf16 autocast + torch.compile (the GPU
                                                   # settings' code paths, on a machine without one)
    python bench/throughput.py --toy               # every code path in seconds, no figure worth reading:
                                                   # a tiny model and corpus, 1 round of 20 steps (tests)

A peer's run that fails is run again once, and the output says so (its exit and its last lines):
a flaky peer should not cost the whole bench, nor go unseen. ddpjob's runs are never retried.

Prints a table, the ratios, and one JSON line (keys include ratio_vs_reference, ratio_vs_hf_trainer).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.peers import gpt2  # noqa: E402
from trainer.metrics import BF16_PEAK_FLOPS, flops_per_token  # noqa: E402
from trainer.prepare import read_texts  # noqa: E402
from trainer.text import expand_paths, train_tokenizer  # noqa: E402

CORPUS = ["{stdlib}/json/*.py", "{stdlib}/email/*.py", "{stdlib}/http/*.py", "{stdlib}/logging/*.py"]
# About 9 MB of the standard library's own packages, named one by one: `{stdlib}/**` would
# reach into site-packages, whose files are not all UTF-8. Each is in every CPython 3.10-3.13
# (not idlelib or tkinter, which Debian ships apart, nor lib2to3, gone in 3.13).
GPU_CORPUS_PACKAGES = (
    "asyncio collections concurrent ctypes email http importlib json logging multiprocessing"
    " pydoc_data sqlite3 unittest urllib wsgiref xml xmlrpc"
)
GPU_CORPUS = ["{stdlib}/*.py", *(f"{{stdlib}}/{package}/**/*.py" for package in GPU_CORPUS_PACKAGES.split())]
SHAPES = {
    "cpu": {"layers": 4, "heads": 4, "embd": 256, "block": 256, "batch": 4, "vocab_size": 2048},
    # GPT-2 124M: its 50257-token vocabulary (a BPE of that size trains on the corpus above in seconds).
    "cuda": {"layers": 12, "heads": 12, "embd": 768, "block": 1024, "batch": 16, "vocab_size": 50257},
    # Its steps take 25-100 ms here: LENGTHS' toy times 14 of them, which span CPU clock ticks and torchrun's 0.1 s
    # polling of the workers' logs (ddpjob's step lines come through it, a few at a time).
    "toy": {"layers": 2, "heads": 2, "embd": 128, "block": 128, "batch": 4, "vocab_size": 512},
}
# The toy's, about 250 KB: its 0.2% of validation text still holds a block.
CORPORA = {"cpu": CORPUS, "cuda": GPU_CORPUS, "toy": ["{stdlib}/json/*.py", "{stdlib}/logging/*.py"]}
# Steps per run, the first ones left out, and A/B/C rounds; on CPU a round varies by about 5%.
LENGTHS = {
    "cpu": {"steps": 40, "warmup": 5, "rounds": 5},
    "cuda": {"steps": 120, "warmup": 30, "rounds": 3},
    "toy": {"steps": 20, "warmup": 5, "rounds": 1},
}
# Rank 0's line under `ctl run`'s prefix, or torchrun's default one (a torch that ignores the prefix template).
STEP_LINE = re.compile(r"^(?:\[rank 0\] |\[default0\]:)?step (\d+)\b")
# All three print it on a GPU: the trainer in its summary, the peers when they are done.
PEAK_GPU_MEMORY_LINE = re.compile(r"peak GPU memory ([\d.]+) GiB")
# An evaluation's line, periodic or final (bench/nanogpt.py times them).
VAL_LOSS_LINE = re.compile(r"\bval loss ([\d.]+|nan|inf)")
# A failed worker in torchrun's closing report: its rank, then its exit code (negative: the signal that ended it).
WORKER_EXIT = re.compile(r"rank\s*: (\d+) \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+)")


@dataclass(frozen=True)
class Usage:
    cpu_seconds: float  # user + system
    page_faults: float  # minor ones: pages the kernel maps in, none read from disk


@dataclass
class Run:
    runner: str
    step_times: dict[int, float] = field(default_factory=dict)  # step -> seconds since start
    # step -> what the run's processes had used when its line came, at the two ends of the window
    usage: dict[int, Usage] = field(default_factory=dict)
    wall: float = 0.0
    peak_rss: int = 0
    peak_gpu_memory_gib: float | None = None
    val_losses: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, loss), in order
    output: list[str] = field(default_factory=list)

    def tokens_per_second(self, tokens_per_step: int, warmup: int) -> float:
        steps = sorted(step for step in self.step_times if step > warmup)
        if len(steps) < 2:
            raise RuntimeError(f"{self.runner}: too few steps after warm-up:\n" + "".join(self.output[-30:]))
        return tokens_per_step * (steps[-1] - steps[0]) / (self.step_times[steps[-1]] - self.step_times[steps[0]])

    def usage_per_step(self) -> Usage:
        """What every process of the run (workers, agents, ctl) used per step, over the same steps as tokens/s."""
        (first, start), (last, end) = sorted(self.usage.items())
        if end.cpu_seconds == start.cpu_seconds:  # a figure of 0 would be a ratio's zero divisor
            apart = self.step_times[last] - self.step_times[first]
            raise RuntimeError(
                f"{self.runner}: steps {first} to {last} used no CPU time between their lines, which came"
                f" {apart * 1000:.0f} ms apart: too few steps to measure (--steps)"
            )
        steps = last - first
        return Usage((end.cpu_seconds - start.cpu_seconds) / steps, (end.page_faults - start.page_faults) / steps)


class RunFailed(RuntimeError):
    """A run ended with a non-zero exit: how (its own and each failed worker's exit), and what it printed last."""

    def __init__(self, runner: str, returncode: int, output: list[str]) -> None:
        self.tail = "".join(output[-40:])
        exits = [f"rank {rank} {exit_name(int(code))}" for rank, code in WORKER_EXIT.findall(self.tail)]
        self.how = ", ".join([exit_name(returncode), *exits])
        super().__init__(f"{runner} failed ({self.how}):\n{self.tail}")


def exit_name(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class RunTree:
    """One run's processes: every one whose environment carries its marker, found as they start.

    Its usage sums each process's own CPU time and minor faults with those of the children it has reaped, and keeps
    reading a process it knows once it has exited (a zombie's environment cannot be read): a rank's use stays in the
    sum after it exits, first as its own and then in its torchrun agent's, so the sum never falls. Read as it runs,
    the sum of the living alone lost the ranks when a step's line came after they had exited (torchrun passes
    ddpjob's lines on every 0.1 s), which made CPU s/step negative or zero.
    """

    def __init__(self, marker: bytes) -> None:
        self.marker = marker
        self.known: dict[Path, str] = {}  # a process's /proc entry -> its start time (a reused pid starts later)
        self.lock = threading.Lock()  # the RSS poller's thread and the step lines' both scan

    def stats(self) -> list[tuple[Path, list[str]]]:
        """Each process's /proc entry and the fields of its stat after the command name (field N at index N - 3)."""
        found = []
        with self.lock:
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    if self.known.get(entry) != fields[19]:
                        if self.marker not in (entry / "environ").read_bytes():
                            continue
                        self.known[entry] = fields[19]
                except (OSError, IndexError):
                    continue
                found.append((entry, fields))
        return found

    def rss(self) -> int:
        """Resident memory of the run's processes, summed."""
        total = 0
        for entry, _ in self.stats():
            try:
                total += int(re.search(r"VmRSS:\s+(\d+) kB", (entry / "status").read_text()).group(1)) * 1024
            except (OSError, AttributeError):  # a zombie has no VmRSS
                continue
        return total

    def usage(self) -> Usage:
        """CPU time (user + system) and minor page faults of the run's processes so far, over all their threads and
        reaped children."""
        ticks = faults = 0
        for _, fields in self.stats():
            faults += int(fields[7]) + int(fields[8])  # minflt, cminflt
            ticks += sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime, stime, cutime, cstime
        return Usage(ticks / os.sysconf("SC_CLK_TCK"), faults)


def measure(runner: str, command: list[str], cwd: Path, warmup: int, last_step: int, threads: int | None = 1) -> Run:
    """Run `command`, timestamping its step and evaluation lines. `threads`: OMP_NUM_THREADS of every process, or
    None to leave it to the runner (torchrun and `ctl run` each pick one per process)."""
    marker = f"DDPJOB_BENCH={uuid.uuid4().hex}"
    # The repository first, then the caller's own path (where a device machine's missing packages lie).
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"PYTHONPATH": python_path, "DDPJOB_BENCH": marker.split("=", 1)[1], "OMP_NUM_THREADS": "1"}
    if threads is None:
        del env["OMP_NUM_THREADS"]
    run = Run(runner)
    tree = RunTree(marker.encode())
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = threading.Event()

    def poll_rss() -> None:
        while not done.wait(0.5):
            run.peak_rss = max(run.peak_rss, tree.rss())

    poller = threading.Thread(target=poll_rss, daemon=True)
    poller.start()
    assert process.stdout is not None
    for line in process.stdout:
        run.output.append(line)
        if match := VAL_LOSS_LINE.search(line):
            run.val_losses.append((time.perf_counter() - started, float(match.group(1))))
        if (match := STEP_LINE.match(line)) and int(match.group(1)) not in run.step_times:
            # The first line of a step is when it was done (an evaluation's line at that step comes later).
            step = int(match.group(1))
            run.step_times[step] = time.perf_counter() - started
            if step == last_step or (step > warmup and not run.usage):
                run.usage[step] = tree.usage()
        elif match := PEAK_GPU_MEMORY_LINE.search(line):
            run.peak_gpu_memory_gib = float(match.group(1))
    process.wait()
    run.wall = time.perf_counter() - started
    done.set()
    poller.join()
    if process.returncode != 0:
        raise RunFailed(runner, process.returncode, run.output)
    return run


def measure_with_retry(
    runner: str,
    command: list[str],
    cwd: Path,
    warmup: int,
    last_step: int,
    round_number: int,
    retried: list[dict],
    threads: int | None = 1,
) -> Run:
    """measure(); a peer's run that fails is run once more, noted in `retried` and on stderr with its last lines.
    A peer's failure is not what is measured; ddpjob's is a bug to see, never retried."""
    try:
        return measure(runner, command, cwd, warmup, last_step, threads)
    except RunFailed as failure:
        if runner == "ddpjob":
            raise
        print(
            f"round {round_number} {runner}: failed ({failure.how}), running it again once; its last lines:\n"
            + failure.tail,
            file=sys.stderr,
            flush=True,
        )
        retried.append({"round": round_number, "runner": runner, "failure": failure.how})
    return measure(runner, command, cwd, warmup, last_step, threads)


def prepare(
    workdir: Path, device: str, size: str, fast: bool, procs: int, steps: int, warmup: int
) -> tuple[dict, dict]:
    """The tokenizer (trained here, once), the peers' settings and the job spec of the trainer.

    `size`: a key of SHAPES and CORPORA. `fast`: bf16 autocast and torch.compile for all three; AdamW is
    fused for all three (as the trainer does).
    """
    shape = SHAPES[size]
    corpus = CORPORA[size]
    documents = read_texts(expand_paths(corpus, "training.data.train"), "text", "training.data.train")
    tokenizer = train_tokenizer(documents, shape["vocab_size"])
    tokenizer.save_pretrained(workdir / "tokenizer")
    settings = {
        "device": device,
        "procs": procs,
        "train": corpus,
        "tokenizer": str(workdir / "tokenizer"),
        "vocab": len(tokenizer),
        "layers": shape["layers"],
        "heads": shape["heads"],
        "embd": shape["embd"],
        "block": shape["block"],
        "batch": shape["batch"],
        "steps": steps,
        "warmup": warmup,
        "lr": 1e-3,
        "seed": 1337,
        "bf16": fast,
        "compile": fast,
    }
    (workdir / "settings.json").write_text(json.dumps(settings, indent=2))
    spec = {
        "name": "bench",
        "nodes": 1,
        "procsPerNode": procs,
        "training": {
            "task": "causal-lm",
            "model": {
                "nLayer": shape["layers"],
                "nHead": shape["heads"],
                "nEmbd": shape["embd"],
                "blockSize": shape["block"],
            },
            "tokenizer": {"path": settings["tokenizer"]},
            "data": {"train": corpus, "valFraction": 0.002},
            "optimizer": {"lr": settings["lr"], "weightDecay": 0.0},
            "schedule": {"warmupSteps": warmup},
            "precision": "bf16" if fast else "fp32",
            "compile": fast,
            "maxSteps": steps,
            "batchSize": shape["batch"],
            "gradClip": 1.0,
            # The peers print a step line without waiting for the device; a log line reads the
            # loss, which on a GPU waits for the step to finish, so there it logs at the default 10.
            "logEvery": 10 if device == "cuda" else 1,
            "seed": settings["seed"],
            "checkpoint": {"every": 0, "keepBest": False},
            "sample": {"maxNewTokens": 0},
        },
    }
    (workdir / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return settings, spec


def torchrun(workdir: Path, procs: int) -> list[str]:
    """Plain torchrun on this machine, its folder of error files in `workdir`: given none, it leaves one in /tmp."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
    return [*command, f"--log-dir={workdir / 'torchrun'}"]


def commands(workdir: Path, procs: int) -> dict[str, list[str]]:
    peers = str(REPO / "bench" / "peers.py")
    return {
        "ddpjob": [sys.executable, "-m", "ctl", "run", str(workdir / "spec.yaml"), "--run-dir", "RUN_DIR"],
        "reference": [*torchrun(workdir, procs), peers, "reference", "--workdir", str(workdir)],
        "hf-trainer": [*torchrun(workdir, procs), peers, "hf-trainer", "--workdir", str(workdir)],
    }


def in_turn(runners: dict[str, list[str]], round_number: int) -> list[tuple[str, list[str]]]:
    """A round's runners in the order they run: each round starts one runner further on, so that no runner is always
    the first (after the machine was idle, or on cold caches: ddpjob's first round on the H200) nor always after
    the same other."""
    order = list(runners.items())
    first = (round_number - 1) % len(order)
    return order[first:] + order[:first]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--fast",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 autocast + torch.compile for all three (default: on with CUDA, off on CPU)",
    )
    parser.add_argument("--procs", type=int, default=None, help="processes (default: 2 on CPU, every GPU on CUDA)")
    parser.add_argument(
        "--toy",
        action="store_true",
        help="a tiny model and corpus, 1 round of 20 steps: every code path in seconds (tests/test_bench.py)",
    )
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: 40 CPU, 120 CUDA)")
    parser.add_argument("--warmup", type=int, default=None, help="first steps left out (default: 5 CPU, 30 CUDA)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="A/B/C rounds; the median of each runner is reported (default: 5 CPU, 3 CUDA)",
    )
    args = parser.parse_args()
    cuda = args.device == "cuda"
    size = "toy" if args.toy else args.device
    procs = args.procs or (torch.cuda.device_count() if cuda else 2)
    steps = args.steps or LENGTHS[size]["steps"]
    warmup = args.warmup or LENGTHS[size]["warmup"]
    rounds = args.rounds or LENGTHS[size]["rounds"]

    retried: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ddpjob-bench-") as tmp:
        workdir = Path(tmp)
        fast = cuda if args.fast is None else args.fast
        settings, _ = prepare(workdir, args.device, size, fast, procs, steps, warmup)
        tokens_per_step = procs * settings["batch"] * settings["block"]
        runs: dict[str, list[Run]] = {}
        for round_index in range(rounds):
            for runner, command in in_turn(commands(workdir, procs), round_index + 1):
                command = [c.replace("RUN_DIR", str(workdir / f"run-{round_index}")) for c in command]
                run = measure_with_retry(runner, command, workdir, warmup, steps, round_index + 1, retried)
                runs.setdefault(runner, []).append(run)
                usage = run.usage_per_step()
                print(
                    f"round {round_index + 1} {runner:>10}: {run.tokens_per_second(tokens_per_step, warmup):9,.0f}"
                    f" tok/s, {run.wall:6.1f} s wall, {usage.cpu_seconds:.3f} CPU s/step,"
                    f" {usage.page_faults:,.0f} faults/step",
                    file=sys.stderr,
                    flush=True,
                )

    by_round = {r: [run.tokens_per_second(tokens_per_step, warmup) for run in rs] for r, rs in runs.items()}
    tokens_per_second = {r: statistics.median(values) for r, values in by_round.items()}
    usage = {r: [run.usage_per_step() for run in rs] for r, rs in runs.items()}
    cpu_per_step = {r: statistics.median(u.cpu_seconds for u in us) for r, us in usage.items()}
    faults_per_step = {r: statistics.median(u.page_faults for u in us) for r, us in usage.items()}
    wall = {r: statistics.median(run.wall for run in rs) for r, rs in runs.items()}
    peak_rss = {r: max(run.peak_rss for run in rs) for r, rs in runs.items()}
    result = {
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({os.cpu_count()} cores)",
        "processes": procs,
        "bf16_and_compile": settings["compile"],
        "steps": steps,
        "warmup_steps": warmup,
        "tokens_per_step": tokens_per_step,
        "tokens_per_second": {r: round(v, 1) for r, v in tokens_per_second.items()},
        "wall_seconds": {r: round(v, 2) for r, v in wall.items()},
        "peak_rss_mib": {r: round(v / 2**20) for r, v in peak_rss.items()},
        "cpu_seconds_per_step": {r: round(v, 4) for r, v in cpu_per_step.items()},
        "page_faults_per_step": {r: round(v) for r, v in faults_per_step.items()},
        "ratio_vs_reference": round(tokens_per_second["ddpjob"] / tokens_per_second["reference"], 3),
        "ratio_vs_hf_trainer": round(tokens_per_second["ddpjob"] / tokens_per_second["hf-trainer"], 3),
        "wall_ratio_vs_hf_trainer": round(wall["ddpjob"] / wall["hf-trainer"], 3),
        # Each round's runners ran back to back: their ratio is the one least touched by drift.
        "ratio_vs_reference_by_round": paired_ratios(by_round["ddpjob"], by_round["reference"]),
        "ratio_vs_hf_trainer_by_round": paired_ratios(by_round["ddpjob"], by_round["hf-trainer"]),
        # Tokens per CPU-second of all of a run's processes, ddpjob's over the peer's: the work each
        # does for a step. Where it parts from the tokens/s ratio, the difference is time spent waiting.
        "cpu_ratio_vs_reference": round(cpu_per_step["reference"] / cpu_per_step["ddpjob"], 3),
        "cpu_ratio_vs_hf_trainer": round(cpu_per_step["hf-trainer"] / cpu_per_step["ddpjob"], 3),
        "retried": retried,
    }
    if cuda:
        model_flops = flops_per_token_of(settings)
        peak = next((v for k, v in BF16_PEAK_FLOPS.items() if k in result["device"]), None)
        result["tokens_per_second_per_gpu"] = {r: round(v / procs, 1) for r, v in tokens_per_second.items()}
        if peak:
            result["mfu"] = {r: round(v / procs * model_flops / peak, 3) for r, v in tokens_per_second.items()}
        result["peak_gpu_memory_gib"] = {r: max(run.peak_gpu_memory_gib or 0.0 for run in rs) for r, rs in runs.items()}

    print(f"{'':>12} {'tokens/s':>10} {'wall s':>8} {'peak RSS MiB':>13} {'CPU s/step':>11} {'faults/step':>12}")
    for runner in runs:
        print(
            f"{runner:>12} {tokens_per_second[runner]:10,.0f} {wall[runner]:8.1f} {peak_rss[runner] / 2**20:13,.0f}"
            f" {cpu_per_step[runner]:11.3f} {faults_per_step[runner]:12,.0f}"
        )
    print(
        f"ddpjob / reference: {result['ratio_vs_reference']:.3f}x tokens/s"
        f" (rounds: {', '.join(f'{r:.3f}' for r in result['ratio_vs_reference_by_round'])});"
        f" ddpjob / hf-trainer: {result['ratio_vs_hf_trainer']:.3f}x tokens/s"
        f" (rounds: {', '.join(f'{r:.3f}' for r in result['ratio_vs_hf_trainer_by_round'])}),"
        f" {result['wall_ratio_vs_hf_trainer']:.3f}x wall time"
    )
    print(
        f"tokens per CPU-second (all of a run's processes): ddpjob / reference {result['cpu_ratio_vs_reference']:.3f}x,"
        f" ddpjob / hf-trainer {result['cpu_ratio_vs_hf_trainer']:.3f}x"
    )
    for retry in retried:
        print(f"retried: round {retry['round']} {retry['runner']}, which failed ({retry['failure']})")
    print(json.dumps(result))


def paired_ratios(ours: list[float], theirs: list[float]) -> list[float]:
    return [round(a / b, 3) for a, b in zip(ours, theirs, strict=True)]


def flops_per_token_of(settings: dict) -> float:
    """nanoGPT's 6N + 12·L·H·Q·T for the benchmark's model (built on the meta device: no memory)."""
    with torch.device("meta"):
        return flops_per_token(gpt2(settings), settings["block"])


if __name__ == "__main__":
    main()

"""ddpjob against a nanoGPT-style reference on nanoGPT's own "baby GPT on a CPU" benchmark.

The reference is written here after nanoGPT's design (not its code): one plain PyTorch GPT module
(fused qkv Linear, `scaled_dot_product_attention` with `is_causal`, tied embeddings, GELU MLP, GPT-2's
biases so that both models have the same parameters) and a minimal loop, run as `python bench/nanogpt.py
--worker SETTINGS` on 1 process and under torchrun (DDP, gloo) on more. ddpjob runs the equivalent job
spec with `ctl run`. Both train a character-level 4-layer, 4-head, 128-wide model, block 64, global batch
12, dropout 0, AdamW (lr 1e-3, betas 0.9/0.99, weight decay 0.1 on matrices), 100 warmup steps then
cosine to 1e-4 at the last step, clip 1.0, an evaluation every 250 steps, on ~1 MB of the standard
library's sources (90/10 split). The reference follows nanoGPT's loop: random-offset batches, an estimate
of the train and val loss from `eval_iters` batches at step 0 and every evaluation (rank 0 alone), a
checkpoint when it improves; ddpjob's periodic evaluations score as many batches (`evalBatches`). Both
end with the validation loss of the final model over the whole validation split in the same
non-overlapping blocks (the reference's over its ranks, as ddpjob's).

The data is prepared once (`ctl prepare`) before anything is timed and both read the same token file:
preparation is excluded on both sides. Runs are interleaved round after round, each round starting with the
runner that ran second in the one before, at 1 and 2 processes, with and without `training.compile` (nanoGPT's
`compile`); round r seeds both sides with 1336 + r, so that the final losses are compared over seeds rather than
on one. Threads are each runner's own choice (`ctl run` and torchrun set OMP_NUM_THREADS per process; one
process gets torch's default). Reported per configuration: wall time from start to exit (median over rounds)
and to the step N line, the final validation loss (mean over the rounds), the time to a target validation loss (first
evaluation at or below it; default: 1.02x the highest final loss of the configuration's runs), CPU s/step
of all of a run's processes, and the ratios ddpjob / reference.

    python bench/nanogpt.py                          # 2000 steps, 1 and 2 processes, compile off and on, 3 rounds
    python bench/nanogpt.py --procs 2 --no-compile --steps 500 --rounds 3
    python bench/nanogpt.py --toy                    # every code path but compile's in seconds, one thread
                                                     # a process (tests)

Prints one line per run, a table, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.throughput import Run, in_turn, measure_with_retry, torchrun  # noqa: E402

# About 1 MB of the standard library's sources (in every CPython 3.10-3.13); the toy's 48 KB.
CORPORA = {
    "full": ["{stdlib}/asyncio/*.py", "{stdlib}/email/*.py", "{stdlib}/logging/*.py"],
    "toy": ["{stdlib}/json/*.py"],
}
LENGTHS = {
    # Three rounds, so three seeds: one round decides nothing here. A round's wall time ratio at 1 process was 0.79x in
    # one invocation, 0.91x to 1.06x in another, and seed 1337's final loss is above the reference's where the mean over
    # three seeds is below it (docs/performance.md). 24 runs of 2000 steps, about 40 minutes: most of `make bench`.
    "full": {"steps": 2000, "eval_every": 250, "eval_iters": 20, "log_every": 10, "rounds": 3},
    # Its CPU s/step is timed between the lines of steps 10 and 40, about 1 s apart. ddpjob's lines come through
    # torchrun's reads of the workers' logs, every 0.1 s, and two lines in one read would time nothing.
    "toy": {"steps": 40, "eval_every": 10, "eval_iters": 2, "log_every": 5, "rounds": 1},
}
MODEL = {"layers": 4, "heads": 4, "width": 128, "block": 64}
GLOBAL_BATCH = 12
OPTIMIZER = {"lr": 1e-3, "min_lr": 1e-4, "warmup": 100, "betas": (0.9, 0.99), "weight_decay": 0.1, "clip": 1.0}
VAL_FRACTION = 0.1
SEED = 1337


# --- The reference: nanoGPT's design --------------------------------------------------------------


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time_, width = x.shape
        q, k, v = (
            t.view(batch, time_, self.heads, width // self.heads).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(batch, time_, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block: int, layers: int, heads: int, width: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                # GPT-2's scaled init of the projections into the residual stream
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of the next-token predictions."""
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def lr_at(step: int, steps: int) -> float:
    """Linear warmup, then cosine down to min_lr at the last step."""
    lr, min_lr, warmup = OPTIMIZER["lr"], OPTIMIZER["min_lr"], OPTIMIZER["warmup"]
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - 1 - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def reference(settings: dict[str, Any]) -> None:
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    master = rank == 0
    torch.manual_seed(settings["seed"] + rank)
    tokens = np.memmap(settings["tokens"], dtype=settings["dtype"], mode="r", shape=(settings["count"],))
    cut = int(len(tokens) * (1 - VAL_FRACTION))
    splits = {"train": tokens[:cut], "val": tokens[cut:]}
    block, batch = MODEL["block"], GLOBAL_BATCH // world

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        data = splits[split]
        starts = torch.randint(len(data) - block, (batch,)).tolist()
        x = torch.stack([torch.from_numpy(data[i : i + block].astype(np.int64)) for i in starts])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block].astype(np.int64)) for i in starts])
        return x, y

    model = GPT(settings["vocab"], block, MODEL["layers"], MODEL["heads"], MODEL["width"])
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": OPTIMIZER["weight_decay"]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=OPTIMIZER["lr"],
        betas=OPTIMIZER["betas"],
    )
    forward = torch.compile(model) if settings["compile"] else model
    if distributed:
        forward = DDP(forward)

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        model.eval()
        iters = settings["eval_iters"]
        losses = {split: sum(model(*get_batch(split)).item() for _ in range(iters)) / iters for split in splits}
        model.train()
        return losses

    steps, best = settings["steps"], math.inf
    for step in range(steps + 1):
        if step % settings["eval_every"] == 0 and master:
            losses = estimate_loss()
            print(f"eval {step} | train loss {losses['train']:.4f} | val loss {losses['val']:.4f}", flush=True)
            if step and losses["val"] < best:
                best = losses["val"]
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "best": best}
                torch.save(state, Path(settings["out"]) / "ckpt.pt")
        if step == steps:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps)
        loss = forward(*get_batch("train"))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIMIZER["clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if ((step + 1) % settings["log_every"] == 0 or step + 1 == steps) and master:
            print(f"step {step + 1} | loss {loss.item():.4f}", flush=True)
    print_final_loss(model, splits["val"], rank, world, batch)
    if distributed:
        dist.destroy_process_group()


@torch.no_grad()
def print_final_loss(model: GPT, val: np.ndarray, rank: int, world: int, batch: int) -> None:
    """Over the whole split in non-overlapping blocks, sharded over the ranks, as ddpjob evaluates."""
    model.eval()
    block = MODEL["block"]
    windows = list(range(rank, (len(val) - 1) // block, world))
    total = torch.zeros(2, dtype=torch.float64)
    for first in range(0, len(windows), batch):
        starts = [w * block for w in windows[first : first + batch]]
        x = torch.stack([torch.from_numpy(val[s : s + block].astype(np.int64)) for s in starts])
        y = torch.stack([torch.from_numpy(val[s + 1 : s + 1 + block].astype(np.int64)) for s in starts])
        total += torch.tensor([model(x, y).item() * y.numel(), y.numel()], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(total)
    if rank == 0:
        print(f"final | val loss {total[0] / total[1]:.4f}", flush=True)


# --- The driver --------------------------------------------------------------------------------


def job_spec(workdir: Path, size: str, procs: int, compile_: bool, steps: int, seed: int = SEED) -> dict[str, Any]:
    """The reference's settings as a ddpjob spec, as a user would write it."""
    lengths = LENGTHS[size]
    return {
        "name": "nanogpt",
        "nodes": 1,
        "procsPerNode": procs,
        "training": {
            "task": "char-gpt",
            "model": {
                "nLayer": MODEL["layers"],
                "nHead": MODEL["heads"],
                "nEmbd": MODEL["width"],
                "blockSize": MODEL["block"],
                "dropout": 0.0,
            },
            "data": {"train": CORPORA[size], "valFraction": VAL_FRACTION, "cacheDir": str(workdir / "datasets")},
            "optimizer": {
                "lr": OPTIMIZER["lr"],
                "weightDecay": OPTIMIZER["weight_decay"],
                "betas": list(OPTIMIZER["betas"]),
            },
            "schedule": {"warmupSteps": OPTIMIZER["warmup"], "minLrRatio": OPTIMIZER["min_lr"] / OPTIMIZER["lr"]},
            "compile": compile_,
            "maxSteps": steps,
            "batchSize": GLOBAL_BATCH // procs,
            "gradClip": OPTIMIZER["clip"],
            "evalEvery": lengths["eval_every"],
            "evalBatches": lengths["eval_iters"],  # nanoGPT's estimate; the final evaluation is whole either way
            "logEvery": lengths["log_every"],
            "seed": seed,
            # nanoGPT keeps the best checkpoint, written at an evaluation that improved; its script samples nothing.
            "checkpoint": {"every": lengths["eval_every"], "keepLast": 1},
            "sample": {"maxNewTokens": 0},
        },
    }


def prepare(workdir: Path, size: str) -> dict[str, Any]:
    """`ctl prepare` once, untimed: the dataset both runners read; the reference's settings point at its tokens."""
    spec = workdir / "prepare.yaml"
    spec.write_text(yaml.safe_dump(job_spec(workdir, size, 1, False, 1)))
    command = [sys.executable, "-m", "ctl", "prepare", str(spec), "--run-dir", str(workdir / "prepare-run")]
    entry = Path(subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    manifest = json.loads((entry / "manifest.json").read_text())
    return {
        "tokens": str(entry / "train.bin"),
        "dtype": manifest["dtype"],
        "count": manifest["splits"]["train"]["tokens"],
        "vocab": len(manifest["chars"]) + 1,  # ddpjob's characters and its one special token
    }


def round_files(workdir: Path, name: str, round_number: int) -> tuple[Path, Path]:
    """A round's ddpjob spec and the reference's settings (each round has its own seed)."""
    return workdir / f"{name}-{round_number}.yaml", workdir / f"{name}-{round_number}.json"


def commands(workdir: Path, name: str, procs: int, round_number: int) -> dict[str, list[str]]:
    spec, settings = round_files(workdir, name, round_number)
    worker = [str(Path(__file__).resolve()), "--worker", str(settings)]
    # A run directory per round: in the last one's, `ctl run` would resume the finished run and train nothing.
    run_dir = workdir / "runs" / f"{name}-{round_number}"
    return {
        "ddpjob": [sys.executable, "-m", "ctl", "run", str(spec), "--run-dir", str(run_dir)],
        "reference": [*torchrun(workdir, procs), *worker] if procs > 1 else [sys.executable, *worker],
    }


def summary(runs: list[Run], steps: int, target: float) -> dict[str, Any]:
    reached = [next((t for t, loss in run.val_losses if loss <= target), math.inf) for run in runs]
    return {
        "wall_seconds": statistics.median(run.wall for run in runs),
        "seconds_to_last_step": statistics.median(run.step_times[steps] for run in runs),
        "final_val_loss": statistics.mean(run.val_losses[-1][1] for run in runs),  # over the rounds' seeds
        "seconds_to_target": statistics.median(reached),
        "cpu_seconds_per_step": statistics.median(run.usage_per_step().cpu_seconds for run in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # the reference's training run
    parser.add_argument("--toy", action="store_true", help="48 KB, 40 steps, 1 round, no compile (tests)")
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="process counts (default: 1 2)")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="only with (or only without) training.compile; default both (none with --toy)",
    )
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default 2000)")
    parser.add_argument("--rounds", type=int, help="ddpjob/reference rounds per configuration (default 3; --toy 1)")
    parser.add_argument(
        "--threads",
        type=int,
        help="OMP_NUM_THREADS of every process (default: each runner's choice; 1 with --toy, which then takes"
        " seconds even on a loaded machine)",
    )
    parser.add_argument("--target-loss", type=float, help="validation loss to time (default: see above)")
    args = parser.parse_args()
    if args.worker:
        reference(json.loads(args.worker.read_text()))
        return
    # nanoGPT's CPU benchmark: both on the CPU, also on a machine with a GPU, where the trainer would take it.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    size = "toy" if args.toy else "full"
    lengths = LENGTHS[size]
    steps, rounds = args.steps or lengths["steps"], args.rounds or lengths["rounds"]
    threads = 1 if args.toy else args.threads
    compiles = [args.compile] if args.compile is not None else [False] if args.toy else [False, True]
    results, retried = [], []
    with tempfile.TemporaryDirectory(prefix="ddpjob-nanogpt-") as tmp:
        workdir = Path(tmp)
        data = prepare(workdir, size)
        for procs in args.procs:
            for compile_ in compiles:
                name = f"p{procs}-{'compile' if compile_ else 'eager'}"
                out = workdir / "runs" / f"{name}-reference"
                out.mkdir(parents=True)
                runs: dict[str, list[Run]] = {"ddpjob": [], "reference": []}
                for round_number in range(1, rounds + 1):
                    # Each round its own seed, the same on both sides: the final loss is compared over seeds.
                    seed = SEED + round_number - 1
                    spec, settings = round_files(workdir, name, round_number)
                    spec.write_text(yaml.safe_dump(job_spec(workdir, size, procs, compile_, steps, seed)))
                    fields = {"compile": compile_, "steps": steps, "out": str(out), "seed": seed}
                    settings.write_text(json.dumps(data | lengths | fields))
                    for runner, command in in_turn(commands(workdir, name, procs, round_number), round_number):
                        warmup = lengths["log_every"]
                        run = measure_with_retry(
                            runner, command, workdir, warmup, steps, round_number, retried, threads
                        )
                        runs[runner].append(run)
                        print(
                            f"{name} round {round_number} {runner:>9}: {run.wall:7.1f} s wall, final val loss"
                            f" {run.val_losses[-1][1]:.4f}, load {os.getloadavg()[0]:.2f}",
                            file=sys.stderr,
                            flush=True,
                        )
                target = args.target_loss or 1.02 * max(run.val_losses[-1][1] for rs in runs.values() for run in rs)
                ours, theirs = summary(runs["ddpjob"], steps, target), summary(runs["reference"], steps, target)
                results.append(
                    {"configuration": name, "target_loss": round(target, 4), "ddpjob": ours, "reference": theirs}
                    | {f"{key}_ratio": ratio(ours[key], theirs[key]) for key in ours}
                )
    print(f"{'':>14} {'wall s':>14} {'to step N s':>14} {'final val':>14} {'to target s':>14} {'CPU s/step':>14}")
    for result in results:
        cells = [
            f"{result['ddpjob'][key]:6.3g}/{result['reference'][key]:<6.3g}{times(result[f'{key}_ratio'])}"
            for key in ("wall_seconds", "seconds_to_last_step", "final_val_loss", "seconds_to_target")
        ]
        print(f"{result['configuration']:>14} {' '.join(cells)} {times(result['cpu_seconds_per_step_ratio'])}")
    print("(each cell: ddpjob / reference, then the ratio)")
    for retry in retried:
        print(f"retried: round {retry['round']} {retry['runner']}, which failed ({retry['failure']})")
    load = os.getloadavg()
    print(json.dumps({"steps": steps, "rounds": rounds, "load": load, "results": results, "retried": retried}))


def times(value: float | None) -> str:
    return f"{value:>6.3f}x" if value is not None else "     -"


def ratio(ours: float, theirs: float) -> float | None:
    """ddpjob's over the reference's; None where either never reached the target."""
    return round(ours / theirs, 3) if math.isfinite(ours) and math.isfinite(theirs) and theirs else None


if __name__ == "__main__":
    main()

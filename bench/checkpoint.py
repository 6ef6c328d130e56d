"""What a checkpoint costs training: the time to save one, and the stall per checkpoint, synchronous vs async.

A synchronous save stalls training for the whole write (every file fsynced, marker, rename).
An asynchronous one stalls it only while the state is copied to CPU memory; a background
thread writes the copy while training goes on (which it slows down meanwhile, by sharing the
CPU: reported too). Both through the trainer's own Checkpointer,
on the GPT-2 124M shape with AdamW state (about 1.5 GB on disk), in one process:

    python bench/checkpoint.py [--layers 12 --embd 768 --repeats 2 --dir /path/on/the/target/disk]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.peers import gpt2  # noqa: E402
from trainer.checkpoint import Checkpointer, TrainerState  # noqa: E402
from trainer.dist import Dist  # noqa: E402
from trainer.spec import CheckpointSpec  # noqa: E402


def trained_state(layers: int, embd: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    """The model after one AdamW step, so the optimizer holds its moments as in any real save."""
    model = gpt2({"vocab": 50257, "block": 1024, "layers": layers, "heads": max(1, embd // 64), "embd": embd})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(input_ids=torch.zeros(1, 8, dtype=torch.long), labels=torch.zeros(1, 8, dtype=torch.long)).loss.backward()
    optimizer.step()
    return model, optimizer, torch.amp.GradScaler("cpu", enabled=False)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A small stand-in for training: forward, backward and AdamW on a short batch."""
    ids = torch.randint(0, 1000, (1, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def seconds(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--embd", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    model, optimizer, scaler = trained_state(args.layers, args.embd)
    dist = Dist(0, 0, 1, torch.device("cpu"))
    step_seconds = statistics.median(seconds(lambda: train_step(model, optimizer)) for _ in range(5))
    stalls: dict[str, list[float]] = {"sync": [], "async": []}
    slowdowns: list[float] = []
    writes: dict[str, list[float]] = {"sync": [], "async": []}  # each save's own duration, by mode
    with tempfile.TemporaryDirectory(prefix="ddpjob-bench-", dir=args.dir) as tmp:
        for mode in ("sync", "async"):
            spec = CheckpointSpec(keepLast=1, keepBest=False, asyncSave=mode == "async")
            checkpoints = Checkpointer(Path(tmp) / mode, spec, dist, {})
            checkpoints.run_dir.mkdir()
            state = TrainerState()
            checkpoints.attach(model, optimizer, scaler, state)
            # The first save of each kind is a warm-up (for async: it allocates the CPU staging buffers).
            for step in range(args.repeats + 1):
                state.step = step
                stall = seconds(checkpoints.save)
                if mode == "async":
                    # Training goes on while the copy is written: how much slower is it meanwhile?
                    steps = max(3, math.ceil(3 * statistics.median(writes["sync"]) / step_seconds))
                    slowdown = seconds(lambda n=steps: [train_step(model, optimizer) for _ in range(n)])
                    slowdown -= steps * step_seconds
                checkpoints.wait()
                assert checkpoints.last_save is not None
                if step:
                    stalls[mode].append(stall)
                    writes[mode].append(checkpoints.last_save.seconds)
                    if mode == "async":
                        slowdowns.append(max(0.0, slowdown))
            size = checkpoints.last_save.size_bytes
    sync, background, slowdown = (statistics.median(v) for v in (stalls["sync"], stalls["async"], slowdowns))
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.0f}M parameters; checkpoint: {size / 2**30:.2f} GiB")
    save, background_save = statistics.median(writes["sync"]), statistics.median(writes["async"])
    print(f"save (write + fsync + commit): {save:.2f} s; {background_save:.2f} s in the background, beside training")
    print(
        f"training stall per checkpoint: sync {sync:.2f} s, async {background:.3f} s ({background / sync:.1%} of sync)"
    )
    print(f"async: training meanwhile slower by {slowdown:.2f} s in all (the write shares the CPU cores)")
    result = {
        "parameters": params,
        "checkpoint_bytes": size,
        "save_seconds": round(save, 3),
        "background_save_seconds": round(background_save, 3),
        "stall_seconds": {"sync": round(sync, 3), "async": round(background, 3)},
        "async_stall_ratio": round(background / sync, 3),
        "async_slowdown_seconds": round(slowdown, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""What the metrics cost a training step, against the step itself, both measured in this run.

Per step the loop makes one next() through TrainingMetrics.timed and one step_done();
every logEvery steps one logged(). Timed here in multiprocess mode (the memory-mapped
files a pod uses), against one optimizer step (forward, backward, clip, AdamW) of the
quickstart model on this machine, in one process:

    python bench/metrics_overhead.py [--spec examples/quickstart.yaml]

Prints the two times, their ratio, and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# prometheus_client picks its multiprocess mode at import, from the environment (as in a pod).
os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="ddpjob-bench-")
os.environ.pop("DDPJOB_METRICS_PORT", None)
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

from ctl.spec import load_spec  # noqa: E402
from trainer.dist import Dist  # noqa: E402
from trainer.metrics import TrainingMetrics  # noqa: E402
from trainer.models import build_char_gpt  # noqa: E402

VOCAB = 100


def train_step_seconds(
    model: torch.nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer, steps: int
) -> float:
    """Median wall time of one optimizer step on a fixed batch."""
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        logits = model(input_ids=batch[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def metrics_seconds_per_step(metrics: TrainingMetrics, log_every: int, steps: int) -> float:
    """Mean wall time of the metrics calls the loop makes per step, log steps included."""
    batches = metrics.timed(iter(range(steps)))
    started = time.perf_counter()
    for step in batches:
        metrics.step_done(step + 1, 0.05, samples=16, tokens=2048)
        if step % log_every == 0:
            metrics.logged(loss=2.0, lr=1e-3, grad_norm=0.5, tokens_per_second=20_000.0)
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=REPO / "examples" / "quickstart.yaml")
    args = parser.parse_args()
    spec = load_spec(args.spec).training
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = build_char_gpt(spec.model, VOCAB, VOCAB - 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, VOCAB, (spec.batch_size, spec.model.block_size + 1))
    train_step_seconds(model, batch, optimizer, steps=3)  # warm up
    step = train_step_seconds(model, batch, optimizer, steps=20)
    metrics = TrainingMetrics(spec, Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")), model, 500)
    metrics_seconds_per_step(metrics, spec.log_every, steps=1000)  # warm up
    overhead = metrics_seconds_per_step(metrics, spec.log_every, steps=20_000)
    print(f"train step ({args.spec.name}, {torch.get_num_threads()} threads): {step * 1e3:.2f} ms")
    print(f"metrics per step (multiprocess files, logEvery {spec.log_every}): {overhead * 1e6:.1f} us")
    print(f"overhead: {overhead / step:.4%} of a step")
    print(
        json.dumps(
            {
                "train_step_seconds": round(step, 6),
                "metrics_seconds_per_step": round(overhead, 9),
                "overhead_ratio": round(overhead / step, 7),
            }
        )
    )
    shutil.rmtree(os.environ["PROMETHEUS_MULTIPROC_DIR"])


if __name__ == "__main__":
    main()

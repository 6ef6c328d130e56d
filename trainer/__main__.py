"""Entry point: `python -m trainer.launch -m trainer --config /etc/ddpjob/training.yaml` (torchrun).

Exit codes: 0 done, 1 error (traceback in TORCHELASTIC_ERROR_FILE), 2 bad input
(spec or data: one line naming the key and the problem), 143 stopped by SIGTERM after
saving a checkpoint (128 + 15: what a terminated process reports); the next start
resumes from it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import transformers
from torch.distributed.elastic.multiprocessing.errors import record

from trainer.checkpoint import Checkpointer
from trainer.dist import Dist, barrier, init_distributed, shutdown
from trainer.launch import EXIT_PREEMPTED
from trainer.loop import train
from trainer.metrics import metrics_endpoint
from trainer.rundir import export_final, prepare_run_dir, remove_if_empty, write_report
from trainer.spec import SpecError, TrainingSpec, load_training_spec
from trainer.tasks import load

EXIT_BAD_INPUT = 2


def run(spec: TrainingSpec, dist: Dist) -> int:
    """Train (or resume), evaluate and export; returns the process exit code."""

    def log(message: str) -> None:
        if dist.is_main:
            print(message, flush=True)

    # Every process says where it runs: the one line of a non-zero rank's log, for matching ranks to pods and devices.
    print(f"rank {dist.rank} of {dist.world_size} on {socket.gethostname()} ({dist.device})", flush=True)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    run_dir = Path(spec.checkpoint.dir or Path("runs") / spec.task).absolute()
    created = [path for path in (run_dir, *run_dir.parents) if not path.exists()] if dist.is_main else []
    if dist.is_main:
        prepare_run_dir(run_dir)
    try:
        torch.manual_seed(spec.seed)
        task, work = load(spec, dist, run_dir)
    except SpecError:
        remove_if_empty(created)  # bad data: leave nothing behind
        raise
    params = sum(p.numel() for p in work.model.parameters())
    log(f"{spec.task}: {type(work.model).__name__}, {params:,} parameters, vocabulary of {len(work.tokenizer)}")

    checkpoints = Checkpointer(run_dir, spec.checkpoint, dist, spec.to_values())
    checkpoints.clean()
    result = train(spec, dist, work.model, work.train, work.val, work.collate, checkpoints, log)
    if result.preempted:
        log(f"exiting with code {EXIT_PREEMPTED}; the next start resumes from the checkpoint")
        return EXIT_PREEMPTED
    report = task.final_report(spec, dist, work, log) | {
        "train_loss": result.train_loss,
        "steps": result.steps,
        "epochs": result.epochs,
        "samples": result.samples,
        "tokens": result.tokens,
        "world_size": dist.world_size,
        "train_seconds": result.seconds,
    }
    if dist.device.type == "cuda":
        report["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated(dist.device) / 2**30, 2)
        log(f"peak GPU memory {report['peak_gpu_memory_gib']:.2f} GiB (rank 0)")
    if dist.is_main:
        export_final(run_dir, work.model, work.tokenizer)
        write_report(run_dir, report)
        task.sample(spec, work, log)
        log(f"run directory: {run_dir}")
    barrier()
    return 0


def record_bad_input(message: str) -> None:
    """Tell torchrun (and through it `ctl run`) the one-line reason; a traceback would only be noise."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        extra = {"py_callstack": message, "timestamp": str(int(time.time()))}
        Path(error_file).write_text(json.dumps({"message": {"message": message, "extraInfo": extra}}))


@record
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="training.yaml (the spec's training: section)")
    args = parser.parse_args(argv)
    try:
        spec = load_training_spec(args.config)
        metrics_endpoint()  # a bad metrics environment fails here, before any work
        dist = init_distributed()
        try:
            code = run(spec, dist)
        finally:
            shutdown()
    except SpecError as exc:
        record_bad_input(str(exc))
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()

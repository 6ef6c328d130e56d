"""Entry point: `python -m trainer.launch -m trainer --config /etc/ddpjob/training.yaml` (torchrun).

Exit codes: 0 done, 1 error (traceback in TORCHELASTIC_ERROR_FILE; one line when the data
was never prepared, trainer.workloads.PreparationFailed, or the loss went non-finite on every
rank, trainer.loop.NonFiniteLoss), 2 bad input
(spec or data: one line naming the key and the problem), 143 stopped by SIGTERM after
saving a checkpoint (128 + 15: what a terminated process reports); the next start
resumes from it. 200 (EXIT_HUNG): the watchdog found the job hung (trainer.watchdog);
retryable too, the next start resumes from the last checkpoint. Rank 0's progress goes to
stdout; everything else (every rank's own line, warnings, errors) to stderr.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
import time
from pathlib import Path
from typing import NoReturn

gc.disable()  # while torch imports: trainer/heap.py
# transformers, where a task imports it, reads these then: errors only, and no progress bars.
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from trainer.checkpoint import MARKER, Checkpointer
from trainer.compiler import check_compiler
from trainer.dist import Dist, barrier, init_distributed, shutdown
from trainer.failures import Failure, write_record
from trainer.heap import resume_collection
from trainer.loop import NonFiniteLoss, Trainer
from trainer.metrics import clear_shared_directory, metrics_endpoint
from trainer.names import EXIT_BAD_INPUT, EXIT_ERROR, EXIT_PREEMPTED
from trainer.quick_exit import quick_exit
from trainer.rundir import export_final, prepare_run_dir, publish, remove_created, restore_run_ids, write_report
from trainer.spec import SpecError, TrainingSpec, load_training_spec
from trainer.storage import S3Store, StorageUnreachable, run_dir_of
from trainer.tasks import load
from trainer.tracking import Tracker, TrackerUnreachable, check_installed, finish
from trainer.workloads import PreparationFailed, check_resumed_data, record_dataset

resume_collection()


def run(spec: TrainingSpec, dist: Dist) -> int:
    """Train (or resume), evaluate and export; returns the process exit code."""

    def log(message: str) -> None:
        if dist.is_main:
            print(message, flush=True)

    # Every process says where it runs, for matching ranks to pods and devices. On stderr: stdout stays rank 0's
    # progress, which starts only once the inputs are accepted (bad input is one line, and nothing else).
    print(
        f"rank {dist.rank} of {dist.world_size} on {socket.gethostname()} ({dist.device})", file=sys.stderr, flush=True
    )
    clear_shared_directory(dist)
    run_dir = run_dir_of(spec.checkpoint, spec.task)
    checkpoints = Checkpointer(run_dir, spec.checkpoint, dist, spec.to_values())
    if isinstance(checkpoints.store, S3Store):  # every rank reads the bucket; rank 0 also writes to it
        checkpoints.store.check(writable=dist.is_main)
    # Before anything touches the run directory (the write test, the dataset record): a refusal leaves it as it was.
    checkpoints.check_settings()
    check_resumed_data(spec, run_dir)
    created = [path for path in (run_dir, *run_dir.parents) if not path.exists()] if dist.is_main else []
    try:
        if dist.is_main:
            prepare_run_dir(run_dir)
            restore_run_ids(run_dir, checkpoints.store)
        torch.manual_seed(spec.seed)
        task, work = load(spec, dist, run_dir)
        # Once the data is accepted, before anything is recorded or said: W&B without its API key is bad input too.
        tracker = Tracker(spec, dist.is_main, run_dir)
    except SpecError:
        remove_created(created)  # a full disk, bad data: leave nothing behind
        raise
    if dist.is_main:
        record_dataset(work, run_dir)
    for name in checkpoints.clean():
        log(f"removed {name}: not a complete checkpoint ({MARKER} missing, or a file it lists missing or cut short)")
    params = sum(p.numel() for p in work.model.parameters())
    log(f"{spec.task}: {type(work.model).__name__}, {params:,} parameters, vocabulary of {len(work.tokenizer)}")
    result = Trainer(spec, dist, work, checkpoints, tracker, log).train()
    if result.final_eval is None:  # preempted: see TrainResult
        if dist.is_main:  # on object storage, the events so far (the export and report do not exist yet)
            publish(run_dir, checkpoints.store)
        log(f"exiting with code {EXIT_PREEMPTED}; the next start resumes from the checkpoint")
        return EXIT_PREEMPTED
    report = task.final_report(spec, dist, work, log, result.final_eval) | {
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
        publish(run_dir, checkpoints.store)
        task.sample(spec, work, log)
        log(f"run directory: {checkpoints.store.describe()}")
    barrier(dist)
    return 0


def exit_with(code: int, message: str, everywhere: bool = False) -> NoReturn:
    """Tell torchrun (and through it `ctl run`) the one-line reason, then exit; a traceback would only be noise."""
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        rank = int(os.environ.get("RANK", "0"))
        write_record(Path(error_file), Failure(code, message, time.time(), rank, everywhere=everywhere))
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


@record
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    parser.add_argument("--config", required=True, type=Path, help="training.yaml (the spec's training: section)")
    args = parser.parse_args(argv)
    try:
        spec = load_training_spec(args.config)
        metrics_endpoint()  # a bad metrics environment fails here, before any work
        check_installed(spec)  # so does a tracker that reportTo names but nothing installed
        dist = init_distributed(spec.timeouts)
        if spec.compile:  # a compiler torch.compile can use, before the data and the model load
            check_compiler(dist.device)
        code = run(spec, dist)
    except SpecError as exc:
        exit_with(EXIT_BAD_INPUT, str(exc))
    except PreparationFailed as exc:  # the data was not prepared, and waiting longer will not change that
        exit_with(EXIT_ERROR, str(exc))
    except (StorageUnreachable, TrackerUnreachable) as exc:  # a server did not answer: a later start may find it
        exit_with(EXIT_ERROR, str(exc))
    except NonFiniteLoss as exc:  # every rank stops on it at the same step
        exit_with(EXIT_ERROR, str(exc), everywhere=True)
    finish(code)  # the MLflow/W&B run ends with this outcome (an exception ends it failed, at exit)
    # Only after a success: on a failure the peers learn of it when this process exits, after its record is
    # written (here or by @record), so that their "connection closed by peer" never comes before the cause.
    shutdown()
    quick_exit(code)


if __name__ == "__main__":
    main()

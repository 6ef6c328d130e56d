"""Data preparation's entry: `ctl prepare` and the chart's prepare Job (`python -m trainer.prepare`), and the
interface the trainer and `ctl` use. Torch-free.

The parts, one responsibility each (trainer/preparation/): `plan` (what to prepare and where: the fingerprint,
the dataset directory, its manifest), `readers` (documents as a stream), `encode` (the tokenizing pool),
`progress` (the terminal, the prepare Job's progress file, `ddpjob_prepare_*`) and `build` (the files, written
in a staging directory and renamed into place).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from trainer.names import EXIT_BAD_INPUT, EXIT_ERROR, EXIT_PREEMPTED, METRICS_HOST_ENV, METRICS_PORT_ENV
from trainer.preparation.build import Builder, worker_count
from trainer.preparation.encode import fast_malloc
from trainer.preparation.plan import MANIFEST, TOKENIZER_DIR, Plan, make_plan, read_manifest
from trainer.preparation.progress import PrepareMetrics
from trainer.preparation.readers import read_texts
from trainer.spec import SpecError, TrainingSpec, load_training_spec
from trainer.storage import StorageUnreachable, run_dir_of
from trainer.text import load_tokenizer

__all__ = [
    "MANIFEST",
    "TOKENIZER_DIR",
    "Builder",
    "Plan",
    "PrepareMetrics",
    "failure_record",
    "fast_malloc",
    "make_plan",
    "prepare_spec",
    "read_manifest",
    "read_texts",
    "worker_count",
]


def prepare_spec(spec: TrainingSpec, run_dir: Path, log: Callable[[str], None], for_job: bool = False) -> Plan:
    """`ctl prepare` and the chart's prepare Job: the spec's dataset in its cache, prepared unless already there.

    `for_job`: the prepare Job's, which training pods wait for: its progress (Plan.progress_path) shows them it is
    alive, and its failure's line (Plan.error_path) is what they exit with: 2 for bad data, else 1.
    """
    builtin = None
    if spec.data.builtin:
        from trainer import stdlib_docstrings

        builtin = stdlib_docstrings.build(run_dir / "data" / spec.data.builtin)
    source = spec.tokenizer.path or spec.model.pretrained
    key = "training.tokenizer.path" if spec.tokenizer.path else "training.model.pretrained"
    tokenizer = load_tokenizer(source, key) if source else None
    plan = make_plan(spec, run_dir, tokenizer, builtin)
    # A previous attempt's (or submission's) failure: this one's outcome is not known yet, or the data is prepared.
    plan.error_path.unlink(missing_ok=True)
    manifest = read_manifest(plan)
    if manifest is not None:
        log(f"already prepared: {plan.entry}")
        return plan
    workers = worker_count(spec.data)
    log(f"preparing {plan.entry} with {workers} process(es)")
    port = int(os.environ.get(METRICS_PORT_ENV) or 0)
    heartbeat = plan.progress_path if for_job else None
    if heartbeat is not None:
        heartbeat.parent.mkdir(parents=True, exist_ok=True)
    try:
        with PrepareMetrics.serving(port, os.environ.get(METRICS_HOST_ENV) or "0.0.0.0") as metrics:
            manifest = Builder(plan, tokenizer, workers, log, metrics, heartbeat).build()
    except Exception as exc:
        if for_job:  # the waiting ranks fail at once with this line instead of waiting for progress that never comes
            plan.error_path.write_text(failure_record(exc), encoding="utf-8")
        raise
    finally:
        if heartbeat is not None:
            heartbeat.unlink(missing_ok=True)
    splits = manifest["splits"].items()
    counts = ", ".join(f"{split} {c['tokens']:,} tokens / {c['documents']:,} docs" for split, c in splits)
    log(f"prepared {plan.entry} in {manifest['seconds']:.1f} s: {counts} ({manifest['dtype']})")
    return plan


def failure_record(exc: BaseException) -> str:
    """A failed preparation's outcome as trainer.workloads.wait_for reads it (from the prepare Job's error file, or
    from rank 0 through the store): `error <line>` for bad data, else `failed <exception>: <its first line>`."""
    if isinstance(exc, SpecError):
        return f"error {exc}"
    lines = str(exc).splitlines()
    return f"failed {type(exc).__name__}: {lines[0]}" if lines else f"failed {type(exc).__name__}"


class Stopped(BaseException):
    """SIGTERM: not an Exception, so that no failure is recorded for the waiting ranks (the Job's next pod prepares)."""


def stop(signum: int, frame: object) -> NoReturn:
    raise Stopped(signum)


def main(argv: list[str] | None = None) -> None:
    """The chart's prepare Job: `python -m trainer.prepare --config /etc/ddpjob/training.yaml`."""
    parser = argparse.ArgumentParser(prog="python -m trainer.prepare", description=prepare_spec.__doc__)
    parser.add_argument("--config", required=True, type=Path, help="training.yaml (the spec's training: section)")
    args = parser.parse_args(argv)
    # Without a handler a deleted or evicted Job's pod would end with its staging directory left behind (or, as a
    # container's PID 1, ignore the signal until SIGKILL: trainer/launch.py). Stopped, the pool, the staging
    # directory and the progress file are cleaned up as on any error.
    signal.signal(signal.SIGTERM, stop)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        spec = load_training_spec(args.config)
        run_dir = run_dir_of(spec.checkpoint, spec.task)
        prepare_spec(spec, run_dir, log, for_job=True)
    except SpecError as exc:
        log(f"error: {exc}")
        sys.exit(EXIT_BAD_INPUT)
    except StorageUnreachable as exc:  # not bad data: the Job's next try may reach the server
        log(f"error: {exc}")
        sys.exit(EXIT_ERROR)
    except Stopped:
        log(f"trainer.prepare: stopped by SIGTERM, nothing kept; the next start prepares again (exit {EXIT_PREEMPTED})")
        sys.exit(EXIT_PREEMPTED)


if __name__ == "__main__":
    main()

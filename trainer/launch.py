"""torchrun, except that a pod stopped to be resumed exits 143 (128 + SIGTERM), not 1.

Every pod (and every `ctl run` node) runs `python -m trainer.launch -m trainer --config FILE`,
which takes torchrun's arguments and `PET_*` variables unchanged. The training operator's
`restartPolicy: ExitCode` fails the job for exit codes 1-127 and recreates the pod for 128
and up. On SIGTERM (eviction, preemption, a node shutting down) every rank stops at one
agreed step, rank 0 saves a checkpoint and the trainers exit 143; plain torchrun then exits
1, on the pod that got the signal and on every other pod, and the job would fail instead of
resuming.
"""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun

# What the trainer exits with after saving on SIGTERM: what a process ended by SIGTERM reports.
EXIT_PREEMPTED = 128 + signal.SIGTERM


def main() -> None:
    try:
        torchrun()
    except SignalException as exc:
        exit_stopped(128 + int(exc.sigval), f"stopped by {signal.Signals(exc.sigval).name}")
    except ChildFailedError as exc:
        # Another pod got the signal: this pod's trainers agreed to stop with it and saved.
        if all(failure.exitcode == EXIT_PREEMPTED for failure in exc.failures.values()):
            exit_stopped(EXIT_PREEMPTED, "the trainers stopped to be resumed")
        raise


def exit_stopped(code: int, reason: str) -> None:
    print(f"trainer.launch: {reason}; exiting with code {code}", file=sys.stderr, flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()

"""torchrun, except that a pod stopped to be resumed exits 143 (128 + SIGTERM), not 1.

Every pod (and every `ctl run` node) runs `python -m trainer.launch -m trainer --config FILE`,
which takes torchrun's arguments and `PET_*` variables unchanged. The training operator's
`restartPolicy: ExitCode` fails the job for exit codes 1-127 and recreates the pod for 128
and up. On SIGTERM (eviction, preemption, a node shutting down) every rank stops at one
agreed step, rank 0 saves a checkpoint and the trainers exit 143; plain torchrun then exits
1, on the pod that got the signal and on every other pod, and the job would fail instead of
resuming. Likewise when a rank's watchdog finds the job hung (trainer.watchdog): its trainers
exit EXIT_HUNG (200) and so does this pod, unless a trainer failed with a real error (1-127).
"""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun

from trainer.spec import EXIT_HUNG

# What the trainer exits with after saving on SIGTERM: what a process ended by SIGTERM reports.
EXIT_PREEMPTED = 128 + signal.SIGTERM


def main() -> None:
    try:
        torchrun()
    except SignalException as exc:
        exit_stopped(128 + int(exc.sigval), f"stopped by {signal.Signals(exc.sigval).name}")
    except ChildFailedError as exc:
        codes = {failure.exitcode for failure in exc.failures.values()}
        # Another pod got the signal: this pod's trainers agreed to stop with it and saved.
        if codes == {EXIT_PREEMPTED}:
            exit_stopped(EXIT_PREEMPTED, "the trainers stopped to be resumed")
        # Found hung; the other failures (< 0: killed by torchrun's teardown) are its consequences.
        if EXIT_HUNG in codes and not any(0 < code < 128 for code in codes):
            exit_stopped(EXIT_HUNG, "a rank's watchdog found the job hung; a restart resumes from the last checkpoint")
        raise


def exit_stopped(code: int, reason: str) -> None:
    print(f"trainer.launch: {reason}; exiting with code {code}", file=sys.stderr, flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()

"""torchrun, except that its exit code and error file tell the root cause of a failure.

Every pod (and every `ctl run` node) runs `python -m trainer.launch -m trainer --config FILE`,
which takes torchrun's arguments and `PET_*` variables unchanged. When a worker fails, plain
torchrun exits 1 and copies the earliest failure (to the second) into its own error file, often
a peer's "Connection closed by peer". Here the node's root cause is picked by
`trainer.failures.root_cause` and:

- bad input on any rank: its one line, exit 2;
- stopped to be resumed: exit 143 (128 + SIGTERM), not 1. The training operator's
  `restartPolicy: ExitCode` fails the job for exit codes 1-127 and recreates the pod for 128 and
  up. On SIGTERM (eviction, preemption, a node shutting down) every rank stops at one agreed step,
  rank 0 saves and the trainers exit 143, on the pod that got the signal and on every other pod;
- found hung by a rank's watchdog (trainer.watchdog): exit EXIT_HUNG (200), retried by ExitCode
  too, and the restarted pods resume from the last checkpoint. A rank of this node frozen as a whole,
  watchdog included, is killed here and counts as hung (trainer.frozen);
- any other failure: torchrun's own report, then the root cause's line, exit 1.

Before torchrun, the rendezvous host's name is looked up until it has an address (trainer/rendezvous.py): a
TrainJob's worker can start before its master's pod has one.

The root cause is written to this process's TORCHELASTIC_ERROR_FILE when it has one (`ctl run` sets it).
"""

from __future__ import annotations

import gc
import getpass
import os
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from argparse import Namespace
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from trainer import scratch


def stopped_line(code: int, reason: str) -> str:
    return f"trainer.launch: {reason}; exiting with code {code}"


def stop_while_starting(signum: int, frame: object = None) -> NoReturn:
    """SIGTERM before torchrun starts the trainers (when it installs its own handler): while torch imports and while
    the nodes meet at the rendezvous, for as long as a peer's pod is pending. There are no trainers yet and nothing
    to save: the exit code of a stop after saving, and the rendezvous left open for the next start, as torchrun
    leaves it on a signal."""
    code = 128 + signum
    reason = f"stopped by {signal.Signals(signum).name} before the trainers started"
    scratch.remove_made()  # what its exit handlers, skipped here, would remove
    os.write(2, f"{stopped_line(code, reason)}\n".encode())
    os._exit(code)


def watch_for_sigterm_while_starting() -> None:
    """As a container's PID 1 (the image run by itself; the chart's pods share their process namespace, where the
    sandbox is PID 1) the launcher gets no signal it has no handler for: the kernel drops the SIGTERM and the
    container is held until SIGKILL. A handler alone is not enough: Python runs it only when the main thread
    returns from C, and the rendezvous waits in torch's store for minutes. The signal's byte, written at once to a
    wakeup pipe, reaches a thread of its own, which also says why the launcher ended."""
    signal.signal(signal.SIGTERM, stop_while_starting)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            signals = os.read(read_end, 64)
            # Once torchrun's handler has replaced this one, the trainers exist and the signal is torchrun's.
            if signal.SIGTERM in signals and signal.getsignal(signal.SIGTERM) is stop_while_starting:
                stop_while_starting(signal.SIGTERM)

    threading.Thread(target=watch, name="ddpjob-sigterm-while-starting", daemon=True).start()


watch_for_sigterm_while_starting()
gc.disable()  # while torch imports: trainer/heap.py

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import _default_timeout_seconds as STATIC_TIMEOUT
from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config, parse_rendezvous_endpoint
from torch.distributed.run import get_rdzv_endpoint, parse_args
from torch.distributed.run import main as torchrun

from trainer.failures import Failure, Kind, read_record, root_cause, write_record
from trainer.frozen import FrozenRanks
from trainer.heap import resume_collection
from trainer.names import EXIT_BAD_INPUT, EXIT_ERROR, EXIT_HUNG, EXIT_PREEMPTED
from trainer.quick_exit import quick_exit
from trainer.rendezvous import unresolved

resume_collection()


def main() -> None:
    args = parse_args(sys.argv[1:])  # torchrun's arguments, read once for what is done before it
    wait_for_the_rendezvous_host(args)
    give_torchrun_a_scratch_log_dir(args)
    frozen = FrozenRanks().start()
    give_the_ranks_a_scratch_tmpdir()
    try:
        torchrun()
        quick_exit(0)
    except SignalException as exc:
        exit_stopped(128 + int(exc.sigval), f"stopped by {signal.Signals(exc.sigval).name}")
    except ChildFailedError as exc:
        workers = [worker_failure(rank, failure) for rank, failure in exc.failures.items()]
        cause = root_cause([*workers, *frozen.found])
        if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
            write_record(Path(error_file), cause)
        if cause.kind == Kind.STOPPED:  # another pod got the signal: this pod's trainers stopped with it and saved
            exit_stopped(EXIT_PREEMPTED, "the trainers stopped to be resumed")
        if cause.kind == Kind.HUNG:
            frozen.linger()
            exit_stopped(EXIT_HUNG, "a rank's watchdog found the job hung; a restart resumes from the last checkpoint")
        if cause.kind == Kind.BAD_INPUT:
            quick_exit(EXIT_BAD_INPUT, f"error: {cause.message}")
        traceback.print_exc()  # torchrun's report, then the root cause as the last line (a pod's termination message)
        quick_exit(EXIT_ERROR, f"error: {cause.message}")


def wait_for_the_rendezvous_host(args: Namespace) -> None:
    """Until the host that torchrun will connect to has an address (trainer/rendezvous.py), at most the time the
    rendezvous gives a node to join (rendezvous_timeout); past it, the host and the lookup's error, exit 1."""
    # No port given: torchrun picks one later; only the host is looked up.
    endpoint = get_rdzv_endpoint(Namespace(**vars(args) | {"master_port": args.master_port or 0}))
    host, port = parse_rendezvous_endpoint(endpoint, default_port=0)
    timeout = rendezvous_timeout(args)
    if (error := unresolved(host, port, timeout)) is not None:
        reason = f"the rendezvous host {host} has no address after {timeout} s: {error}"
        cause = Failure(EXIT_ERROR, reason, time.time())
        if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
            write_record(Path(error_file), cause)
        quick_exit(EXIT_ERROR, f"error: {cause.message}")


def rendezvous_timeout(args: Namespace) -> int:
    """Seconds: c10d's `join_timeout` (an elastic job's), else the static rendezvous' `timeout`, each from
    `--rdzv-conf` or torch's own default for it."""
    config = _parse_rendezvous_config(args.rdzv_conf)
    if args.rdzv_backend == "c10d":
        return int(config.get("join_timeout", RendezvousTimeout().join.total_seconds()))
    return int(config.get("timeout", STATIC_TIMEOUT))


def give_torchrun_a_scratch_log_dir(args: Namespace) -> None:
    """Without a log directory, torchrun makes one per start in /tmp (its ranks' error files) and leaves it there.
    In a pod /tmp is the scratch volume, which outlives the container: every restart would add one. Given none,
    torchrun gets a folder that goes with this process; with --redirects or --tee it is the ranks' logs, and kept."""
    if args.log_dir is None and args.redirects == args.tee == "0":
        os.environ["PET_LOG_DIR"] = str(scratch.make(scratch.TORCHRUN))


def give_the_ranks_a_scratch_tmpdir() -> None:
    """What the ranks leave in the temporary directory goes with this process. A rank that ends without its exit
    handlers (its watchdog's os._exit, a kill) leaves their files behind (W&B's folders, multiprocessing's), and in a
    pod /tmp is the scratch volume, which outlives the container: every restart would add them. torch.compile's
    cache, which defaults to a folder there and is meant to outlast the run, stays where it was."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", torch_compile_default_cache())
    # The workers torchrun starts inherit it; this process's tempfile keeps the directory it has read (by then, in
    # scratch.make), so its own folders and the sweep stay in the user's.
    os.environ["TMPDIR"] = str(scratch.make(scratch.RANKS))


def torch_compile_default_cache() -> str:
    """torch's own default (torch._inductor.runtime.cache_dir_utils.default_cache_dir, whose package takes seconds
    to import): `torchinductor_` and the user's name in the temporary directory."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid without a name
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def worker_failure(rank: int, failure: ProcessFailure) -> Failure:
    """What torchrun knows of the failed worker of global rank `rank`, with its own record and its log directory."""
    code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
    log = worker_log(failure)
    recorded = read_record(Path(failure.error_file), code)
    if recorded is not None:
        return replace(recorded, rank=rank, log=log)
    reason = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {code}"
    return Failure(code, reason, float(failure.timestamp), rank, log)


def worker_log(failure: ProcessFailure) -> str | None:
    """The folder where torchrun keeps the worker's stdout.log and stderr.log (with --redirects), if any."""
    if os.path.isfile(failure.error_file):
        folder = Path(failure.error_file).parent
    else:  # no record (killed by a signal): torchrun forgot the path; its local rank's folder of the newest attempt
        attempts = Path(os.environ.get("PET_LOG_DIR") or os.devnull).glob(f"*/attempt_*/{failure.local_rank}")
        folder = max(attempts, key=os.path.getmtime, default=Path(os.devnull))
    return str(folder) if (folder / "stderr.log").is_file() else None


def exit_stopped(code: int, reason: str) -> NoReturn:
    quick_exit(code, stopped_line(code, reason))


if __name__ == "__main__":
    main()

"""Experiment tracking: rank 0 reports what the loop logs to TensorBoard, MLflow or Weights & Biases.

`training.reportTo` names the trackers (default: tensorboard). TensorBoard's event files go to
`<run dir>/tensorboard`, on the shared volume in a cluster, so `tensorboard --logdir` on the volume
shows every run (on object storage, a new file after each checkpoint: `Tracker.seal_events`). MLflow
and W&B take their configuration and credentials from their own environment variables
(MLFLOW_TRACKING_URI, WANDB_API_KEY, WANDB_PROJECT, ...), which a spec sets by reference (`env` with
`valueFrom.secretKeyRef`, `envFrom`): no secret is ever a spec value.

Each library is imported only when named; a named one that is not installed is bad input, found by
`check_installed` before any work. A resumed run goes on in the same MLflow/W&B run (their ids are kept
in `<run dir>/tracking.json`), and TensorBoard drops what the interrupted attempt logged after the
checkpoint it resumes from.

MLflow and W&B runs end with the process's outcome: `finish(exit code)` from the trainer's main (0:
FINISHED; EXIT_PREEMPTED, a stop by SIGTERM: KILLED; anything else FAILED, and W&B gets the exit code)
or from the hang watchdog before it exits; an exit that reported none (an exception) is a failure.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import math
import os
import sys
import threading
import time
import urllib.parse
from pathlib import Path

from trainer.checkpoint import SaveStats
from trainer.failures import first_line
from trainer.names import EXIT_ERROR, EXIT_PREEMPTED, JOB_NAME_ENV, RUN_IDS, TENSORBOARD_DIR, WARNING_PREFIX
from trainer.spec import SpecError, TrainingSpec

# What to install for each tracker.
PIP_NAME = {"tensorboard": "ddpjob[train]", "mlflow": "mlflow", "wandb": "wandb"}
# W&B's x-axis for every value: W&B drops a value logged at an earlier step than the last one (its own step
# only grows), and a background checkpoint save is reported at the log step after it finished.
WANDB_STEP = "trainer/step"
# What a W&B run needs from the pod's environment (docs/monitoring.md).
WANDB_SETUP = "set WANDB_API_KEY from a Secret in the spec's env, or WANDB_MODE=offline"
# A tracking server that has not answered this long is said so on the terminal (MLflow's own retries go on for
# minutes, silently); a healthy one answers in well under a second.
SLOW_ANSWER_SECONDS = 5.0
# How long MLflow tries, set by its own variables in the spec's env.
MLFLOW_RETRIES = "MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT"


class TrackerUnreachable(Exception):
    """A tracker's server did not answer: not bad input, since it may be a moment's outage, so rank 0 exits 1 (which
    the job's restart policy retries) with this one line."""


def check_installed(spec: TrainingSpec) -> None:
    """Every tracker `training.reportTo` names can be imported, or one line saying what to install."""
    for name in spec.report_to:
        if importlib.util.find_spec(name) is None:
            install = f"pip install '{PIP_NAME[name]}'"
            raise SpecError(f"training.reportTo: {name} is not installed: {install}, or leave it out")


class TensorBoard:
    def __init__(self, run_dir: Path, resumed_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events at or after it, from the attempt that was interrupted, are dropped on reading.
        purge = None if resumed_step is None else resumed_step + 1
        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=purge)
        self.opened = time.time()  # when the current event file was opened, or just after

    def log(self, step: int, values: dict[str, float]) -> None:
        opens = self.writer.file_writer is None  # the first value after `seal` opens a new file
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # log steps are rare: a reader (and a killed run) sees every value at once
        if opens:
            self.opened = time.time()

    def seal(self) -> None:
        """Close the current event file, which then never changes; the writer opens a new one at the next value.

        TensorBoard reads a directory's event files in name order, and a name is the second its file was opened in,
        then a count of the process's files ("9" sorts after "10"): a file is closed only in a later second than it
        was opened in, so the next one sorts after it. Only checkpoints under a second apart wait for that.
        """
        if self.writer.file_writer is None:  # nothing logged since the last seal
            return
        time.sleep(max(0.0, math.floor(self.opened) + 1 - time.time()))
        self.writer.close()

    def close(self, exit_code: int) -> None:
        self.writer.close()


class MLflow:
    def __init__(self, name: str, run_id: str | None) -> None:
        import mlflow
        from mlflow.exceptions import MlflowException

        self.mlflow = mlflow
        server = without_credentials(mlflow.get_tracking_uri())
        slow = f"mlflow: no answer from {server} in {SLOW_ANSWER_SECONDS:g} s; MLflow goes on trying ({MLFLOW_RETRIES})"
        notice = threading.Timer(SLOW_ANSWER_SECONDS, warn, [slow])
        notice.daemon = True
        notice.start()
        try:
            self.run_id = mlflow.start_run(run_id=run_id, run_name=None if run_id else name).info.run_id
        except MlflowException as exc:
            causes = chain(exc)
            if any(isinstance(cause, OSError) for cause in causes):  # requests' errors are OSErrors too
                raise TrackerUnreachable(f"training.reportTo: mlflow cannot reach {server}: {causes[-1]}") from None
            # The server answered no: a missing MLFLOW_EXPERIMENT_ID, a refused login, a resumed run deleted.
            reason = first_line(exc.message, exc.error_code)
            raise SpecError(f"training.reportTo: mlflow cannot start its run at {server}: {reason}") from None
        finally:
            notice.cancel()

    def log(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self, exit_code: int) -> None:
        status = "FINISHED" if exit_code == 0 else "KILLED" if exit_code == EXIT_PREEMPTED else "FAILED"
        # By id: the watchdog closes it from its own thread, and MLflow's active run belongs to the thread that
        # started it. end_run then takes it off that thread's stack, or MLflow's exit hook would end it FINISHED.
        self.mlflow.MlflowClient().set_terminated(self.run_id, status)
        self.mlflow.end_run(status)


class WandB:
    def __init__(self, name: str, run_id: str | None, run_dir: Path) -> None:
        import wandb
        from wandb.errors import AuthenticationError, UsageError

        try:
            self.run = wandb.init(name=name, id=run_id, resume="allow", dir=str(run_dir))
        except (AuthenticationError, UsageError) as exc:  # no API key, a malformed one, a bad WANDB_* setting
            reason = first_line(exc)
            raise SpecError(f"training.reportTo: wandb cannot start its run: {reason} ({WANDB_SETUP})") from None
        self.run_id = self.run.id
        self.run.define_metric("*", step_metric=WANDB_STEP)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values | {WANDB_STEP: step})

    def close(self, exit_code: int) -> None:
        self.run.finish(exit_code=exit_code)


def without_credentials(uri: str) -> str:
    """A tracking URI fit for a log line: a user and password in it are left out."""
    parts = urllib.parse.urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def chain(exc: BaseException) -> list[BaseException]:
    """The exception and what caused it, down to the root cause (last)."""
    causes = [exc]
    while (cause := causes[-1].__cause__ or causes[-1].__context__) is not None and cause not in causes:
        causes.append(cause)
    return causes


def warn(message: str) -> None:
    print(f"{WARNING_PREFIX}{message}", file=sys.stderr, flush=True)


# This process's open trackers (rank 0's), closed once by `finish`.
open_trackers: list[Tracker] = []


def finish(exit_code: int, within: float | None = None) -> None:
    """Close the open trackers with the process's outcome (its exit code). With `within` (the hang watchdog,
    which exits next), in a thread waited for at most that long: a tracking server that does not answer
    cannot hold the exit up."""
    if within is None:
        close_all(exit_code)
        return
    closing = threading.Thread(target=close_all, args=(exit_code,), name="ddpjob-tracking-close", daemon=True)
    closing.start()
    closing.join(within)


def close_all(exit_code: int) -> None:
    while open_trackers:
        open_trackers.pop().close(exit_code)


class Tracker:
    """Rank 0's trackers; on every other rank `log` does nothing. MLflow's and W&B's runs start with it (a refusal
    is bad input), TensorBoard's events at `start_events`. Closed by `finish`, or as failed at exit."""

    def __init__(self, spec: TrainingSpec, is_main: bool, run_dir: Path) -> None:
        self.trackers: dict[str, TensorBoard | MLflow | WandB] = {}  # by their names in reportTo
        self.reported_save: SaveStats | None = None
        self.run_dir = run_dir
        self.events = is_main and "tensorboard" in spec.report_to
        if not is_main:
            return
        name = os.environ.get(JOB_NAME_ENV) or run_dir.name
        ids_file = run_dir / RUN_IDS
        ids = json.loads(ids_file.read_text()) if ids_file.exists() else {}
        try:
            for kind in dict.fromkeys(spec.report_to):  # once each, if named twice
                if kind == "tensorboard":
                    continue
                service = MLflow(name, ids.get(kind)) if kind == "mlflow" else WandB(name, ids.get(kind), run_dir)
                ids[kind] = service.run_id
                self.trackers[kind] = service
        except BaseException:
            self.close(EXIT_ERROR)  # those that started before the one refused: ended now, as failed
            raise
        if ids:
            ids_file.write_text(json.dumps(ids))
        open_trackers.append(self)
        atexit.register(finish, EXIT_ERROR)  # after main's finish, if any: then there is nothing left to close

    def start_events(self, resumed_step: int | None) -> None:
        """TensorBoard's writer, once the step the loop starts from is known: what an interrupted attempt logged
        after it is dropped."""
        if self.events:
            self.trackers["tensorboard"] = TensorBoard(self.run_dir, resumed_step)

    def log(self, step: int, values: dict[str, float | None]) -> None:
        """Scalars of one step, by name (`train/loss`, `eval/accuracy`...); None values are left out."""
        present = {key: float(value) for key, value in values.items() if value is not None}
        for tracker in self.trackers.values():
            tracker.log(step, present)

    def seal_events(self) -> None:
        """Before a checkpoint on object storage: the TensorBoard events so far in closed files, which the checkpoint
        uploads (trainer.rundir.publish) and no later one uploads again."""
        board = self.trackers.get("tensorboard")
        if isinstance(board, TensorBoard):
            board.seal()

    def checkpoint_saved(self, save: SaveStats | None) -> None:
        """The newest committed checkpoint, once (a background save is reported when the loop sees it done)."""
        if save is None or save is self.reported_save:
            return
        self.reported_save = save
        self.log(save.step, {"checkpoint/save_seconds": save.seconds, "checkpoint/size_bytes": save.size_bytes})

    def close(self, exit_code: int) -> None:
        """Close every tracker; one that fails to (its server gone) is a warning: the run's outcome stands."""
        for kind, tracker in self.trackers.items():
            try:
                tracker.close(exit_code)
            except Exception as exc:
                reason = first_line(str(exc))
                warn(f"{kind}: cannot end its run: {type(exc).__name__}: {reason}")
        self.trackers = {}

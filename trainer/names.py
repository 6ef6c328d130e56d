"""Names that the trainer, its launcher and `ctl` share: environment variables, exit codes, run-directory
files, metric names. Nothing but constants, so that `ctl --help` and the launcher import it for nothing.
"""

from __future__ import annotations

import re

# The environment the chart (and `ctl run`, per simulated pod) gives the trainer besides training.yaml.
JOB_NAME_ENV = "DDPJOB_JOB_NAME"  # the job's name, for the metrics' info series
METRICS_PORT_ENV = "DDPJOB_METRICS_PORT"  # local rank 0 serves the pod's metrics here; unset: no endpoint
METRICS_HOST_ENV = "DDPJOB_METRICS_HOST"  # address it binds (default: every interface, as a pod needs)
# prometheus_client's own variable: the directory where a pod's trainer processes keep their metric files.
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# torchrun's: how long it waits for its workers to exit after forwarding SIGTERM (the chart: the grace period
# less 5 s); the trainer spaces its stop checks by it (trainer.dist.StopRequest).
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
# Set by the launcher (trainer.launch) for its workers: the directory of their watchdogs' heartbeat files, which it
# reads to find a rank whose whole process is stopped or frozen (trainer.frozen).
HEARTBEAT_DIR_ENV = "DDPJOB_HEARTBEAT_DIR"
# Test hook only: "RANK:SECONDS" makes that rank sleep SECONDS in every step (a straggler on demand).
SLOW_RANK_ENV = "DDPJOB_TEST_SLOW_RANK"
# Test hook only: "RANK:STEP" makes that rank stop its own process (SIGSTOP) once it has completed step STEP.
FREEZE_RANK_ENV = "DDPJOB_TEST_FREEZE_RANK"
# What every rank exits with when its watchdog finds the job hung. Retryable: the operator's
# restartPolicy ExitCode recreates pods for exit codes 128 and up, and the run resumes from its
# last checkpoint. Not 128 + a signal number, so it cannot be mistaken for a process killed by one.
EXIT_HUNG = 200

# Exit codes of the trainer, its launcher (trainer.launch) and `ctl run`; docs/errors.md explains them.
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2  # bad spec, flag or data: one line naming the key; retrying cannot help
EXIT_INTERRUPTED = 130  # `ctl run` stopped by Ctrl-C (128 + SIGINT), after the trainers saved
EXIT_PREEMPTED = 143  # stopped by SIGTERM after saving (128 + SIGTERM); the next start resumes
# How a message says "start afresh": where a run directory is chosen, in a pod and with `ctl run`.
NEW_RUN_DIR = "training.checkpoint.dir, or ctl run --run-dir"
# The run directory's pointer to its newest complete checkpoint, `step-<N>` (8 digits).
LATEST_CHECKPOINT = "latest"
CHECKPOINT_NAME = re.compile(r"step-(\d{8})")
# The run directory's TensorBoard event files, and the MLflow/W&B run ids a resume goes on in (trainer/tracking.py).
TENSORBOARD_DIR = "tensorboard"
RUN_IDS = "tracking.json"
# The largest context a named GPT-2 size (model.size) takes: its position embeddings.
GPT2_POSITIONS = 1024
# Set by Kubeflow Trainer v2's TrainJobStatus plugin (v2.3, feature gate TrainJobStatus) on the trainer pods:
# the full https URL of the job's status endpoint, and the paths of the server's CA certificate and of a
# projected service-account token (rotated by the kubelet) to send as a bearer token. trainer/progress.py.
PROGRESS_URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
PROGRESS_CA_CERT_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
PROGRESS_TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"
# Set by the chart to the prepare Job's name when one prepares the data: the training pods then wait for it instead of
# preparing, and name it when they give up (trainer.workloads.wait_for).
PREPARED_BY_JOB_ENV = "DDPJOB_PREPARED_BY_JOB"
# Set by the chart to its appVersion: the ddpjob that rendered training.yaml. The chart passes every key of the
# spec, defaults included, so an image older than the ctl or chart that rendered its job refuses the newer keys; the
# trainer then names both versions (trainer.spec.load_training_spec).
RENDERED_BY_ENV = "DDPJOB_RENDERED_BY"
# How a trainer's warning line starts (rank 0's stderr): `ctl run` shows these lines on the terminal and leaves the
# rest of a rank's stderr in its logs.
WARNING_PREFIX = "warning: "
METRICS_PREFIX = "ddpjob_"  # every metric name starts with it (trainer/metrics.py, trainer/preparation/progress.py)


class Metric:
    """Metrics that trainer/metrics.py defines and `ctl status` reads off rank 0's endpoint (less METRICS_PREFIX)."""

    STEP = "step"
    PLANNED_STEPS = "planned_steps"
    TRAIN_LOSS = "train_loss"
    EVAL_LOSS = "eval_loss"
    TOKENS_PER_SECOND = "tokens_per_second"
    CHECKPOINT_TIME = "checkpoint_last_success_timestamp_seconds"
    CHECKPOINT_STEP = "checkpoint_step"
    SLOWEST_RANK = "slowest_rank"
    SLOWEST_RANK_RATIO = "slowest_rank_step_time_ratio_to_median"


# The variables above that the chart sets on the trainer container (PREPARED_BY_JOB_ENV with prepare.enabled);
# tests/test_pod_contract.py checks the rendered pods. The others are not the chart's: METRICS_HOST_ENV is set by
# `ctl run` (a pod listens on every interface), SLOW_RANK_ENV and FREEZE_RANK_ENV by tests, PROGRESS_*_ENV by
# Trainer v2's controller, HEARTBEAT_DIR_ENV by the launcher.
POD_TEMPLATE_ENV = (
    JOB_NAME_ENV,
    METRICS_PORT_ENV,
    METRICS_DIR_ENV,
    SHUTDOWN_TIMEOUT_ENV,
    PREPARED_BY_JOB_ENV,
    RENDERED_BY_ENV,
)

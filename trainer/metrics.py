"""Prometheus metrics of a training run: one endpoint per pod, a `rank` label on every series.

A pod runs one torchrun agent with several trainer processes (one per GPU), but exposes
one scrape endpoint, on its container port named `metrics`. The processes share it
through prometheus_client's multiprocess mode: the launcher (the chart, or `ctl run`
for each simulated pod) sets PROMETHEUS_MULTIPROC_DIR, every process keeps its values
in memory-mapped files there, and local rank 0 serves the merge of all files. Each
series carries the process's global `rank`, so per-rank values (step time, data wait)
stay apart and counters sum to the job's totals. Why this design: the alternatives
(one port per process, or ranks pushing to rank 0 over the process group) need either
a scrape config that knows the world size or extra collectives in the train loop; the
files cost a few microseconds per update and no communication at all. A new attempt
(container restart, torchrun restart) starts with an empty directory, so series of
processes that are gone never linger.

Without PROMETHEUS_MULTIPROC_DIR (a single process, e.g. `python -m trainer`) the
values live in this process and it serves them itself.

Environment (trainer.names names it): DDPJOB_METRICS_PORT (unset or 0: no endpoint),
DDPJOB_METRICS_HOST (bind address, default every interface), DDPJOB_JOB_NAME (the
job's name, for the info series), TORCHELASTIC_RESTART_COUNT (from torchrun).

Cost: updates are host-side only and never read a device value. Per step: three
counters and two histograms (a few microseconds); at log steps, where the loop has
already all-reduced and read its values, the gauges.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.multiprocess import MultiProcessCollector

from trainer.checkpoint import SaveStats
from trainer.dist import Dist, barrier
from trainer.names import JOB_NAME_ENV, METRICS_DIR_ENV, METRICS_HOST_ENV, METRICS_PORT_ENV, METRICS_PREFIX, Metric
from trainer.spec import SpecError, TrainingSpec

PREFIX = METRICS_PREFIX
# Dense bf16 peak FLOP/s per GPU (SXM parts), matched against the CUDA device name.
BF16_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DATA_WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
CHECKPOINT_BUCKETS = (0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
T = TypeVar("T")


def peak_flops(device: torch.device) -> float | None:
    """The device's bf16 peak, when it is a GPU this module knows."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for model, peak in BF16_PEAK_FLOPS.items() if model in name), None)


def flops_per_token(model: torch.nn.Module, block_size: int) -> float | None:
    """Training FLOPs per token as nanoGPT's estimate_mfu counts them: 6N + 12·L·H·Q·T.

    N excludes the position embeddings; T is the block size (the longest sequence).
    None for a model without a GPT-2 config.
    """
    config = getattr(model, "config", None)
    try:
        layers, heads, width, positions = config.n_layer, config.n_head, config.n_embd, config.n_positions
    except AttributeError:
        return None
    params = sum(p.numel() for p in model.parameters()) - positions * width
    return 6 * params + 12 * layers * heads * (width // heads) * block_size


def model_name(spec: TrainingSpec) -> str:
    model = spec.model
    return model.pretrained or model.size or f"gpt2-{model.n_layer}l-{model.n_head}h-{model.n_embd}d"


def metrics_endpoint() -> tuple[int, str | None]:
    """(port, shared directory) from the environment; 0: no endpoint, None: values kept in this process."""
    raw = os.environ.get(METRICS_PORT_ENV, "")
    if raw and (not raw.isdigit() or int(raw) > 65535):
        raise SpecError(f"{METRICS_PORT_ENV}: expected a port number (0 for none), got {raw!r}")
    port, directory = int(raw or 0), os.environ.get(METRICS_DIR_ENV) or None
    if port and not directory and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        raise SpecError(
            f"{METRICS_PORT_ENV} is set but {METRICS_DIR_ENV} is not: the pod's processes need a shared directory"
        )
    return port, directory


def clear_shared_directory(dist: Dist) -> None:
    """Every attempt starts with an empty multiprocess directory, emptied by local rank 0 before it writes any
    metric (data preparation's too: prometheus_client keeps its files open, so they cannot go later)."""
    _, directory = metrics_endpoint()
    if directory and dist.local_rank == 0:
        shutil.rmtree(directory, ignore_errors=True)  # a mount point (the chart's emptyDir) stays, emptied
        Path(directory).mkdir(parents=True, exist_ok=True)


class TrainingMetrics:
    """This process's training metrics; local rank 0 also serves the pod's endpoint.

    The train loop calls `timed` once, `step_done` every step, `logged` at log steps and
    `evaluated` after an evaluation; the checkpoint code calls `checkpoint_saved`.
    """

    def __init__(self, spec: TrainingSpec, dist: Dist, model: torch.nn.Module, planned_steps: int) -> None:
        port, directory = metrics_endpoint()
        if directory:  # emptied by clear_shared_directory; the other local ranks create their files after this
            barrier(dist)
        self.registry = CollectorRegistry()
        self.rank = str(dist.rank)
        self.world_size = dist.world_size
        self.device = dist.device
        flops = flops_per_token(model, spec.model.block_size)
        peak = peak_flops(dist.device)
        self.flops_per_peak = flops / peak if flops and peak else None
        self.describe_run(spec, dist)
        self.define_step_series(planned_steps)
        self.define_log_series()
        self.define_checkpoint_series()
        self.define_straggler_series()
        self.reported_save: SaveStats | None = None
        self._step_data_wait = 0.0
        if port and dist.local_rank == 0:
            self.serve(port, os.environ.get(METRICS_HOST_ENV) or "0.0.0.0", directory)

    def describe_run(self, spec: TrainingSpec, dist: Dist) -> None:
        """Series set once: what runs, its attempt, when it started."""
        info = {
            "job_name": os.environ.get(JOB_NAME_ENV, ""),
            "task": spec.task,
            "model": model_name(spec),
            "world_size": str(dist.world_size),
        }
        self.gauge("info", "The run: task, model, world size and job name (always 1).", *info).labels(
            self.rank, *info.values()
        ).set(1)
        self.gauge("restarts", "Restarts of this torchrun worker group (TORCHELASTIC_RESTART_COUNT).").labels(
            self.rank
        ).set(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        self.gauge("start_timestamp_seconds", "Unix time this trainer process started training.").labels(self.rank).set(
            time.time()
        )

    def define_step_series(self, planned_steps: int) -> None:
        """Series every step updates."""
        self.steps = self.counter("steps", "Optimizer steps completed by this rank (this process).")
        self.step = self.gauge(
            Metric.STEP, "Optimizer step of the run this rank has finished (continues after a resume)."
        )
        self.step = self.step.labels(self.rank)
        self.gauge(
            Metric.PLANNED_STEPS, "Optimizer steps the run will have done when it ends (ddpjob_step's goal)."
        ).labels(self.rank).set(planned_steps)
        self.samples = self.counter("samples", "Training examples (sequences) this rank processed.")
        self.tokens = self.counter("tokens", "Training tokens this rank processed (padding included).")
        self.step_duration = self.histogram(
            "step_duration_seconds", "Wall time of one optimizer step on this rank, data wait included.", STEP_BUCKETS
        ).labels(self.rank)
        self.data_wait = self.histogram(
            "data_wait_seconds", "Time one step waited for its batches (next() on the data stream).", DATA_WAIT_BUCKETS
        ).labels(self.rank)

    def define_log_series(self) -> None:
        """Series of the values a log step or an evaluation has already reduced."""
        self.train_loss = self.gauge(Metric.TRAIN_LOSS, "Mean training loss of all ranks over the last log interval.")
        self.learning_rate = self.gauge("learning_rate", "Learning rate at the last log step.")
        self.grad_norm = self.gauge("grad_norm", "Global gradient norm before clipping, at the last log step.")
        self.tokens_per_second = self.gauge(
            Metric.TOKENS_PER_SECOND, "Training tokens per second of the whole job over the last log interval."
        )
        self.eval_loss = self.gauge(Metric.EVAL_LOSS, "Validation loss at the last evaluation.")
        self.eval_accuracy = self.gauge(
            "eval_accuracy_ratio", "Validation accuracy (tokens or examples), last evaluation."
        )
        # Gauges appear with their first value: a 0 before that would read as a measurement.
        # MFU and memory only where they mean something: a GPU with a known peak, a GPU.
        self.mfu = self.gauge("mfu_ratio", "Model FLOPs utilisation of this rank's GPU against its bf16 peak.")
        self.gpu_memory = {
            kind: self.gauge(f"gpu_memory_{kind}_bytes", documentation)
            for kind, documentation in (
                ("allocated", "GPU memory held by tensors on this rank."),
                ("reserved", "GPU memory reserved by PyTorch's caching allocator on this rank."),
                ("peak", "Most GPU memory held by tensors on this rank since it started."),
            )
        }

    def define_checkpoint_series(self) -> None:
        # From the first checkpoint on: before that there is no save to describe.
        self.checkpoint_duration = self.histogram(
            "checkpoint_save_duration_seconds", "Time to write one checkpoint.", CHECKPOINT_BUCKETS
        )
        self.checkpoint_size = self.gauge("checkpoint_size_bytes", "Size of the last checkpoint.")
        self.checkpoint_time = self.gauge(Metric.CHECKPOINT_TIME, "Unix time the last checkpoint was committed.")
        self.checkpoint_step = self.gauge(Metric.CHECKPOINT_STEP, "Step of the last committed checkpoint (step-N).")

    def define_straggler_series(self) -> None:
        # From the watchdog thread (trainer.watchdog), once every rank has stepped: stragglers.
        self.step_time_ratio_gauge = self.gauge(
            "step_time_ratio_to_median",
            "This rank's busy time per step (step time less the wait for the other ranks' gradients) over the"
            " median of all ranks; 1: typical, 2: twice as slow as most (a straggler everyone waits for).",
        ).labels(self.rank)
        self.slowest_rank_gauge = self.gauge(
            Metric.SLOWEST_RANK, "Rank 0 only: the rank with the highest step time ratio."
        )
        self.slowest_ratio_gauge = self.gauge(
            Metric.SLOWEST_RANK_RATIO, "Rank 0 only: the step time ratio of the slowest rank."
        )

    def counter(self, name: str, documentation: str) -> Counter:
        return Counter(PREFIX + name, documentation, ["rank"], registry=self.registry).labels(self.rank)

    def gauge(self, name: str, documentation: str, *labels: str) -> Gauge:
        """A gauge with a `rank` label (and `labels`)."""
        # mostrecent: a rank's value is the one its process set last, with no `pid` label added.
        return Gauge(
            PREFIX + name, documentation, ["rank", *labels], registry=self.registry, multiprocess_mode="mostrecent"
        )

    def histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + name, documentation, ["rank"], registry=self.registry, buckets=buckets)

    def serve(self, port: int, host: str, directory: str | None) -> None:
        registry = self.registry
        if directory:
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=directory)
        try:
            start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise RuntimeError(f"metrics: cannot serve on {host}:{port}: {exc}") from exc

    def timed(self, batches: Iterator[T]) -> Iterator[T]:
        """`batches`, adding the time spent in each next() to the current step's data wait."""
        while True:
            started = time.perf_counter()
            try:
                item = next(batches)
            except StopIteration:
                return
            self._step_data_wait += time.perf_counter() - started
            yield item

    def step_done(self, step: int, seconds: float, samples: int, tokens: int) -> None:
        """Step `step` of the run (counted on after a resume) done on this rank: its wall time and what it processed."""
        self.step.set(step)
        self.steps.inc()
        self.samples.inc(samples)
        self.tokens.inc(tokens)
        self.step_duration.observe(seconds)
        self.data_wait.observe(self._step_data_wait)
        self._step_data_wait = 0.0

    def logged(self, loss: float, lr: float, grad_norm: float | None, tokens_per_second: float) -> None:
        """Values the loop has already reduced and read at a log step; GPU memory and MFU with them."""
        self.train_loss.labels(self.rank).set(loss)
        self.learning_rate.labels(self.rank).set(lr)
        if grad_norm is not None:
            self.grad_norm.labels(self.rank).set(grad_norm)
        self.tokens_per_second.labels(self.rank).set(tokens_per_second)
        if self.flops_per_peak:
            self.mfu.labels(self.rank).set(tokens_per_second / self.world_size * self.flops_per_peak)
        if self.device.type == "cuda":
            for kind, value in (
                ("allocated", torch.cuda.memory_allocated(self.device)),
                ("reserved", torch.cuda.memory_reserved(self.device)),
                ("peak", torch.cuda.max_memory_allocated(self.device)),
            ):
                self.gpu_memory[kind].labels(self.rank).set(value)

    def evaluated(self, loss: float, accuracy: float) -> None:
        self.eval_loss.labels(self.rank).set(loss)
        self.eval_accuracy.labels(self.rank).set(accuracy)

    def step_time_ratio(self, ratio: float) -> None:
        self.step_time_ratio_gauge.set(ratio)

    def slowest_rank(self, rank: int, ratio: float) -> None:
        self.slowest_rank_gauge.labels(self.rank).set(rank)
        self.slowest_ratio_gauge.labels(self.rank).set(ratio)

    def checkpoint_saved(self, save: SaveStats | None) -> None:
        """The newest checkpoint this process committed (rank 0; a background save reports when it is done)."""
        if save is None or save is self.reported_save:
            return
        self.reported_save = save
        self.checkpoint_duration.labels(self.rank).observe(save.seconds)
        self.checkpoint_size.labels(self.rank).set(save.size_bytes)
        self.checkpoint_time.labels(self.rank).set(save.finished_at)
        self.checkpoint_step.labels(self.rank).set(save.step)

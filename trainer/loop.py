"""Train and evaluate: one obvious path through a step, nanoGPT-style.

A step: set the LR, run `gradAccum` micro-batches (all but the last under
`no_sync`, so DDP all-reduces gradients once per step), clip, step, log.
Every task feeds batches as dicts with `input_ids` and `labels` (token targets for
language modelling, one class id per row for classification): the loss is the
cross-entropy of the model's logits against `labels` either way.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from trainer.checkpoint import Checkpointer, TrainerState, set_rng_state, step_name
from trainer.data import Collate, TrainBatches, eval_loader, evenly_spaced
from trainer.dist import Dist, StopRequest, all_reduce_sum, step_timeouts
from trainer.metrics import TrainingMetrics
from trainer.models import forward_options, parameter_groups
from trainer.progress import ProgressReporter
from trainer.spec import ScheduleSpec, TrainingSpec
from trainer.tracking import Tracker
from trainer.watchdog import GradientSync, Watchdog, test_slowdown

# Keys of a batch that are not model inputs.
NOT_INPUTS = ("labels", "index")


@dataclass(frozen=True)
class Evaluation:
    loss: float
    accuracy: float
    count: int  # targets scored: tokens (language modelling) or examples (classification)


@dataclass(frozen=True)
class TrainResult:
    steps: int
    epochs: float
    samples: int
    tokens: int
    train_loss: float
    seconds: float
    preempted: bool  # stopped by SIGTERM after saving a checkpoint; the run is not finished
    # The final model over the whole validation split, when the last checkpoint's keepBest needed it: the final
    # report's evaluation of the same split need not run again.
    final_eval: Evaluation | None = None


def lr_at(step: int, max_steps: int, peak: float, schedule: ScheduleSpec) -> float:
    """Linear warmup over `warmupSteps`, then cosine from `peak` to `minLrRatio x peak`."""
    if step < schedule.warmup_steps:
        return peak * (step + 1) / schedule.warmup_steps
    progress = (step - schedule.warmup_steps) / max(1, max_steps - 1 - schedule.warmup_steps)
    floor = peak * schedule.min_lr_ratio
    return floor + 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))) * (peak - floor)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32. `auto` picks bf16 only on GPUs that have it."""
    if precision == "fp32":
        return None
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    return torch.bfloat16 if precision == "bf16" else torch.float16


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def loss_stats(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed loss, correct predictions, predictions) from a batch's logits, in fp32 whatever the autocast dtype.

    With `compile: true` this is compiled too: the fp32 upcast, the cross-entropy and the argmax
    then read the logits once, which for a language model's (batch x block x vocabulary) is most
    of what a step moves through memory outside the matrix multiplies.
    """
    logits = logits.float().flatten(0, -2)
    targets = labels.flatten()
    loss_sum = F.cross_entropy(logits, targets, reduction="sum")
    predicted = logits.detach().argmax(-1)
    return loss_sum, (predicted == targets).sum(), predicted


def batch_stats(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], options: dict[str, Any], stats: Callable = loss_stats
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """(summed loss, correct predictions, targets, predictions) of one batch; `options`: see forward_options."""
    logits = model(**{k: v for k, v in batch.items() if k not in NOT_INPUTS}, **options).logits
    loss_sum, correct, predicted = stats(logits, batch["labels"])
    return loss_sum, correct, batch["labels"].numel(), predicted


@dataclass(frozen=True)
class Summed:
    """A span's totals summed over every rank, on the host."""

    loss_sum: float
    correct: float
    targets: float  # scored targets: tokens (language modelling) or examples (classification)
    tokens: float  # input tokens

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.targets, 1)

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.targets, 1)


class Totals:
    """Running sums over a span of steps (a log interval, an epoch, an evaluation), on this rank's device.

    The named fields live in one float64 vector: adding a batch never waits for the device (the
    count is filled in there: `torch.tensor(count, device=cuda)` would be a blocking copy), and
    summing over ranks is one all-reduce.
    """

    FIELDS = ("loss_sum", "correct", "targets", "tokens")

    def __init__(self, device: torch.device, saved: list[float] | None = None) -> None:
        self.vector = torch.zeros(len(self.FIELDS), dtype=torch.float64, device=device)
        if saved:  # a checkpoint's; those written before tokens were summed per epoch hold the first three
            self.vector[: len(saved)] = torch.tensor(saved, dtype=torch.float64)

    def add(self, loss_sum: torch.Tensor, correct: torch.Tensor, targets: int, tokens: int = 0) -> None:
        self.vector[:3] += torch.stack(
            [loss_sum.detach().double(), correct.double(), correct.new_full((), targets, dtype=torch.float64)]
        )
        self.vector[3] += tokens

    def summed(self, rider: torch.Tensor | None = None) -> tuple[Summed, list[float]]:
        """These totals over every rank, and `rider` summed in the same all-reduce (the stop votes at a log step)."""
        extra = [] if rider is None else [rider]
        values = all_reduce_sum(torch.cat([self.vector, *extra])).tolist()
        return Summed(*values[: len(self.FIELDS)]), values[len(self.FIELDS) :]

    def saved(self) -> list[float]:
        """Summed over every rank, for a checkpoint: on resume rank 0 carries them and the other ranks start at 0."""
        return all_reduce_sum(self.vector.clone()).tolist()

    def zero(self) -> None:
        self.vector.zero_()


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loader: DataLoader,
    dist: Dist,
    amp_dtype: torch.dtype | None,
    predictions: list[tuple[int, int]] | None = None,
) -> Evaluation:
    """Exact loss and accuracy over the whole split: per-rank sums and counts, all-reduced.

    With `predictions` (classification), this rank's (example index, predicted class) pairs are appended to it.
    """
    model.eval()
    options = forward_options(model)
    totals = Totals(dist.device)
    for batch in loader:
        batch = to_device(batch, dist.device)
        with autocast(dist.device, amp_dtype):
            loss_sum, correct, count, predicted = batch_stats(model, batch, options)
        totals.add(loss_sum, correct, count)
        if predictions is not None:
            predictions += zip(batch["index"].tolist(), predicted.tolist(), strict=True)
    model.train()
    summed, _ = totals.summed()
    return Evaluation(loss=summed.loss, accuracy=summed.accuracy, count=int(summed.targets))


def gather_predictions(pairs: list[tuple[int, int]], dist: Dist, size: int) -> list[int]:
    """Every rank's (index, prediction) pairs put back in dataset order.

    Each rank predicted its own shard (no padding duplicates); placing the pairs by
    index makes the result independent of the world size.
    """
    shards = [pairs]
    if dist.is_distributed:
        shards = [None] * dist.world_size
        torch_dist.all_gather_object(shards, pairs)
    by_index = dict(pair for shard in shards for pair in shard)
    assert sorted(by_index) == list(range(size)), "every example predicted exactly once"
    return [by_index[i] for i in range(size)]


def planned_steps(spec: TrainingSpec, steps_per_epoch: int, samples_per_step: int, saved: TrainerState | None) -> int:
    """`maxSteps`, else `epochs` worth of steps; a resume on another global batch keeps the planned samples."""
    if spec.max_steps:
        return spec.max_steps
    if saved is None or saved.samples_per_step == samples_per_step:
        return max(1, spec.epochs * steps_per_epoch)
    remaining = (saved.max_steps - saved.step) * saved.samples_per_step
    return saved.step + math.ceil(remaining / samples_per_step)


def train(
    spec: TrainingSpec,
    dist: Dist,
    model: torch.nn.Module,
    train_set: Dataset,
    val_set: Dataset,
    collate: Collate | None,
    checkpoints: Checkpointer,
    log: Callable[[str], None],
) -> TrainResult:
    """Train `model` in place (it stays the plain module: no DDP/compile wrapper in its state dict).

    Starts from the newest complete checkpoint in the run directory when there is one.
    """
    device = dist.device
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model.to(device).train()
    options = forward_options(model)
    forward_model = torch.compile(model) if spec.compile else model
    train_stats = torch.compile(loss_stats) if spec.compile else loss_stats
    if dist.is_distributed:
        forward_model = DDP(
            forward_model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )
    # The wait for the other ranks' gradients, measured where DDP starts the all-reduce: busy time = step - wait.
    sync = GradientSync(device) if dist.is_distributed else None
    if sync is not None:
        forward_model.register_comm_hook(sync, GradientSync.hook)
    optimizer = torch.optim.AdamW(
        parameter_groups(model, spec.optimizer.weight_decay),
        lr=spec.optimizer.lr,
        betas=spec.optimizer.betas,
        eps=spec.optimizer.eps,
        # One kernel over all parameters, on a CPU too: there torch's default is a loop over the parameters, which
        # took 3x as long (10 ms a step for the baby GPT's 52 tensors, docs/performance.md).
        fused=True,
    )
    amp_dtype = autocast_dtype(spec.precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)

    batches = TrainBatches(train_set, dist, spec.batch_size, spec.seed, collate)
    steps_per_epoch = batches.batches_per_epoch // spec.grad_accum
    samples_per_step = dist.world_size * spec.batch_size * spec.grad_accum
    resumed = checkpoints.load_latest(model, optimizer, scaler)
    saved, saved_rng = resumed or (None, None)
    state = TrainerState(
        max_steps=planned_steps(spec, steps_per_epoch, samples_per_step, saved),
        world_size=dist.world_size,
        samples_per_step=samples_per_step,
    )
    if saved is not None:
        state = replace(saved, max_steps=state.max_steps, world_size=dist.world_size, samples_per_step=samples_per_step)
        batches.epoch, batches.position = saved.epoch, saved.position
        log(
            f"resuming from {step_name(saved.step)}: epoch {saved.epoch}, {saved.position} samples into it,"
            f" {saved.tokens:,} tokens seen; world size {saved.world_size} then, {dist.world_size} now"
        )
    val_batches = eval_loader(val_set, dist, spec.batch_size, collate)
    # A periodic evaluation's estimate: `evalBatches` global batches of the split, the same on any world size.
    estimate_set = evenly_spaced(val_set, spec.eval_batches * dist.world_size * spec.batch_size)
    estimate_batches = eval_loader(estimate_set, dist, spec.batch_size, collate) if spec.eval_batches else val_batches
    to_go = f", {state.max_steps - state.step} to go" if saved is not None else ""
    log(
        f"training {state.max_steps} steps ({state.max_steps / max(steps_per_epoch, 1):.2f} epochs){to_go}: world"
        f" size {dist.world_size}, {samples_per_step} examples per step, {len(train_set)} train / {len(val_set)} val"
    )

    metrics = TrainingMetrics(spec, dist, model, state.max_steps)
    tracker = Tracker(spec, dist.is_main, checkpoints.run_dir, None if saved is None else saved.step)
    progress = ProgressReporter.from_env() if dist.is_main else ProgressReporter(None)  # a TrainJob's status
    watchdog = Watchdog(dist, sync, metrics)
    slowdown = test_slowdown(dist.rank)

    def report_eval(prefix: str, loader: DataLoader = estimate_batches) -> Evaluation:
        with watchdog.long_work("evaluation"):
            result = evaluate(model, loader, dist, amp_dtype)
        metrics.evaluated(result.loss, result.accuracy)
        tracker.log(state.step, {"eval/loss": result.loss, "eval/accuracy": result.accuracy})
        log(f"{prefix} | val loss {result.loss:.4f} | val accuracy {result.accuracy:.4f}")
        return result

    def report_checkpoint() -> None:
        metrics.checkpoint_saved(checkpoints.last_save)
        tracker.checkpoint_saved(checkpoints.last_save)

    def save(wait: bool = False) -> None:
        state.interval_totals, state.epoch_totals = interval.saved(), epoch_totals.saved()
        state.epoch, state.position = batches.epoch, batches.position
        with watchdog.long_work("checkpoint save"):
            checkpoints.save(model, optimizer, scaler, state, wait=wait)
        report_checkpoint()

    # Summed on each rank, over ranks when logged; on resume rank 0 carries the saved sums.
    carried = dist.is_main and saved is not None
    interval = Totals(device, state.interval_totals if carried else None)  # since the last log line
    epoch_totals = Totals(device, state.epoch_totals if carried else None)  # since the epoch began
    stream = metrics.timed(iter(batches))  # measures the data wait
    is_ddp = isinstance(forward_model, DDP)
    train_loss = float("nan")
    final_eval: Evaluation | None = None
    grad_norm: torch.Tensor | None = None  # measured by clipping
    # Each rank draws its own dropout masks; a resume puts back exactly the generator state it saved.
    torch.manual_seed(spec.seed + dist.rank)
    if saved_rng is not None:
        set_rng_state(saved_rng, device)
    first_step = state.step + 1
    reuse_freed_memory()
    started = interval_start = time.perf_counter()
    with StopRequest(dist) as stop_request, watchdog, progress:
        while state.step < state.max_steps:
            step_started, step_tokens = time.perf_counter(), 0
            lr = lr_at(state.step, state.max_steps, spec.optimizer.lr, spec.schedule)
            for group in optimizer.param_groups:
                group["lr"] = lr
            epochs_before = batches.completed_epochs
            if slowdown:
                time.sleep(slowdown)
            for micro in range(spec.grad_accum):
                watchdog.waiting_for_data(True)
                batch = to_device(next(stream), device)
                watchdog.waiting_for_data(False)
                last_micro = micro == spec.grad_accum - 1
                with contextlib.nullcontext() if last_micro or not is_ddp else forward_model.no_sync():
                    with autocast(device, amp_dtype):
                        loss_sum, correct, count, _ = batch_stats(forward_model, batch, options, train_stats)
                        loss = loss_sum / count / spec.grad_accum
                    scaler.scale(loss).backward()
                tokens = batch["input_ids"].numel()
                interval.add(loss_sum, correct, count, tokens)
                epoch_totals.add(loss_sum, correct, count, tokens)
                step_tokens += tokens
            if sync is not None:
                sync.backward_done()
            if spec.grad_clip > 0:
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.samples += samples_per_step
            step_seconds = time.perf_counter() - step_started
            metrics.step_done(state.step, step_seconds, spec.batch_size * spec.grad_accum, step_tokens)
            watchdog.step_done(state.step, step_seconds)
            done, max_steps = state.step, state.max_steps
            if done == first_step:
                settle_heap()
                step_timeouts(dist)  # the first step (compile, warm-up) had the long bound

            stop_votes = None
            if done % spec.log_every == 0 or done == max_steps:
                # The stop flags ride along: no reduction of their own at log steps.
                logged, stop_votes = interval.summed(stop_request.vote(step_seconds, device))
                train_loss = logged.loss
                now = time.perf_counter()
                state.tokens += int(logged.tokens)
                tokens_per_second = logged.tokens / (now - interval_start)
                # grad_norm.item(): one more read at a step that already waits for the all-reduce above.
                norm = None if grad_norm is None else grad_norm.item()
                metrics.logged(train_loss, lr, norm, tokens_per_second)
                tracker.log(
                    done,
                    {
                        "train/loss": train_loss,
                        "train/accuracy": logged.accuracy,
                        "train/learning_rate": lr,
                        "train/grad_norm": norm,
                        "train/tokens_per_second": tokens_per_second,
                    },
                )
                progress.report(
                    done,
                    max_steps,
                    {
                        "loss": train_loss,
                        "accuracy": logged.accuracy,
                        "tokens_per_second": tokens_per_second,
                        "step": done,
                    },
                )
                report_checkpoint()  # a background save may have finished since
                log(
                    f"step {done}/{max_steps} | loss {train_loss:.4f} | accuracy {logged.accuracy:.4f}"
                    f" | lr {lr:.2e} | {tokens_per_second:,.0f} tok/s"
                )
                if not math.isfinite(train_loss):
                    raise_non_finite("training loss", train_loss, done, checkpoints)
                interval.zero()
                interval_start = now
            state.val_loss = None
            if batches.completed_epochs > epochs_before:
                epoch = batches.completed_epochs
                summed, _ = epoch_totals.summed()
                log(f"epoch {epoch} | train loss {summed.loss:.4f} | accuracy {summed.accuracy:.4f}")
                epoch_totals.zero()
                if done < max_steps:  # the last evaluation is the final one, done by the caller
                    state.val_loss = report_eval(f"epoch {epoch}").loss
            elif spec.eval_every and done % spec.eval_every == 0 and done < max_steps:
                state.val_loss = report_eval(f"step {done}/{max_steps}").loss

            if stop_request.agreed(done, step_seconds, stop_votes):
                save(wait=True)  # synchronous, after any background save still running
                log(f"stop requested (SIGTERM): saved {step_name(done)} at step {done}/{max_steps}")
                return result(state, batches, train_loss, started, preempted=True)
            if (spec.checkpoint.every and done % spec.checkpoint.every == 0) or done == max_steps:
                if spec.checkpoint.keep_best and done == max_steps:  # exact: it is the final report's too
                    final_eval = report_eval(f"step {done}/{max_steps} (final)", val_batches)
                    state.val_loss = final_eval.loss
                elif spec.checkpoint.keep_best and state.val_loss is None:
                    state.val_loss = report_eval(f"step {done}/{max_steps} (checkpoint)").loss
                if state.val_loss is not None and not math.isfinite(state.val_loss):
                    raise_non_finite("validation loss", state.val_loss, done, checkpoints)
                if state.val_loss is not None and (state.best_val_loss is None or state.val_loss < state.best_val_loss):
                    state.best_val_loss, state.best_step = state.val_loss, done
                save()
    checkpoints.wait()
    report_checkpoint()
    return result(state, batches, train_loss, started, preempted=False, final_eval=final_eval)


def settle_heap() -> None:
    """Collect once, then keep every object alive now out of later collections.

    After the first step the heap holds the model, the data, compiled code and torch.compile's
    tracing garbage. Left alone, the collector's next full pass scans all of it: a third of a
    second for a small model on a CPU, at a different step on each rank, and every other rank
    waits for it at the next all-reduce. Here all ranks pay once, at the same step. At exit the
    interpreter's last collection sees everything again: extension modules that check for leaked
    objects then find none.
    """
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


# glibc's mallopt parameters, and the largest mmap threshold its own heuristic goes up to on 64-bit.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 * 2**20


def reuse_freed_memory() -> None:
    """Have malloc keep freed host blocks of up to 32 MiB for the next step instead of returning them.

    glibc maps every block from 128 KiB up on its own and unmaps it when freed; it raises that
    threshold (up to 32 MiB) only once the process frees such a block. So a rank's history
    decides: rank 0, which tokenizes the corpus, ends up with a high threshold, and the others
    got the tokens from its cache, kept the low one and faulted every activation in again at
    every step (the CPU bench's rank 1: 10,000 to 18,000 page faults a step, 7-14% of its time).
    Setting what the heuristic would reach makes every rank alike. A no-op where the C library
    has no mallopt (macOS).
    """
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
        mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_MAX)


def raise_non_finite(what: str, value: float, step: int, checkpoints: Checkpointer) -> None:
    """Stop before a diverged model can be saved over good checkpoints."""
    newest = checkpoints.committed()
    where = checkpoints.store.describe()
    kept = f"{newest[-1][1]} in {where} is the newest checkpoint" if newest else "no checkpoint yet"
    raise FloatingPointError(f"{what} is {value} at step {step}; {kept} (lower optimizer.lr or set gradClip)")


def result(
    state: TrainerState,
    batches: TrainBatches,
    train_loss: float,
    started: float,
    preempted: bool,
    final_eval: Evaluation | None = None,
) -> TrainResult:
    return TrainResult(
        steps=state.step,
        epochs=batches.epochs_done,
        samples=state.samples,
        tokens=state.tokens,
        train_loss=train_loss,
        seconds=time.perf_counter() - started,
        preempted=preempted,
        final_eval=final_eval,
    )

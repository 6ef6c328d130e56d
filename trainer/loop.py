"""Train and evaluate: one obvious path through a step, nanoGPT-style.

A step: set the LR, run `gradAccum` micro-batches (all but the last under
`no_sync`, so DDP all-reduces gradients once per step), clip, step, log.
Every task feeds batches as dicts with `input_ids` and `labels` (token targets for
language modelling, one class id per row for classification): the loss is the
cross-entropy of the model's logits against `labels` either way.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from trainer.data import Collate, TrainBatches, eval_loader
from trainer.dist import Dist, all_reduce_sum
from trainer.metrics import TrainingMetrics
from trainer.models import parameter_groups
from trainer.spec import ScheduleSpec, TrainingSpec

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


def forward_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits flattened to (targets, classes), in fp32 whatever the autocast dtype."""
    logits = model(**{k: v for k, v in batch.items() if k not in NOT_INPUTS}).logits
    return logits.float().flatten(0, -2)


def batch_stats(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """(summed loss, correct predictions, targets, predictions) of one batch."""
    logits = forward_logits(model, batch)
    targets = batch["labels"].flatten()
    loss_sum = F.cross_entropy(logits, targets, reduction="sum")
    predicted = logits.detach().argmax(-1)
    return loss_sum, (predicted == targets).sum(), targets.numel(), predicted


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
    totals = torch.zeros(3, dtype=torch.float64, device=dist.device)  # loss sum, correct, count
    for batch in loader:
        batch = to_device(batch, dist.device)
        with autocast(dist.device, amp_dtype):
            loss_sum, correct, count, predicted = batch_stats(model, batch)
        totals += torch.stack([loss_sum.double(), correct.double(), torch.tensor(count, device=dist.device)])
        if predictions is not None:
            predictions += zip(batch["index"].tolist(), predicted.tolist(), strict=True)
    model.train()
    loss_sum, correct, count = all_reduce_sum(totals).tolist()
    return Evaluation(loss=loss_sum / max(count, 1), accuracy=correct / max(count, 1), count=int(count))


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


def train(
    spec: TrainingSpec,
    dist: Dist,
    model: torch.nn.Module,
    train_set: Dataset,
    val_set: Dataset,
    collate: Collate | None,
    log: Callable[[str], None],
) -> TrainResult:
    """Train `model` in place (it stays the plain module: no DDP/compile wrapper in its state dict)."""
    device = dist.device
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model.to(device).train()
    forward_model = torch.compile(model) if spec.compile else model
    if dist.is_distributed:
        forward_model = DDP(
            forward_model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )
    optimizer = torch.optim.AdamW(
        parameter_groups(model, spec.optimizer.weight_decay),
        lr=spec.optimizer.lr,
        betas=spec.optimizer.betas,
        eps=spec.optimizer.eps,
        fused=device.type == "cuda",
    )
    amp_dtype = autocast_dtype(spec.precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)

    batches = TrainBatches(train_set, dist, spec.batch_size, spec.seed, collate)
    steps_per_epoch = batches.batches_per_epoch // spec.grad_accum
    max_steps = spec.max_steps or max(1, spec.epochs * steps_per_epoch)
    val_batches = eval_loader(val_set, dist, spec.batch_size, collate)
    samples_per_step = dist.world_size * spec.batch_size * spec.grad_accum
    log(
        f"training {max_steps} steps ({max_steps / max(steps_per_epoch, 1):.2f} epochs): world size"
        f" {dist.world_size}, {samples_per_step} examples per step, {len(train_set)} train / {len(val_set)} val"
    )

    metrics = TrainingMetrics(spec, dist, model)

    def report_eval(prefix: str) -> None:
        result = evaluate(model, val_batches, dist, amp_dtype)
        metrics.evaluated(result.loss, result.accuracy)
        log(f"{prefix} | val loss {result.loss:.4f} | val accuracy {result.accuracy:.4f}")

    stream = metrics.timed(iter(batches))  # measures the data wait
    is_ddp = isinstance(forward_model, DDP)
    # loss sum, correct, targets, tokens: summed locally, all-reduced when logged.
    interval = torch.zeros(4, dtype=torch.float64, device=device)
    epoch_totals = torch.zeros(3, dtype=torch.float64, device=device)
    started = interval_start = time.perf_counter()
    tokens, train_loss = 0, float("nan")
    grad_norm: torch.Tensor | None = None  # measured by clipping
    for step in range(max_steps):
        step_started, step_tokens = time.perf_counter(), 0
        lr = lr_at(step, max_steps, spec.optimizer.lr, spec.schedule)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(spec.grad_accum):
            _, batch = next(stream)
            batch = to_device(batch, device)
            last_micro = micro == spec.grad_accum - 1
            with contextlib.nullcontext() if last_micro or not is_ddp else forward_model.no_sync():
                with autocast(device, amp_dtype):
                    loss_sum, correct, count, _ = batch_stats(forward_model, batch)
                    loss = loss_sum / count / spec.grad_accum
                scaler.scale(loss).backward()
            stats = torch.stack([loss_sum.detach().double(), correct.double(), torch.tensor(count, device=device)])
            interval[:3] += stats
            epoch_totals += stats
            interval[3] += batch["input_ids"].numel()
            step_tokens += batch["input_ids"].numel()
        if spec.grad_clip > 0:
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        metrics.step_done(time.perf_counter() - step_started, spec.batch_size * spec.grad_accum, step_tokens)

        done = step + 1
        if done % spec.log_every == 0 or done == max_steps:
            loss_sum_all, correct_all, count_all, tokens_all = all_reduce_sum(interval).tolist()
            train_loss = loss_sum_all / count_all
            now = time.perf_counter()
            tokens += int(tokens_all)
            tokens_per_second = tokens_all / (now - interval_start)
            # grad_norm.item(): one more read at a step that already waits for the all-reduce above.
            metrics.logged(train_loss, lr, None if grad_norm is None else grad_norm.item(), tokens_per_second)
            log(
                f"step {done}/{max_steps} | loss {train_loss:.4f} | accuracy {correct_all / count_all:.4f}"
                f" | lr {lr:.2e} | {tokens_per_second:,.0f} tok/s"
            )
            interval.zero_()
            interval_start = now
        if steps_per_epoch and done % steps_per_epoch == 0:
            epoch = done // steps_per_epoch
            loss_sum_all, correct_all, count_all = all_reduce_sum(epoch_totals).tolist()
            log(f"epoch {epoch} | train loss {loss_sum_all / count_all:.4f} | accuracy {correct_all / count_all:.4f}")
            epoch_totals.zero_()
            if done < max_steps:  # the last evaluation is the final one, done by the caller
                report_eval(f"epoch {epoch}")
        elif spec.eval_every and done % spec.eval_every == 0 and done < max_steps:
            report_eval(f"step {done}/{max_steps}")
    return TrainResult(
        steps=max_steps,
        epochs=max_steps / max(steps_per_epoch, 1),
        samples=max_steps * samples_per_step,
        tokens=tokens,
        train_loss=train_loss,
        seconds=time.perf_counter() - started,
    )

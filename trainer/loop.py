"""Train and evaluate: one obvious path through a step, nanoGPT-style.

A step: set the LR, run `gradAccum` micro-batches (all but the last under
`no_sync`, so DDP all-reduces gradients once per step), clip, step, log.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from trainer.data import TokenBlocks, TrainBatches, eval_loader
from trainer.dist import Dist, all_reduce_sum
from trainer.models import parameter_groups
from trainer.spec import ScheduleSpec, TrainingSpec


@dataclass(frozen=True)
class TrainResult:
    steps: int
    samples: int
    tokens: int
    train_loss: float
    eval_loss: float
    eval_tokens: int
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


def lm_loss(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Next-token cross-entropy, computed in fp32 whatever the autocast dtype."""
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, loader: DataLoader, dist: Dist, amp_dtype: torch.dtype | None
) -> tuple[float, int]:
    """Exact mean loss over the whole split: per-rank sums and counts, all-reduced."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=dist.device)
    for inputs, targets in loader:
        inputs = inputs.to(dist.device, non_blocking=True)
        targets = targets.to(dist.device, non_blocking=True)
        with autocast(dist.device, amp_dtype):
            totals[0] += lm_loss(model, inputs, targets, reduction="sum").double()
        totals[1] += targets.numel()
    model.train()
    all_reduce_sum(totals)
    return (totals[0] / totals[1]).item(), int(totals[1].item())


def train(
    spec: TrainingSpec,
    dist: Dist,
    model: torch.nn.Module,
    train_set: TokenBlocks,
    val_set: TokenBlocks,
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

    batches = TrainBatches(train_set, dist, spec.batch_size, spec.seed)
    max_steps = spec.max_steps or max(1, spec.epochs * batches.batches_per_epoch // spec.grad_accum)
    val_batches = eval_loader(val_set, dist, spec.batch_size)
    samples_per_step = dist.world_size * spec.batch_size * spec.grad_accum
    tokens_per_step = samples_per_step * train_set.block_size
    log(
        f"training {max_steps} steps: world size {dist.world_size}, {samples_per_step} sequences"
        f" x {train_set.block_size} tokens per step, {len(train_set)} train / {len(val_set)} val sequences"
    )

    stream = iter(batches)
    loss_sum = torch.zeros((), device=device)
    started = interval_start = time.perf_counter()
    last_logged = 0
    train_loss = float("nan")
    for step in range(max_steps):
        lr = lr_at(step, max_steps, spec.optimizer.lr, spec.schedule)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(spec.grad_accum):
            _, (inputs, targets) = next(stream)
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            last_micro = micro == spec.grad_accum - 1
            sync = (
                contextlib.nullcontext()
                if last_micro or not isinstance(forward_model, DDP)
                else forward_model.no_sync()
            )
            with sync:
                with autocast(device, amp_dtype):
                    loss = lm_loss(forward_model, inputs, targets) / spec.grad_accum
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
        if spec.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        done = step + 1
        if done % spec.log_every == 0 or done == max_steps:
            train_loss = all_reduce_sum(loss_sum).item() / dist.world_size / (done - last_logged)
            now = time.perf_counter()
            tokens_per_second = tokens_per_step * (done - last_logged) / (now - interval_start)
            log(f"step {done}/{max_steps} | loss {train_loss:.4f} | lr {lr:.2e} | {tokens_per_second:,.0f} tok/s")
            loss_sum.zero_()
            last_logged, interval_start = done, now
        if spec.eval_every and done % spec.eval_every == 0 and done < max_steps:
            eval_loss, _ = evaluate(model, val_batches, dist, amp_dtype)
            log(f"step {done}/{max_steps} | eval loss {eval_loss:.4f} | perplexity {math.exp(eval_loss):.2f}")

    seconds = time.perf_counter() - started
    eval_loss, eval_tokens = evaluate(model, val_batches, dist, amp_dtype)
    log(f"final | eval loss {eval_loss:.4f} | perplexity {math.exp(eval_loss):.2f} | {seconds:.1f} s")
    return TrainResult(
        steps=max_steps,
        samples=max_steps * samples_per_step,
        tokens=max_steps * tokens_per_step,
        train_loss=train_loss,
        eval_loss=eval_loss,
        eval_tokens=eval_tokens,
        seconds=seconds,
    )

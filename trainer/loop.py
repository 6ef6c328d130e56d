"""Train and evaluate: one obvious path through a step, nanoGPT-style.

A step: set the LR, run `gradAccum` micro-batches (all but the last under
`no_sync`, so DDP all-reduces gradients once per step), clip, step, log.
Every task feeds batches as dicts with `input_ids` and `labels` (token targets for
language modelling, one class id per row for classification): the loss is the
cross-entropy of the model's logits against `labels` either way.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from trainer.checkpoint import Checkpointer, TrainerState, set_rng_state, step_name
from trainer.data import Collate, PadCollator, TrainBatches, eval_loader, evenly_spaced
from trainer.dist import Dist, StopRequest, step_timeouts
from trainer.heap import freeze
from trainer.metrics import TrainingMetrics
from trainer.models import forward_options, parameter_groups
from trainer.names import WARNING_PREFIX
from trainer.progress import ProgressReporter
from trainer.spec import ScheduleSpec, TrainingSpec
from trainer.totals import Totals
from trainer.tracking import Tracker
from trainer.watchdog import GradientSync, Watchdog, test_slowdown
from trainer.workloads import Workload

# Keys of a batch that are not model inputs.
NOT_INPUTS = ("labels", "index")


@dataclass(frozen=True)
class Evaluation:
    loss: float
    accuracy: float
    count: int  # targets scored: tokens (language modelling) or examples (classification)
    predictions: list[int] | None = None  # every example's predicted class, in dataset order, when asked for


@dataclass(frozen=True)
class TrainResult:
    steps: int
    epochs: float
    samples: int
    tokens: int
    train_loss: float | None  # of the last log interval; None before the first
    seconds: float  # training's wall time over every start (TrainerState.train_seconds)
    # The final model over the whole validation split, the final report's too; None when stopped by SIGTERM after
    # saving a checkpoint (preempted): the run is not finished.
    final_eval: Evaluation | None


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


def slow_precision_warning(dtype: torch.dtype | None, device: torch.device) -> str | None:
    """A line for rank 0 when half precision asked of a CPU will be far slower than fp32, else None.

    A CPU without native bf16/fp16 matrix instructions (AVX512-BF16, AMX, AVX512-FP16) multiplies in those types
    through a generic kernel: on an AVX2 machine with torch 2.14 and 2.15, 1.3 GFLOP/s against 84 in fp32, and a
    4 x 256 GPT-2 trained 21 times slower (docs/performance.md). `auto` never picks them on a CPU; a spec may.
    """
    if dtype is None or device.type != "cpu":
        return None
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    if getattr(torch.ops.mkldnn, f"_is_mkldnn_{name}_supported")():  # what oneDNN and Inductor consult
        return None
    return (
        f"{WARNING_PREFIX}training.precision: {name} on a CPU without native {name} matrix instructions: its"
        " matrix products run tens of times slower than in fp32 here; training.precision: auto (fp32 on a CPU)"
        " trains faster"
    )


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


class Scored(torch.nn.Module):
    """A model with its loss: a batch in, (summed loss, correct predictions, predictions) out, in fp32 whatever
    the autocast dtype.

    With `compile: true` this module is what is compiled: one compilation (not one for the model and one for
    the loss), and the fp32 upcast, the cross-entropy and the argmax read the logits once inside it, which for a
    language model's (batch x block x vocabulary) is most of what a step moves through memory outside the
    matrix multiplies. Its parameters are the model's, in the model's order.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.options = forward_options(model)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.model(**{k: v for k, v in batch.items() if k not in NOT_INPUTS}, **self.options).logits
        logits = logits.float().flatten(0, -2)
        targets = batch["labels"].flatten()
        loss_sum = F.cross_entropy(logits, targets, reduction="sum")
        predicted = logits.detach().argmax(-1)
        return loss_sum, (predicted == targets).sum(), predicted


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loader: DataLoader,
    dist: Dist,
    amp_dtype: torch.dtype | None,
    predict: bool = False,
) -> Evaluation:
    """Exact loss and accuracy over the whole split: per-rank sums and counts, all-reduced.

    With `predict` (classification), every example's predicted class too, gathered from every rank.
    """
    model.eval()
    scored = Scored(model)
    totals = Totals(dist.device)
    predictions: list[tuple[int, int]] = []  # this rank's (example index, predicted class)
    for batch in loader:
        batch = to_device(batch, dist.device)
        with autocast(dist.device, amp_dtype):
            loss_sum, correct, predicted = scored(batch)
        totals.add(loss_sum, correct, batch["labels"].numel())
        if predict:
            predictions += zip(batch["index"].tolist(), predicted.tolist(), strict=True)
    model.train()
    summed, _ = totals.summed()
    predicted = gather_predictions(predictions, dist, len(loader.dataset)) if predict else None
    return Evaluation(loss=summed.loss, accuracy=summed.accuracy, count=int(summed.targets), predictions=predicted)


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


def planned_steps(spec: TrainingSpec, examples: int, global_batch: int, saved: TrainerState | None) -> int:
    """`maxSteps`, else the steps that take `epochs` of `examples` training examples as TrainBatches gives them: the
    full global batches of each epoch, in one stream that a step's gradAccum batches may cross an epoch's end in. A
    resume on another global batch (world size, or settings changed under allowConfigChange) takes the steps of this
    batch that finish `epochs` from where the checkpoint stands."""
    if spec.max_steps:
        return spec.max_steps
    batches_per_epoch = examples // global_batch
    if saved is None or saved.samples_per_step == global_batch * spec.grad_accum:
        return max(1, spec.epochs * batches_per_epoch // spec.grad_accum)
    if saved.epoch >= spec.epochs:
        return saved.step
    # A saved place past this split's end (it shrank under allowConfigChange): TrainBatches begins the next epoch.
    rest = max(0, examples - saved.position) // global_batch + (spec.epochs - saved.epoch - 1) * batches_per_epoch
    return saved.step + rest // spec.grad_accum


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did: what the log, evaluation and checkpoint rules look at."""

    step: int  # steps done, this one included
    lr: float
    seconds: float
    tokens: int  # input tokens this rank trained on
    ended_epoch: int | None  # the epoch this step completed, when it completed one
    grad_norm: torch.Tensor | None  # before clipping, on the device: read at log steps only


def make_optimizer(spec: TrainingSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        parameter_groups(model, spec.optimizer.weight_decay),
        lr=spec.optimizer.lr,
        betas=spec.optimizer.betas,
        eps=spec.optimizer.eps,
        # One kernel over all parameters, on a CPU too: there torch's default is a loop over the parameters, which
        # took 3x as long (10 ms a step for the baby GPT's 52 tensors, docs/performance.md).
        fused=True,
    )


def wrap_model(spec: TrainingSpec, dist: Dist, model: torch.nn.Module) -> tuple[torch.nn.Module, GradientSync | None]:
    """`model` on the device in training mode; the module the training steps call (Scored, compiled, DDP), and the
    gradient wait it measures when distributed."""
    if dist.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model.to(dist.device).train()
    forward_model = torch.compile(Scored(model)) if spec.compile else Scored(model)
    # One process has no gradients to exchange, nor a process group (trainer.dist).
    if dist.world_size == 1:
        return forward_model, None
    device = dist.device
    ddp = DDP(forward_model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    # The wait for the other ranks' gradients, measured where DDP starts the all-reduce: busy time = step - wait.
    sync = GradientSync(device)
    ddp.register_comm_hook(sync, GradientSync.hook)
    return ddp, sync


def compiled(seconds: float) -> str:
    """What the first step compiled, and how much of it torch.compile's caches already held: a recreated pod's are
    in the run directory (docs/operations.md). From torch's own tally of its graph cache."""
    # Here, not at the top: dynamo takes seconds to import on a slow machine, and a rank that stops on bad input
    # before its first step should not wait for it (DDP and torch's optimizers import it by the end of that step).
    from torch._dynamo.utils import counters
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    hits, misses = (counters["inductor"][f"fxgraph_cache_{outcome}"] for outcome in ("hit", "miss"))
    where = cache_dir()  # $TORCHINDUCTOR_CACHE_DIR, else torch's default (/tmp/torchinductor_$USER)
    return (
        f"first step in {seconds:.1f} s with torch.compile: {hits + misses} graph(s), {hits} from the cache ({where})"
    )


def evaluation_loaders(
    spec: TrainingSpec, dist: Dist, val_set: Dataset, collate: Collate | None
) -> tuple[DataLoader, DataLoader]:
    """The whole validation split's batches, and a periodic evaluation's estimate: `evalBatches` global batches of
    it, the same examples on any world size (the whole split's loader when 0)."""
    whole = eval_loader(val_set, dist, spec.batch_size, collate)
    if not spec.eval_batches:
        return whole, whole
    estimate_set = evenly_spaced(val_set, spec.eval_batches * dist.world_size * spec.batch_size)
    return whole, eval_loader(estimate_set, dist, spec.batch_size, collate)


class Trainer:
    """One run of the loop: setup here, `step()` one optimizer step, `train()` the steps and the rules around them.

    Trains the workload's model in place (it stays the plain module: no DDP/compile wrapper in its state dict),
    from the newest complete checkpoint in the run directory when there is one.
    """

    def __init__(
        self,
        spec: TrainingSpec,
        dist: Dist,
        work: Workload,
        checkpoints: Checkpointer,
        tracker: Tracker,
        log: Callable[[str], None],
    ) -> None:
        self.spec, self.dist, self.device, self.model = spec, dist, dist.device, work.model
        self.checkpoints, self.log, self.val_set, self.predict = checkpoints, log, work.val, work.predict
        model, collate = work.model, work.collate
        self.forward_model, self.sync = wrap_model(spec, dist, model)
        self.padded = isinstance(collate, PadCollator)  # each batch as long as its longest example
        self.optimizer = make_optimizer(spec, model)
        self.amp_dtype = autocast_dtype(spec.precision, self.device)
        if dist.is_main and (warning := slow_precision_warning(self.amp_dtype, self.device)):
            print(warning, file=sys.stderr, flush=True)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)
        self.batches = TrainBatches(work.train, dist, spec.batch_size, spec.seed, collate)
        self.samples_per_step = dist.world_size * spec.batch_size * spec.grad_accum
        self.state = TrainerState()
        checkpoints.attach(model, self.optimizer, self.scaler, self.state)
        resumed, self.saved_rng = checkpoints.load_latest() or (None, None)
        self.plan(resumed)
        self.val_batches, self.estimate_batches = evaluation_loaders(spec, dist, work.val, collate)
        self.metrics = TrainingMetrics(spec, dist, model, self.state.max_steps)
        self.tracker = tracker
        tracker.start_events(None if resumed is None else resumed.step)
        self.progress = ProgressReporter.from_env() if dist.is_main else ProgressReporter(None)  # a TrainJob's status
        self.watchdog = Watchdog(dist, self.sync, self.metrics)
        self.slowdown = test_slowdown(dist.rank)
        # Summed on each rank, over ranks when logged; on resume rank 0 carries the saved sums.
        carried = dist.is_main and resumed is not None
        self.interval = Totals(self.device, self.state.interval_totals if carried else None)  # since the last log
        self.epoch_totals = Totals(self.device, self.state.epoch_totals if carried else None)  # since the epoch began
        self.stream = self.metrics.timed(iter(self.batches))  # measures the data wait
        self.started = self.interval_start = 0.0
        self.seconds_before = self.state.train_seconds  # the starts before this one's (0 on a first start)

    def plan(self, resumed: TrainerState | None) -> None:
        """The planned steps, from where the resumed checkpoint stood (the attached state holds it); a line on them."""
        state, dist = self.state, self.dist
        steps_per_epoch = self.batches.batches_per_epoch / self.spec.grad_accum  # >= 1 batch: TrainBatches checks it
        state.max_steps = planned_steps(self.spec, len(self.batches.dataset), self.batches.global_batch, resumed)
        state.world_size, state.samples_per_step = dist.world_size, self.samples_per_step
        if resumed is not None:
            self.batches.epoch, self.batches.position = resumed.epoch, resumed.position
            self.log(
                f"resuming from {step_name(resumed.step)}: epoch {resumed.epoch}, {resumed.position} samples into it,"
                f" {resumed.tokens:,} tokens seen; world size {resumed.world_size} then, {dist.world_size} now"
            )
        steps_to_go = max(0, state.max_steps - state.step)
        to_go = f", {steps_to_go} to go" if resumed is not None else ""
        # Where the plan ends, from where the checkpoint stood: its steps may have been of another global batch.
        epochs = self.batches.epochs_done + steps_to_go / steps_per_epoch
        self.log(
            f"training {state.max_steps} steps ({epochs:.2f} epochs){to_go}: world"
            f" size {dist.world_size}, {self.samples_per_step} examples per step,"
            f" {len(self.batches.dataset)} train / {len(self.val_set)} val"
        )

    # -- the loop -------------------------------------------------------------------------------

    def train(self) -> TrainResult:
        """Step to `max_steps`, or to an agreed stop request (SIGTERM): log, evaluate and save by the spec's rules."""
        state, spec = self.state, self.spec
        # Each rank draws its own dropout masks; a resume puts back exactly the generator state it saved.
        torch.manual_seed(spec.seed + self.dist.rank)
        if self.saved_rng is not None:
            set_rng_state(self.saved_rng, self.device)
        first_step = state.step + 1
        final: Evaluation | None = None
        reuse_freed_memory()
        self.started = self.interval_start = time.perf_counter()
        with StopRequest(self.dist) as stop_request, self.watchdog, self.progress:
            while state.step < state.max_steps:
                stats = self.step()
                if stats.step == first_step:
                    settle_heap()
                    step_timeouts(self.dist)  # the first step (compile, warm-up) had the long bound
                    if spec.compile:
                        self.log(compiled(stats.seconds))
                votes = self.log_step(stats, stop_request) if self.is_log_step(stats.step) else None
                state.val_loss = self.evaluate_periodically(stats)
                if stop_request.agreed(stats.step, stats.seconds, votes):
                    self.save(wait=True)  # synchronous, after any background save still running
                    self.log(f"stop requested (SIGTERM): saved {step_name(stats.step)} at {self.progress_text()}")
                    return self.result(final_eval=None)
                if self.is_checkpoint_step(stats.step):
                    final = self.checkpoint()
            if final is None:
                final = self.final_evaluation()
        self.checkpoints.wait()
        self.report_checkpoint()
        return self.result(final)

    def step(self) -> StepStats:
        """One optimizer step: set the LR, `gradAccum` micro-batches, clip, update."""
        spec, state = self.spec, self.state
        started = time.perf_counter()
        lr = lr_at(state.step, state.max_steps, spec.optimizer.lr, spec.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        epochs_before = self.batches.completed_epochs
        if self.slowdown:
            time.sleep(self.slowdown)
        tokens = sum(self.micro_step(last=micro == spec.grad_accum - 1) for micro in range(spec.grad_accum))
        if self.sync is not None:
            self.sync.backward_done()
        grad_norm = None
        if spec.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), spec.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.samples += self.samples_per_step
        seconds = time.perf_counter() - started
        self.metrics.step_done(state.step, seconds, spec.batch_size * spec.grad_accum, tokens)
        self.watchdog.step_done(state.step, seconds)
        epochs = self.batches.completed_epochs
        return StepStats(state.step, lr, seconds, tokens, epochs if epochs > epochs_before else None, grad_norm)

    def micro_step(self, last: bool) -> int:
        """Forward and backward of one micro-batch (its gradients all-reduced only on the `last`); its input tokens."""
        self.watchdog.waiting_for_data(True)
        batch = to_device(next(self.stream), self.device)
        self.watchdog.waiting_for_data(False)
        if self.padded:  # compiled for any length at once, not again (30 s for a tiny classifier on a CPU) later
            for name in ("input_ids", "attention_mask"):
                torch._dynamo.maybe_mark_dynamic(batch[name], 1)
        ddp = isinstance(self.forward_model, DDP)
        with contextlib.nullcontext() if last or not ddp else self.forward_model.no_sync():
            with autocast(self.device, self.amp_dtype):
                loss_sum, correct, _ = self.forward_model(batch)
                count = batch["labels"].numel()
                loss = loss_sum / count / self.spec.grad_accum
            self.scaler.scale(loss).backward()
        tokens = batch["input_ids"].numel()
        self.interval.add(loss_sum, correct, count, tokens)
        self.epoch_totals.add(loss_sum, correct, count, tokens)
        return tokens

    # -- the rules ------------------------------------------------------------------------------

    def is_log_step(self, done: int) -> bool:
        return done % self.spec.log_every == 0 or done == self.state.max_steps

    def is_checkpoint_step(self, done: int) -> bool:
        every = self.spec.checkpoint.every
        return bool(every and done % every == 0) or done == self.state.max_steps

    def progress_text(self) -> str:
        return f"step {self.state.step}/{self.state.max_steps}"

    def log_step(self, stats: StepStats, stop_request: StopRequest) -> list[float]:
        """The steps since the last log step, summed over ranks, to every output; returns the ranks' stop votes."""
        # The stop flags ride along: no reduction of their own at log steps.
        logged, votes = self.interval.summed(stop_request.vote(stats.seconds, self.device))
        self.state.train_loss = logged.loss
        now = time.perf_counter()
        self.state.tokens += int(logged.tokens)
        tokens_per_second = logged.tokens / (now - self.interval_start)
        # grad_norm.item(): one more read at a step that already waits for the all-reduce above.
        norm = None if stats.grad_norm is None else stats.grad_norm.item()
        self.metrics.logged(logged.loss, stats.lr, norm, tokens_per_second)
        self.tracker.log(
            stats.step,
            {
                "train/loss": logged.loss,
                "train/accuracy": logged.accuracy,
                "train/learning_rate": stats.lr,
                "train/grad_norm": norm,
                "train/tokens_per_second": tokens_per_second,
            },
        )
        progress = {"loss": logged.loss, "accuracy": logged.accuracy, "tokens_per_second": tokens_per_second}
        self.progress.report(stats.step, self.state.max_steps, progress | {"step": stats.step})
        self.report_checkpoint()  # a background save may have finished since
        self.log(
            f"{self.progress_text()} | loss {logged.loss:.4f} | accuracy {logged.accuracy:.4f}"
            f" | lr {stats.lr:.2e} | {tokens_per_second:,.0f} tok/s"
        )
        if not math.isfinite(logged.loss):
            raise_non_finite("training loss", logged.loss, stats.step, self.checkpoints)
        self.interval.zero()
        self.interval_start = now
        return votes

    def evaluate_periodically(self, stats: StepStats) -> float | None:
        """An epoch's line at its end; the estimate there and every `evalEvery` steps, but for the last step's."""
        done, last = stats.step, stats.step == self.state.max_steps
        if stats.ended_epoch is not None:
            summed, _ = self.epoch_totals.summed()
            self.log(f"epoch {stats.ended_epoch} | train loss {summed.loss:.4f} | accuracy {summed.accuracy:.4f}")
            self.epoch_totals.zero()
            if not last:  # the last evaluation is the final one
                return self.report_eval(f"epoch {stats.ended_epoch}").loss
        elif self.spec.eval_every and done % self.spec.eval_every == 0 and not last:
            return self.report_eval(self.progress_text()).loss
        return None

    def checkpoint(self) -> Evaluation | None:
        """Save this step, with `keepBest` evaluating it first when nothing did; returns the final evaluation when
        the last step's keepBest made it.

        keepBest compares like with like: every checkpoint's loss, the last one's too, is the periodic estimate
        over the same `evalBatches` batches (the whole split when 0: then the last one's is the exact final
        evaluation as well, made once).
        """
        state, final = self.state, None
        if self.spec.checkpoint.keep_best and state.val_loss is None:
            last = state.step == state.max_steps
            if last and self.estimate_batches is self.val_batches:
                final = self.final_evaluation()
                state.val_loss = final.loss
            else:  # the last step's estimate is for keepBest alone: the final evaluation is what gets reported
                state.val_loss = self.report_eval(f"{self.progress_text()} (checkpoint)", track=not last).loss
        if state.val_loss is not None and not math.isfinite(state.val_loss):
            raise_non_finite("validation loss", state.val_loss, state.step, self.checkpoints)
        if state.val_loss is not None and (state.best_val_loss is None or state.val_loss < state.best_val_loss):
            state.best_val_loss, state.best_step = state.val_loss, state.step
        self.save()
        return final

    def final_evaluation(self) -> Evaluation:
        """The final model over the whole validation split, reported like every evaluation; not finite, it stops the
        run before the export and the report could replace a good run's."""
        result = self.report_eval(f"{self.progress_text()} (final)", self.val_batches, predict=self.predict)
        if not math.isfinite(result.loss):
            raise_non_finite("final validation loss", result.loss, self.state.step, self.checkpoints)
        return result

    def report_eval(
        self,
        prefix: str,
        loader: DataLoader | None = None,
        track: bool = True,
        predict: bool = False,
    ) -> Evaluation:
        """Evaluate on `loader` (the periodic estimate's by default), then log it, and with `track` report it."""
        with self.watchdog.long_work("evaluation"):
            result = evaluate(self.model, loader or self.estimate_batches, self.dist, self.amp_dtype, predict)
        self.metrics.evaluated(result.loss, result.accuracy)
        if track:
            self.tracker.log(self.state.step, {"eval/loss": result.loss, "eval/accuracy": result.accuracy})
        self.log(f"{prefix} | val loss {result.loss:.4f} | val accuracy {result.accuracy:.4f}")
        return result

    def save(self, wait: bool = False) -> None:
        state = self.state
        state.interval_totals, state.epoch_totals = self.interval.saved(), self.epoch_totals.saved()
        state.epoch, state.position = self.batches.epoch, self.batches.position
        state.train_seconds = self.train_seconds()
        with self.watchdog.long_work("checkpoint save"):
            if self.checkpoints.store.uploads:  # the volume's event file stays open: nothing to upload
                self.tracker.seal_events()
            self.checkpoints.save(wait=wait)
        self.report_checkpoint()

    def report_checkpoint(self) -> None:
        self.metrics.checkpoint_saved(self.checkpoints.last_save)
        self.tracker.checkpoint_saved(self.checkpoints.last_save)

    def result(self, final_eval: Evaluation | None) -> TrainResult:
        return TrainResult(
            steps=self.state.step,
            epochs=self.batches.epochs_done,
            samples=self.state.samples,
            tokens=self.state.tokens,
            train_loss=self.state.train_loss,
            seconds=self.train_seconds(),
            final_eval=final_eval,
        )

    def train_seconds(self) -> float:
        return self.seconds_before + time.perf_counter() - self.started


def settle_heap() -> None:
    """Collect once, then keep every object alive now out of later collections.

    After the first step the heap holds the model, the data, compiled code and torch.compile's
    tracing garbage. Left alone, the collector's next full pass scans all of it: a third of a
    second for a small model on a CPU, at a different step on each rank, and every other rank
    waits for it at the next all-reduce. Here all ranks pay once, at the same step (the imports'
    objects were frozen at the start, trainer/heap.py).
    """
    gc.collect()
    freeze()


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


class NonFiniteLoss(FloatingPointError):
    """A loss summed over every rank is not finite: every rank raises this at the same step, so it is the job's
    failure, not one rank's (trainer.failures.Failure.everywhere)."""


def raise_non_finite(what: str, value: float, step: int, checkpoints: Checkpointer) -> None:
    """Stop before a diverged model can be saved over good checkpoints."""
    newest = checkpoints.committed()
    where = checkpoints.store.describe()
    kept = f"{newest[-1][1]} in {where} is the newest checkpoint" if newest else "no checkpoint yet"
    raise NonFiniteLoss(
        f"the {what} went non-finite ({value}) at step {step}; {kept} (lower training.optimizer.lr or set"
        " training.gradClip)"
    )

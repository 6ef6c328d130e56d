"""What char-gpt and causal-lm share: token blocks from a prepared stream, the perplexity report, sampling."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from trainer.data import TokenBlocks, check_enough_samples, open_tokens, raise_block_too_long
from trainer.dist import Dist
from trainer.loop import Evaluation
from trainer.models import sample_tokens
from trainer.prepare import Plan
from trainer.spec import TrainingSpec
from trainer.workloads import Workload


def token_splits(plan: Plan, manifest: dict[str, Any], val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Train and validation token streams: the val files' own, else the end of train."""
    train = open_tokens(plan.entry, "train", manifest)
    if "val" in manifest["splits"]:
        return train, open_tokens(plan.entry, "val", manifest)
    cut = int(len(train) * (1 - val_fraction))
    return train[:cut], train[cut:]


def blocks(
    spec: TrainingSpec, dist: Dist, plan: Plan, manifest: dict[str, Any], unit: str
) -> tuple[TokenBlocks, TokenBlocks]:
    block = spec.model.block_size
    train_ids, val_ids = token_splits(plan, manifest, spec.data.val_fraction)
    train_set, val_set = TokenBlocks(train_ids, block), TokenBlocks(val_ids, block)
    # A split without one whole block: blockSize is what to change (checked before the batch count it empties).
    if not len(val_set):
        raise_block_too_long(block, len(val_ids), unit, "validation")
    if not len(train_set):
        raise_block_too_long(block, len(train_ids), unit, "training")
    check_enough_samples(len(train_set), dist, spec.batch_size, "training.data.train")
    return train_set, val_set


def perplexity(loss: float) -> float:
    """exp(loss): infinite past a float's range (a loss above ~709, a model that diverged), not an OverflowError."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def final_report(
    spec: TrainingSpec, dist: Dist, work: Workload, log: Callable[[str], None], evaluated: Evaluation
) -> dict[str, Any]:
    """Validation loss, perplexity and token accuracy of the final model (`evaluated`: the training loop's final
    evaluation, over the whole validation split)."""
    result = evaluated
    log(f"final | val loss {result.loss:.4f} | perplexity {perplexity(result.loss):.2f}")
    return {
        "task": spec.task,
        "split": "val",
        "eval_loss": result.loss,
        "perplexity": perplexity(result.loss),
        "eval_tokens": result.count,
        "token_accuracy": result.accuracy,
    }


def generate(
    spec: TrainingSpec,
    work: Workload,
    encode: Callable[[str], Any],
    decode: Callable[[list[int]], str],
    log: Callable[[str], None],
) -> None:
    """`sample.maxNewTokens` tokens after `sample.prompt`, seeded: the same text for the same model."""
    if not spec.sample.max_new_tokens:
        return
    torch.manual_seed(spec.seed)
    options = spec.sample
    prompt = torch.as_tensor(encode(options.prompt)).tolist()
    block = spec.model.block_size
    new = sample_tokens(work.model, prompt, options.max_new_tokens, block, options.temperature, options.top_k)
    log(f"sample:\n{options.prompt}{decode(new)}\n")

"""causal-lm: GPT-2 (pretrained, a named size, or dimensions) trained on packed text."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trainer.dist import Dist
from trainer.models import build_causal_lm, check_pretrained_block_size
from trainer.prepare import TOKENIZER_DIR
from trainer.spec import TrainingSpec
from trainer.tasks.language_model import blocks, final_report, generate
from trainer.text import load_tokenizer
from trainer.workloads import Workload, given_tokenizer, prepared

__all__ = ["final_report", "load", "sample"]


def load(spec: TrainingSpec, dist: Dist, run_dir: Path) -> Workload:
    check_pretrained_block_size(spec.model)  # before the data is prepared
    tokenizer = given_tokenizer(spec, dist)
    plan, manifest = prepared(spec, dist, run_dir, tokenizer)
    tokenizer = tokenizer or load_tokenizer(str(plan.entry / TOKENIZER_DIR), "tokenizer")
    train_set, val_set = blocks(spec, dist, plan, manifest, "tokens")
    return Workload(build_causal_lm(spec.model, tokenizer), tokenizer, train_set, val_set, plan)


def sample(spec: TrainingSpec, work: Workload, log: Callable[[str], None]) -> None:
    generate(spec, work, lambda text: work.tokenizer(text)["input_ids"], work.tokenizer.decode, log)

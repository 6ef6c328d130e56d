"""char-gpt: a small GPT trained from scratch on characters (nanoGPT's shakespeare_char), any text corpus."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainer.data import CharVocab
from trainer.dist import Dist
from trainer.models import build_char_gpt
from trainer.spec import TrainingSpec
from trainer.tasks.language_model import blocks, final_report, generate
from trainer.workloads import Workload, prepared

__all__ = ["final_report", "load", "sample"]


@dataclass
class CharWorkload(Workload):
    tokenizer: CharVocab  # the prepared data's characters: encodes the sample's prompt


def load(spec: TrainingSpec, dist: Dist, run_dir: Path) -> CharWorkload:
    plan, manifest = prepared(spec, dist, run_dir, None)
    vocab = CharVocab(list(manifest["chars"]))
    train_set, val_set = blocks(spec, dist, plan, manifest, "characters")
    model = build_char_gpt(spec.model, vocab.size, vocab.special_id)
    return CharWorkload(model, vocab, train_set, val_set, plan)


def sample(spec: TrainingSpec, work: CharWorkload, log: Callable[[str], None]) -> None:
    generate(spec, work, work.tokenizer.encode, work.tokenizer.decode, log)

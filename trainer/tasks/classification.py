"""classification: GPT2ForSequenceClassification on labelled documents; the final report per class."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer import stdlib_docstrings
from trainer.data import LabelledExamples, PadCollator, check_enough_samples, eval_loader
from trainer.dist import Dist
from trainer.loop import Evaluation, autocast_dtype, evaluate
from trainer.models import build_classifier, check_pretrained_block_size
from trainer.prepare import TOKENIZER_DIR
from trainer.report import classification_report, format_report
from trainer.spec import TrainingSpec
from trainer.text import load_tokenizer
from trainer.workloads import Workload, given_tokenizer, main_rank_first, prepared


@dataclass
class ClassificationWorkload(Workload):
    labels: list[str] = field(kw_only=True)  # class names, in class-id order
    test: LabelledExamples | None = field(default=None, kw_only=True)  # the final report's split (else val)


def builtin_files(spec: TrainingSpec, dist: Dist, run_dir: Path) -> dict[str, Path] | None:
    """The built-in dataset, built by rank 0 into the run directory; None without one."""
    if not spec.data.builtin:
        return None
    built = run_dir / "data" / spec.data.builtin
    return main_rank_first(
        dist,
        lambda: (
            stdlib_docstrings.build(built)
            if dist.is_main
            else {s: built / f"{s}.jsonl" for s in stdlib_docstrings.SPLITS}
        ),
    )


def load(spec: TrainingSpec, dist: Dist, run_dir: Path) -> ClassificationWorkload:
    check_pretrained_block_size(spec.model)  # before the data is prepared
    tokenizer = given_tokenizer(spec, dist)
    plan, manifest = prepared(spec, dist, run_dir, tokenizer, builtin_files(spec, dist, run_dir))
    tokenizer = tokenizer or load_tokenizer(str(plan.entry / TOKENIZER_DIR), "tokenizer")
    splits = manifest["splits"]
    if "val" in splits:
        train_set = LabelledExamples(plan.entry, "train", manifest)
        val_set = LabelledExamples(plan.entry, "val", manifest)
    else:  # a seeded shuffle, so a file sorted by label still gives a mixed validation split
        documents = splits["train"]["documents"]
        order = np.random.default_rng(spec.seed).permutation(documents)
        held_out = max(1, int(documents * spec.data.val_fraction))
        train_set = LabelledExamples(plan.entry, "train", manifest, np.sort(order[held_out:]))
        val_set = LabelledExamples(plan.entry, "train", manifest, np.sort(order[:held_out]))
    check_enough_samples(len(train_set), dist, spec.batch_size, "training.data.train")
    labels = manifest["labels"]
    return ClassificationWorkload(
        build_classifier(spec.model, tokenizer, labels),
        tokenizer,
        train_set,
        val_set,
        plan,
        PadCollator(tokenizer.pad_token_id),
        labels=labels,
        test=LabelledExamples(plan.entry, "test", manifest) if "test" in splits else None,
        predict="test" not in splits,
    )


def final_report(
    spec: TrainingSpec,
    dist: Dist,
    work: ClassificationWorkload,
    log: Callable[[str], None],
    evaluated: Evaluation,
) -> dict[str, Any]:
    """Loss, accuracy and per-class precision/recall/F1 on the test split (else val): the same for any world size.

    Without a test split, `evaluated` (the loop's final evaluation, with every prediction: Workload.predict) is
    the report's; a test split is evaluated here."""
    split, dataset, result = "val", work.val, evaluated
    if work.test is not None:
        split, dataset = "test", work.test
        loader = eval_loader(dataset, dist, spec.batch_size, work.collate)
        result = evaluate(work.model, loader, dist, autocast_dtype(spec.precision, dist.device), predict=True)
    assert result.predictions is not None
    metrics = classification_report(work.labels, dataset.labels, result.predictions)
    majority = max(metrics["per_class"].values(), key=lambda c: c["support"])["support"] / metrics["support"]
    log(
        f"final | {split} loss {result.loss:.4f} | accuracy {metrics['accuracy']:.4f}"
        f" (best constant prediction: {majority:.4f})"
    )
    log(format_report(metrics))
    return {"task": spec.task, "split": split, "eval_loss": result.loss} | metrics


def sample(spec: TrainingSpec, work: ClassificationWorkload, log: Callable[[str], None]) -> None:
    """A classifier writes no text."""

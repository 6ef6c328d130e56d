"""Periodic evaluations on a budget (`evalBatches`), the final one exact."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml
from conftest import run_ctl, tensorboard_scalars, tiny_spec

from trainer.checkpoint import step_name

PERIODIC = re.compile(r"step 3/6 \| val loss (\S+)")
FINAL = re.compile(r"step 6/6 \(final\) \| val loss (\S+)")
LAST_CHECKPOINT = re.compile(r"step 6/6 \(checkpoint\) \| val loss (\S+)")


def run(workdir: Path, corpus: Path, name: str, procs: int, **training) -> tuple[str, dict, Path]:
    """(rank 0's output, report.json, run directory) of a 6-step run evaluated at step 3 and at the end."""
    spec = tiny_spec(corpus, maxSteps=6, evalEvery=3, batchSize=4 // procs, sample={"maxNewTokens": 0}, **training)
    spec_file = workdir / f"{name}.yaml"
    spec_file.write_text(yaml.safe_dump(spec | {"name": name, "procsPerNode": procs}))
    result = run_ctl("run", str(spec_file), cwd=workdir)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = workdir / "runs" / name
    return result.stdout, json.loads((run_dir / "report.json").read_text()), run_dir


def test_periodic_evaluations_estimate_and_the_final_one_is_exact(tmp_path, corpus_file) -> None:
    whole, whole_report, _ = run(tmp_path, corpus_file, "whole", 1)
    budget, budget_report, budget_dir = run(tmp_path, corpus_file, "budget", 1, evalBatches=2)
    _, ddp_report, ddp_dir = run(tmp_path, corpus_file, "budget-ddp", 2, evalBatches=2)

    # Step 3's evaluation scored 2 global batches (8 blocks) spread over the split, not all of it.
    assert PERIODIC.search(budget)[1] != PERIODIC.search(whole)[1]
    # The final evaluation is exact whatever the budget: the same loss over the same tokens.
    assert budget_report["eval_loss"] == pytest.approx(whole_report["eval_loss"], abs=1e-6)
    assert budget_report["eval_tokens"] == whole_report["eval_tokens"]
    # The final evaluation's line is the report's.
    assert float(FINAL.search(budget)[1]) == pytest.approx(budget_report["eval_loss"], abs=5e-5)

    # The estimate scores the same examples on any world size: 2 processes give 1 process's values.
    steps, estimates = zip(*tensorboard_scalars(budget_dir)["eval/loss"], strict=True)
    ddp_steps, ddp_estimates = zip(*tensorboard_scalars(ddp_dir)["eval/loss"], strict=True)
    assert ddp_steps == steps == (3, 6)
    assert ddp_estimates == pytest.approx(estimates, abs=1e-5)
    assert ddp_report["eval_loss"] == pytest.approx(budget_report["eval_loss"], abs=1e-5)


def test_keep_best_ranks_every_checkpoint_by_the_same_estimate(tmp_path, corpus_file) -> None:
    """keepBest compares like with like: the last checkpoint's loss is the estimate over the evalBatches batches too,
    as every earlier one's, not the exact final evaluation."""
    output, report, run_dir = run(tmp_path, corpus_file, "best", 1, evalBatches=2, checkpoint={"every": 3})
    saved = {step: json.loads((run_dir / step_name(step) / "state.json").read_text())["trainer"] for step in (3, 6)}
    assert saved[3]["val_loss"] == pytest.approx(float(PERIODIC.search(output)[1]), abs=5e-5)
    assert saved[6]["val_loss"] == pytest.approx(float(LAST_CHECKPOINT.search(output)[1]), abs=5e-5)
    assert saved[6]["val_loss"] != pytest.approx(report["eval_loss"], abs=1e-6)
    best = min(saved.values(), key=lambda state: state["val_loss"])
    assert saved[6]["best_val_loss"] == best["val_loss"]


def test_a_diverged_model_has_an_infinite_perplexity_written_as_null(tmp_path: Path) -> None:
    """A final loss above ~709 overflows exp(): the run still ends with its report, whose JSON any reader takes."""
    from trainer.rundir import write_report
    from trainer.tasks.language_model import perplexity

    assert perplexity(1000.0) == math.inf and math.isnan(perplexity(math.nan))
    report = {"eval_loss": 1000.0, "perplexity": perplexity(1000.0), "per_class": {"a": [math.nan, 1.0]}}

    def refuse(constant: str) -> None:
        raise AssertionError(f"report.json holds {constant}, which JSON has not")

    written = json.loads(write_report(tmp_path, report).read_text(), parse_constant=refuse)
    assert written == {"eval_loss": 1000.0, "perplexity": None, "per_class": {"a": [None, 1.0]}}

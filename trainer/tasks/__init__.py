"""One module per task, each with the same small interface:

    load(spec, dist, run_dir) -> Workload        its prepared data (from the cache, or prepared now),
                                                 datasets and model
    final_report(spec, dist, work, log, evaluated)
                  -> dict                        the final evaluation, as report.json holds it (`evaluated`:
                                                 the loop's of the final model on the whole validation split,
                                                 with every prediction when Workload.predict)
    sample(spec, work, log) -> None              rank 0, after the export: text from the final model

`trainer.__main__` runs any task the same way: load, train, report, export, sample.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from trainer.dist import Dist
from trainer.spec import TrainingSpec
from trainer.tasks import causal_lm, char_gpt, classification
from trainer.workloads import Workload, check_same_vocabulary

TASKS: dict[str, ModuleType] = {"char-gpt": char_gpt, "causal-lm": causal_lm, "classification": classification}


def load(spec: TrainingSpec, dist: Dist, run_dir: Path) -> tuple[ModuleType, Workload]:
    """The spec's task module and what its `load` returned."""
    task = TASKS[spec.task]
    work = task.load(spec, dist, run_dir)
    check_same_vocabulary(work, run_dir)
    return task, work

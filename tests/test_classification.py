"""GPT-2 document classification: exact distributed report, a plain-transformers final/, bad data."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, run_ctl
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from ctl.names import COMPILE_CACHE_DIR, COMPILE_CACHES
from trainer import stdlib_docstrings
from trainer.report import CLASSES_SHOWN, classification_report, format_report

TINY_MODEL = {"nLayer": 1, "nHead": 2, "nEmbd": 64, "blockSize": 64}


@pytest.fixture(scope="module")
def docstrings(tmp_path_factory) -> dict[str, Path]:
    """Real labelled data: stdlib docstrings, cut small; 7 test documents (uneven over 2 and 3 ranks)."""
    root = tmp_path_factory.mktemp("docstrings")
    built = stdlib_docstrings.build(root / "full")
    sizes = {"train": 240, "val": 20, "test": 7}
    files = {}
    for split, size in sizes.items():
        rows = random.Random(0).sample(built[split].read_text().splitlines(), size)
        files[split] = root / f"{split}.jsonl"
        files[split].write_text("\n".join(rows) + "\n")
    return files


def classification_spec(files: dict[str, Path], **training) -> dict:
    return {
        "name": "classify",
        "nodes": 1,
        "procsPerNode": 1,
        "training": {
            "task": "classification",
            "model": TINY_MODEL,
            "tokenizer": {"vocabSize": 300},
            "data": {split: str(path) for split, path in files.items()},
            "optimizer": {"lr": 0.003},
            "batchSize": 8,
            "logEvery": 5,
        }
        | training,
    }


def ctl_run(workdir: Path, spec: dict, name: str, *flags: str):
    spec_file = workdir / f"{name}.yaml"
    spec_file.write_text(yaml.safe_dump(spec | {"name": name}))
    return run_ctl("run", str(spec_file), *flags, cwd=workdir)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, docstrings) -> Path:
    """A classifier trained for a few epochs on 2 processes; returns its run directory."""
    workdir = tmp_path_factory.mktemp("trained")
    result = ctl_run(workdir, classification_spec(docstrings, epochs=4) | {"procsPerNode": 2}, "trained")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| val accuracy" in result.stdout and "confusion matrix" in result.stdout
    return workdir / "runs" / "trained"


def test_report_shape_and_it_beats_chance(trained: Path) -> None:
    report = json.loads((trained / "report.json").read_text())
    assert report["split"] == "test" and report["support"] == 7 and report["world_size"] == 2
    assert report["labels"] == sorted(report["per_class"])
    assert sum(cell["count"] for cell in report["confusion"]) == 7
    assert set(report["macro_avg"]) == {"precision", "recall", "f1"} == set(report["weighted_avg"])
    for row in report["per_class"].values():
        assert set(row) == {"precision", "recall", "f1", "support"}


def test_the_example_classifier_clearly_beats_the_majority_baseline(tmp_path) -> None:
    """examples/classification.yaml as users run it (2 processes, the built-in stdlib docstrings)."""
    result = run_ctl("run", str(REPO / "examples" / "classification.yaml"), "--run-dir", "run", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    train_labels = [
        json.loads(line)["label"]
        for line in (tmp_path / "run" / "data" / "stdlib-docstrings" / "train.jsonl").read_text().splitlines()
    ]
    majority = max(set(train_labels), key=train_labels.count)
    baseline = report["per_class"][majority]["support"] / report["support"]
    assert report["accuracy"] >= 0.6 and report["accuracy"] > 2 * baseline, (report["accuracy"], baseline)
    # Copied elsewhere (new modification times), the run resumes from its checkpoint and its prepared data: its
    # built-in files had been recorded by path and time, so the copy was refused ("train.jsonl is new since ...").
    shutil.copytree(tmp_path / "run", tmp_path / "copy", copy_function=shutil.copy)
    copied = run_ctl("run", str(REPO / "examples" / "classification.yaml"), "--run-dir", "copy", cwd=tmp_path)
    assert copied.returncode == 0, copied.stdout + copied.stderr
    assert "resuming from step-" in copied.stdout and "0 to go" in copied.stdout, copied.stdout
    assert len(list((tmp_path / "_datasets").iterdir())) == 1  # the same dataset: not prepared again


def test_final_model_loads_with_plain_transformers_and_predicts_labels_by_name(trained, docstrings) -> None:
    model = AutoModelForSequenceClassification.from_pretrained(trained / "final").eval()
    tokenizer = AutoTokenizer.from_pretrained(trained / "final")
    report = json.loads((trained / "report.json").read_text())
    assert [model.config.id2label[i] for i in range(len(report["labels"]))] == report["labels"]
    # The tokenizer's limit is the model's, so `truncation=True` alone fits any document to it.
    assert tokenizer.model_max_length == model.config.n_positions == TINY_MODEL["blockSize"]
    rows = [json.loads(line) for line in docstrings["test"].read_text().splitlines()]
    correct = 0
    for row in rows:
        inputs = tokenizer(row["text"], truncation=True, return_tensors="pt")
        with torch.no_grad():
            predicted = model.config.id2label[model(**inputs).logits.argmax(-1).item()]
        assert predicted in report["labels"]
        correct += predicted == row["label"]
    assert correct / len(rows) == report["accuracy"]


def test_rows_labelled_with_numbers_keep_them_in_order(tmp_path, docstrings) -> None:
    """Labels 0, 4, ..., 20 (numbers, as a Hugging Face ClassLabel exports them) are classes "0" to "20" in the
    order of their values, not of their text ("12" before "4"): id2label, the report."""
    names = sorted({json.loads(line)["label"] for line in docstrings["train"].read_text().splitlines()})
    numbers = {name: 4 * i for i, name in enumerate(names)}
    files = {}
    for split, path in docstrings.items():
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        files[split] = tmp_path / path.name
        files[split].write_text("".join(json.dumps(row | {"label": numbers[row["label"]]}) + "\n" for row in rows))
    result = ctl_run(tmp_path, classification_spec(files, maxSteps=2), "numbers")
    assert result.returncode == 0, result.stdout + result.stderr
    labels = [str(4 * i) for i in range(len(names))]
    assert json.loads((tmp_path / "runs" / "numbers" / "report.json").read_text())["labels"] == labels
    config = json.loads((tmp_path / "runs" / "numbers" / "final" / "config.json").read_text())
    assert [config["id2label"][str(i)] for i in range(len(labels))] == labels


@pytest.mark.parametrize("procs", [1, 3])
def test_report_is_the_same_for_any_number_of_processes(tmp_path, trained, docstrings, procs) -> None:
    """The trained model re-evaluated (one step at a negligible LR) on 1 and 3 ranks gives the report its training on
    2 ranks gave (the reference: a third run on 2 would repeat it): 7 test documents, uneven over 3."""
    spec = classification_spec(
        docstrings, model={"pretrained": str(trained / "final"), "blockSize": 64}, maxSteps=1, batchSize=2
    ) | {"procsPerNode": procs}
    spec["training"]["optimizer"] = {"lr": 1e-12}
    spec["training"].pop("tokenizer")
    result = ctl_run(tmp_path, spec, f"eval-{procs}")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "runs" / f"eval-{procs}" / "report.json").read_text())
    reference = json.loads((trained / "report.json").read_text())
    for key in ("accuracy", "support", "per_class", "macro_avg", "weighted_avg", "labels", "confusion"):
        assert report[key] == reference[key], key
    assert math.isclose(report["eval_loss"], reference["eval_loss"], rel_tol=1e-5)
    assert report["world_size"] == procs


def test_without_a_test_split_the_final_model_is_evaluated_once(tmp_path, docstrings, monkeypatch) -> None:
    """The report on the validation split is the loop's final evaluation, which kept every prediction: the final
    model is scored once (here, in one process, every evaluation counted as it runs)."""
    from trainer import loop
    from trainer.__main__ import run
    from trainer.dist import Dist
    from trainer.spec import TrainingSpec
    from trainer.tasks import classification
    from trainer.tracking import finish

    evaluate, scored = loop.evaluate, []

    def counted(model, loader, *args, **kwargs):  # the real evaluation, counted
        scored.append(len(loader.dataset))
        return evaluate(model, loader, *args, **kwargs)

    monkeypatch.setattr(loop, "evaluate", counted)
    monkeypatch.setattr(classification, "evaluate", counted)
    files = {split: docstrings[split] for split in ("train", "val")}
    training = classification_spec(files, maxSteps=2, checkpoint={"dir": str(tmp_path / "run")})["training"]
    code = run(TrainingSpec.model_validate(training), Dist(0, 0, 1, torch.device("cpu")))
    finish(code)  # as the trainer's main does: TensorBoard's writer thread ends
    assert code == 0
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["split"] == "val" and report["support"] == 20
    assert sum(cell["count"] for cell in report["confusion"]) == 20
    assert scored == [20]


def test_compile_compiles_the_model_with_its_loss_once_for_every_batch_length(tmp_path, docstrings) -> None:
    """`compile: true` compiles one graph, the model and its loss, once: not again when a padded batch is shorter
    than the first (torch.compile's own log tells each compilation)."""
    spec_file = tmp_path / "compiled.yaml"
    spec_file.write_text(yaml.safe_dump(classification_spec(docstrings, maxSteps=6, batchSize=2, compile=True)))
    # Not this process's cache folder: importing transformers' GPT-2 here set it, and ctl keeps an exported variable.
    env = {name: value for name, value in os.environ.items() if name not in COMPILE_CACHES}
    result = run_ctl("run", str(spec_file), "--verbose", cwd=tmp_path, env=env | {"TORCH_LOGS": "dynamo"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.count("torchdynamo start tracing") == 1, result.stderr
    # Its caches are in the run directory, as a pod's are (docs/operations.md), and the first step's line says so.
    caches = tmp_path / "runs" / "classify" / COMPILE_CACHE_DIR / "classify-master-0" / "torchinductor"
    assert f"graph(s), 0 from the cache ({caches})\n" in result.stdout, result.stdout


def test_the_printed_report_of_many_classes_shows_the_best_supported_and_leaves_the_matrix_to_report_json() -> None:
    """Its size must not grow with the classes: 3,000 of them printed 6,000 lines and a matrix 3,000 columns wide."""
    labels = [f"class-{i}" for i in range(3000)]
    truth = [i % 3000 for i in range(6000)] + [7] * 5  # class-7 has the most examples
    printed = format_report(classification_report(labels, truth, truth)).splitlines()
    assert len(printed) < 2 * CLASSES_SHOWN and max(map(len, printed)) < 80
    assert printed[1].split()[0] == "class-7"
    assert f"({3000 - CLASSES_SHOWN} more classes, none with more examples: report.json has them)" in printed
    assert printed[-1] == "confusion matrix: 3000 x 3000 classes, in report.json"


def test_the_report_of_many_classes_grows_with_its_examples_not_the_classes_squared() -> None:
    """The confusion matrix is its nonzero cells: a whole matrix of 20,000 classes is 400 million cells (about 3 GB
    of Python lists), where 5 examples fill at most 5 of them."""
    labels = [f"class-{i}" for i in range(20_000)]
    report = classification_report(labels, [0, 0, 1, 19_999, 19_999], [0, 2, 1, 19_999, 0])
    assert report["confusion"] == [
        {"true": "class-0", "predicted": "class-0", "count": 1},
        {"true": "class-0", "predicted": "class-2", "count": 1},
        {"true": "class-1", "predicted": "class-1", "count": 1},
        {"true": "class-19999", "predicted": "class-0", "count": 1},
        {"true": "class-19999", "predicted": "class-19999", "count": 1},
    ]
    assert report["accuracy"] == 0.6 and report["per_class"]["class-0"]["precision"] == 0.5
    assert report["per_class"]["class-19999"]["recall"] == 0.5 and report["per_class"]["class-2"]["support"] == 0


def test_the_printed_matrix_is_the_whole_matrix() -> None:
    printed = format_report(classification_report(["a", "b", "c"], [0, 0, 1, 2, 2, 2], [0, 1, 1, 0, 2, 2]))
    assert printed.splitlines()[-4:] == [
        "                 a     b     c",
        "           a     1     1     0",
        "           b     0     1     0",
        "           c     1     0     2",
    ]


def test_the_printed_table_aligns_wide_labels_by_their_columns() -> None:
    """Labels of wide characters (CJK, emoji) took two columns each, counted as one: the rows and the matrix's
    columns no longer lined up."""
    printed = format_report(classification_report(["電子メール", "json"], [0, 1, 1], [0, 1, 0])).splitlines()
    assert printed[1] == "  電子メール     0.500     1.000     0.667         1"
    assert printed[-3:] == ["              電子  json", "  電子メール     1     0", "        json     1     1"]


def test_the_printed_report_quotes_a_label_with_blanks_at_an_end() -> None:
    """ " pos" and "pos" (a CSV's `neg, pos`) are two classes: printed alike, they could not be told apart."""
    printed = format_report(classification_report(["pos", " pos"], [0, 1], [0, 0]))
    assert "      ' pos'     0.000" in printed and "\n         pos     0.500" in printed

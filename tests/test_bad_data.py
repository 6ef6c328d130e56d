"""Bad data files: one clear line naming the key and the problem, exit 2, nothing left in the run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import run_ctl, tiny_spec

ROWS = [
    {"text": f"document number {i} about {'cats' if i % 2 else 'dogs'}", "label": "odd" if i % 2 else "even"}
    for i in range(40)
]


def jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


CASES = {
    "missing-file": (lambda d: {"train": str(d / "absent.jsonl")}, "training.data.train: no file matches"),
    "empty-dataset": (lambda d: {"train": jsonl(d / "empty.jsonl", [])}, "training.data.train: no examples in"),
    "row-without-text": (
        lambda d: {"train": jsonl(d / "t.jsonl", [*ROWS, {"label": "odd"}])},
        "t.jsonl:41: no 'text' field (fields: label)",
    ),
    "row-without-label": (
        lambda d: {"train": jsonl(d / "t.jsonl", [*ROWS[:5], {"text": "x"}, *ROWS[5:]])},
        "t.jsonl:6: no 'label' field",
    ),
    # A multi-label row is not one label: it would be a class of its own, named "['odd']".
    "label-is-a-list": (
        lambda d: {"train": jsonl(d / "t.jsonl", [*ROWS[:7], {"text": "x", "label": ["odd", "even"]}, *ROWS[7:]])},
        "t.jsonl:8: 'label' is a list, not a string or a number",
    ),
    "unseen-label-in-val": (
        lambda d: {"train": jsonl(d / "t.jsonl", ROWS), "val": jsonl(d / "v.jsonl", [{"text": "a", "label": "prime"}])},
        "v.jsonl:1: label 'prime' is not in the training data",
    ),
    "unseen-label-in-test": (
        lambda d: {"train": jsonl(d / "t.jsonl", ROWS), "test": jsonl(d / "s.jsonl", [{"text": "a", "label": "zero"}])},
        "s.jsonl:1: label 'zero' is not in the training data",
    ),
    # An integer column in one export, a float column (one with gaps) in another: two classes each, silently.
    "a-label-written-two-ways": (
        lambda d: {
            "train": [
                jsonl(d / "ints.jsonl", [row | {"label": i % 2} for i, row in enumerate(ROWS)]),
                jsonl(d / "floats.jsonl", [row | {"label": float(i % 2)} for i, row in enumerate(ROWS)]),
            ]
        },
        "floats.jsonl:1) are the same number written two ways, which would be two classes: write each label one way"
        " (or, if they are two classes, list them in training.data.labels)",
    ),
    # A CSV's `text, odd`: " odd" beside "odd", two classes printed alike.
    "a-label-with-blanks-at-an-end": (
        lambda d: {"train": jsonl(d / "t.jsonl", [*ROWS, {"text": "x", "label": " odd"}])},
        "t.jsonl:2) are the same label but for blanks at an end, written two ways, which would be two classes",
    ),
    "unseen-label-in-val-written-another-way": (
        lambda d: {
            "train": jsonl(d / "t.jsonl", [row | {"label": i % 2} for i, row in enumerate(ROWS)]),
            "val": jsonl(d / "v.jsonl", [{"text": "a", "label": 0}, {"text": "b", "label": 1.0}]),
        },
        "v.jsonl:2: label '1.0' is not in the training data (1 such label(s); it has '1', the same number written"
        " another way: write each label one way)",
    ),
    "fewer-samples-than-ranks-x-batch": (
        lambda d: {"train": jsonl(d / "t.jsonl", ROWS[:20]), "valFraction": 0.1},
        "training.data.train: 18 samples, fewer than world size x batchSize = 2 x 16",
    ),
    # JSON's escape of half a surrogate pair decodes to a string no UTF-8 tokenizer or report can hold: the run failed
    # with exit 1 in the tokenizer, or, for a label, after training, in the report.
    "half-a-surrogate-pair-in-text": (
        lambda d: {"train": jsonl(d / "t.jsonl", [*ROWS[:9], {"text": "a \ud800 b", "label": "odd"}, *ROWS[9:]])},
        "t.jsonl:10: 'text' holds \\ud800 at character 2, half of a UTF-16 surrogate pair without its other half",
    ),
    "half-a-surrogate-pair-in-a-label": (
        lambda d: {"train": jsonl(d / "t.jsonl", [*ROWS, {"text": "x", "label": "odd\udfff"}])},
        "t.jsonl:41: 'label' holds \\udfff at character 3",
    ),
    "not-utf-8": (
        lambda d: (
            (d / "latin1.csv").write_bytes("text,label\ncaf\xe9,a\n".encode("latin-1"))
            and {"train": str(d / "latin1.csv")}
        ),
        "latin1.csv:2: not UTF-8 text",
    ),
    "invalid-json": (
        lambda d: (
            (d / "broken.jsonl").write_text('{"text": "a", "label": "b"}\n{"text": \n')
            and {"train": str(d / "broken.jsonl")}
        ),
        "broken.jsonl:2: invalid JSON",
    ),
}


# Found in a `ctl run` (by ctl or a trainer rank): one of each place bad data is found (the spec's paths, a file read,
# a label against the training data's, the world size against the prepared data). Every case is found by the same
# readers under `ctl prepare`, one process without torchrun, the test after this one: that the line reaches the
# terminal from a rank is the same path for every message.
FOUND_IN_A_RUN = ["missing-file", "invalid-json", "unseen-label-in-val", "fewer-samples-than-ranks-x-batch"]


def bad_spec(tmp_path: Path, case: str) -> str:
    """The classification spec of `case`'s data, written in `tmp_path`; the message to expect."""
    make_data, message = CASES[case]
    spec = {
        "name": "bad",
        "procsPerNode": 2,
        "training": {
            "task": "classification",
            "model": {"nLayer": 1, "nHead": 2, "nEmbd": 32, "blockSize": 32},
            "data": make_data(tmp_path),
            "batchSize": 16,
        },
    }
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    return message


@pytest.mark.parametrize("case", FOUND_IN_A_RUN)
def test_bad_data_is_one_line_and_exit_2(tmp_path: Path, case: str) -> None:
    message = bad_spec(tmp_path, case)
    result = run_ctl("run", "spec.yaml", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    # One line on the terminal, whichever rank found it first; ranks' own output is not shown.
    assert result.stdout == "" and result.stderr.startswith("error: training.data.") and result.stderr.count("\n") == 1
    assert message in result.stderr, result.stderr
    if case == "fewer-samples-than-ranks-x-batch":  # found after preparing: the complete dataset stays for a rerun
        assert [p.name for p in (tmp_path / "runs").iterdir()] == ["_datasets"]
        assert all((entry / "manifest.json").exists() for entry in (tmp_path / "runs" / "_datasets").iterdir())
    else:
        assert not (tmp_path / "runs").exists()


# The world size is a run's: `ctl prepare` has none to check the samples against.
@pytest.mark.parametrize("case", [case for case in CASES if case != "fewer-samples-than-ranks-x-batch"])
def test_bad_data_found_by_ctl_prepare_is_one_line_and_exit_2(tmp_path: Path, case: str) -> None:
    message = bad_spec(tmp_path, case)
    result = run_ctl("prepare", "spec.yaml", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    # Its own note of what it prepares, then the one line.
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert result.stdout == "" and errors == [result.stderr.splitlines()[-1]], result.stderr
    assert errors[0].startswith("error: training.data.") and message in errors[0], result.stderr
    assert not (tmp_path / "runs").exists()


def test_files_skipped_as_bad_are_a_warning_on_the_terminal_at_every_run(tmp_path: Path, corpus_file: Path) -> None:
    """onBadFile skip: the skip went to the ranks' logs only, and a later run, which maps the prepared data, said
    nothing of it."""
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9\n")
    spec = tiny_spec(corpus_file, maxSteps=1, sample={"maxNewTokens": 0})
    spec["training"]["data"] |= {"train": [str(corpus_file), str(bad)], "onBadFile": "skip"}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    warning = f"warning: skipped 1 bad file(s) (training.data.onBadFile: skip): {bad}; first: "
    for run in ("preparing", "mapping the prepared data"):
        result = run_ctl("run", "spec.yaml", "--set", f"training.checkpoint.dir={tmp_path / run}", cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert warning in result.stdout + result.stderr, run

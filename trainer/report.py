"""The classification report: accuracy, per-class precision/recall/F1, averages, confusion matrix (its nonzero cells).

Pure Python over integer counts, so the same predictions give bit-identical floats
however many processes produced them.
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from typing import Any


def _ratio(numerator: float, denominator: int) -> float:
    return numerator / denominator if denominator else 0.0


def classification_report(labels: list[str], truth: list[int], predicted: list[int]) -> dict[str, Any]:
    """Metrics of `predicted` against `truth` (label ids), sklearn's definitions (zero when undefined). The confusion
    matrix is its cells that are not zero, so the report grows with the examples and the classes, not with the
    classes squared (a matrix of 30,000 classes is 900 million cells)."""
    cells = Counter(zip(truth, predicted, strict=True))
    supports, predicted_as = Counter(truth), Counter(predicted)
    per_class = {}
    for i, label in enumerate(labels):
        true_positive, support = cells[i, i], supports[i]
        precision = _ratio(true_positive, predicted_as[i])
        recall = _ratio(true_positive, support)
        f1 = _ratio(2 * true_positive, support + predicted_as[i])
        per_class[label] = {"precision": precision, "recall": recall, "f1": f1, "support": support}
    total = len(truth)
    metrics = ("precision", "recall", "f1")
    return {
        "accuracy": _ratio(sum(count for (t, p), count in cells.items() if t == p), total),
        "support": total,
        "per_class": per_class,
        "macro_avg": {m: sum(c[m] for c in per_class.values()) / len(labels) for m in metrics},
        "weighted_avg": {m: _ratio(sum(c[m] * c["support"] for c in per_class.values()), total) for m in metrics},
        "labels": labels,
        "confusion": [{"true": labels[t], "predicted": labels[p], "count": n} for (t, p), n in sorted(cells.items())],
    }


def confusion_matrix(report: dict[str, Any]) -> list[list[int]]:
    """The report's whole confusion matrix (rows: true labels, columns: predicted, in the labels' order)."""
    index = {label: i for i, label in enumerate(report["labels"])}
    matrix = [[0] * len(index) for _ in index]
    for cell in report["confusion"]:
        matrix[index[cell["true"]]][index[cell["predicted"]]] = cell["count"]
    return matrix


# Classes the printed report shows: beyond this many, its rows are the best supported, and its matrix is left to
# report.json (3,000 classes printed 6,000 lines, a matrix of 3,000 columns).
CLASSES_SHOWN = 20


def shown_label(label: str) -> str:
    """A label as the table prints it: quoted where blanks at an end would hide it (" pos" beside "pos")."""
    return label if label and label == label.strip() else repr(label)


def columns(text: str) -> int:
    """The terminal columns `text` takes: two for a wide character (CJK, most emoji), none for a combining one."""
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def right(text: str, width: int) -> str:
    """`text` right-aligned in `width` columns (str's `>` counts characters, so wide labels pushed the table out)."""
    return " " * max(0, width - columns(text)) + text


def cut(text: str, width: int) -> str:
    """The start of `text` that fits `width` columns."""
    while columns(text) > width:
        text = text[:-1]
    return text


def format_report(report: dict[str, Any]) -> str:
    """The report as a text table, like sklearn's classification_report plus the confusion matrix; with more than
    CLASSES_SHOWN classes, the best supported classes' rows and no matrix (report.json has all of it)."""
    labels = [shown_label(label) for label in report["labels"]]
    rows = list(zip(labels, report["per_class"].values(), strict=True))
    many = len(rows) > CLASSES_SHOWN
    if many:  # the most examples first; the label order among equals
        rows = sorted(rows, key=lambda pair: -pair[1]["support"])[:CLASSES_SHOWN]
    width = max(12, *(columns(label) for label, _ in rows))
    lines = [f"{'':>{width}} {'precision':>9} {'recall':>9} {'f1':>9} {'support':>9}"]
    for label, row in rows:
        scores = f"{row['precision']:>9.3f} {row['recall']:>9.3f} {row['f1']:>9.3f} {row['support']:>9d}"
        lines.append(f"{right(label, width)} {scores}")
    if many:
        lines.append(f"({len(labels) - CLASSES_SHOWN} more classes, none with more examples: report.json has them)")
    lines.append("")
    lines.append(f"{'accuracy':>{width}} {'':>9} {'':>9} {report['accuracy']:>9.3f} {report['support']:>9d}")
    for name in ("macro_avg", "weighted_avg"):
        avg = report[name]
        lines.append(
            f"{name.replace('_', ' '):>{width}} {avg['precision']:>9.3f} {avg['recall']:>9.3f}"
            f" {avg['f1']:>9.3f} {report['support']:>9d}"
        )
    lines.append("")
    if many:
        lines.append(f"confusion matrix: {len(labels)} x {len(labels)} classes, in report.json")
        return "\n".join(lines)
    lines.append("confusion matrix (rows: true, columns: predicted)")
    matrix = confusion_matrix(report)
    cell = max(5, *(len(str(n)) for row in matrix for n in row))
    lines.append(f"{'':>{width}} " + " ".join(right(cut(label, cell), cell) for label in labels))
    for label, row in zip(labels, matrix, strict=True):
        lines.append(f"{right(label, width)} " + " ".join(f"{n:>{cell}d}" for n in row))
    return "\n".join(lines)

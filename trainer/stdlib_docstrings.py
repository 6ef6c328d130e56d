"""A labelled text dataset that exists on every machine: Python standard library docstrings.

Each module, class and function docstring (at least MIN_CHARS long) of a few packages
becomes one example labelled with its top-level package. Parsed with `ast`, never
imported. The split is a stable hash of where the docstring lives.

    python -m trainer.stdlib_docstrings OUT_DIR   # writes train/val/test.jsonl
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

PACKAGES = ("asyncio", "email", "importlib", "logging", "unittest", "xml")
MIN_CHARS = 40
SPLITS = ("train", "val", "test")


def split_of(place: str) -> str:
    """About 80% train, 10% val, 10% test, by a hash that is the same on every machine."""
    bucket = int(hashlib.sha256(place.encode()).hexdigest(), 16) % 10
    return "test" if bucket == 0 else "val" if bucket == 1 else "train"


def docstrings(stdlib: Path) -> list[dict[str, str]]:
    examples = []
    for package in PACKAGES:
        for path in sorted((stdlib / package).rglob("*.py")):
            if {"test", "tests"} & set(path.relative_to(stdlib).parts):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    text = ast.get_docstring(node)
                    if text and len(text) >= MIN_CHARS:
                        place = f"{path.relative_to(stdlib)}:{getattr(node, 'name', '')}:{getattr(node, 'lineno', 0)}"
                        examples.append({"text": text, "label": package, "split": split_of(place)})
    return examples


def build(out_dir: Path) -> dict[str, Path]:
    """Write train/val/test JSONL files (rows: text, label) into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    examples = docstrings(Path(sysconfig.get_paths()["stdlib"]))
    files = {}
    for split in SPLITS:
        path = out_dir / f"{split}.jsonl"
        rows = [json.dumps({"text": e["text"], "label": e["label"]}) for e in examples if e["split"] == split]
        text = "\n".join(rows) + "\n"
        # Written only when new or changed: a start writes nothing it need not.
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            staging = path.with_suffix(".tmp")
            staging.write_text(text, encoding="utf-8")
            staging.replace(path)
        files[split] = path
    return files


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python -m trainer.stdlib_docstrings OUT_DIR\n{__doc__}")
    for split, path in build(Path(sys.argv[1])).items():
        print(f"{split}: {path}")

"""The start of the trainer's processes: their imports run without the collector's full passes and leave it on,
with everything imported kept out of its later passes (trainer/heap.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.parametrize("entry", ["trainer.__main__", "trainer.launch"])
def test_an_entry_module_imports_without_full_collections_and_leaves_the_collector_on(entry: str) -> None:
    code = (
        f"import gc, json, os, {entry}\n"
        "print(json.dumps([gc.isenabled(), gc.get_freeze_count(), gc.get_stats()[2]['collections']]))\n"
        "os._exit(0)  # as the processes end (trainer/quick_exit.py)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True)
    enabled, frozen, full_collections = json.loads(result.stdout)
    # Before: 6 full passes over the trainer's growing heap while it imported, and none of it frozen.
    assert enabled and full_collections == 0
    assert frozen > 100_000  # torch's objects at least


def test_a_later_heavy_import_frees_its_garbage_before_it_freezes_what_lives() -> None:
    """trainer.heap.importing: a cycle made inside it (a model load's may hold tensors) is freed, not frozen for good;
    what is still referenced is frozen; the collector is on again."""
    code = (
        "import gc, json, weakref\n"
        "from trainer.heap import importing\n"
        "class Node: pass\n"
        "with importing():\n"
        "    garbage = Node(); garbage.self = garbage; dead = weakref.ref(garbage); del garbage\n"
        "    kept = [Node() for _ in range(1000)]\n"
        "print(json.dumps([dead() is None, gc.isenabled(), gc.get_freeze_count() >= 1000]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True)
    assert json.loads(result.stdout) == [True, True, True]

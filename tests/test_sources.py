"""The repository's own text keeps one source per fact: the documents it names exist, helpers are not redefined,
and tests take API coordinates and container names from ctl/kinds instead of typing them again."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

from ctl.kinds import KINDS

SOURCES = sorted([*(REPO / "ctl").rglob("*.py"), *(REPO / "tests").rglob("*.py")])
DOCUMENT = re.compile(r"(?<![/\w.-])[\w.-]+(?:/[\w.-]+)*\.md\b")  # a path, not the tail of a URL


def test_every_document_the_code_and_tests_name_exists() -> None:
    missing = {
        f"{path.relative_to(REPO)}: {name}"
        for path in SOURCES
        for name in DOCUMENT.findall(path.read_text(encoding="utf-8"))
        if not (REPO / name).exists() and not (REPO / "docs" / name).exists()
    }
    assert not missing


def test_free_port_is_defined_once() -> None:
    definitions = [
        path.relative_to(REPO)
        for path in [*SOURCES, *(REPO / "trainer").rglob("*.py"), *(REPO / "bench").rglob("*.py")]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.FunctionDef) and node.name == "free_port"
    ]
    assert definitions == [Path("ctl/processes.py")]


def test_tests_take_api_coordinates_and_container_names_from_the_kinds() -> None:
    # A TrainJob's container shares its name `node` with its replicated job and the pods' node labels: not checked.
    replica_types = {t for kind in KINDS.values() for t in kind.replica_types}
    facts = {
        word
        for kind in KINDS.values()
        for word in (kind.group, kind.api_version, kind.plural, kind.job_label, *kind.index_labels, kind.container)
        if word not in replica_types
    }
    typed = [
        f"{path.relative_to(REPO)}:{node.lineno}: {node.value}"
        for path in (REPO / "tests").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and node.value in facts
    ]
    assert not typed

"""The chart's alert rules, proven with `promtool test rules` on series that model what happens to a job: a pod
recreated (its series replaced by new ones), a slow first step, a real stall, a diverging loss, a missing checkpoint.

Each tests/rules/*_test.yaml is a promtool test file for the PrometheusRule that tests/rules/spec.yaml renders to
(its `rule_files` is rules.yaml, written here next to a copy of it). A new alert needs a test file that fires it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import REPO, prometheus_tool

from ctl.render import render
from ctl.spec import load_spec

RULES = REPO / "tests" / "rules"
TEST_FILES = sorted(RULES.glob("*_test.yaml"))


def rule_groups() -> list[dict]:
    (rule,) = [m.obj for m in render(load_spec(RULES / "spec.yaml")) if m.kind == "PrometheusRule"]
    return rule["spec"]["groups"]


@pytest.mark.parametrize("test_file", TEST_FILES, ids=lambda p: p.stem)
def test_promtool_rule_tests_pass(test_file: Path, tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}))
    assert yaml.safe_load(test_file.read_text())["rule_files"] == ["rules.yaml"]
    shutil.copy(test_file, tmp_path / test_file.name)
    result = subprocess.run(
        [prometheus_tool("promtool"), "test", "rules", test_file.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_fired_by_a_rule_test() -> None:
    """An alert no test fires is an alert nobody knows fires at all."""
    alerts = {rule["alert"] for group in rule_groups() for rule in group["rules"] if "alert" in rule}
    fired = {
        case["alertname"]
        for test_file in TEST_FILES
        for test in yaml.safe_load(test_file.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert alerts - fired == set()

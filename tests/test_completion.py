"""`ctl completion bash|zsh|fish`: the script, and the answers `ctl` gives it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_ctl

BIN = Path(sys.executable).parent  # where the installed `ctl` is, as on a user's PATH


def bash_completions(line: str, tmp_path: Path) -> list[str]:
    """What bash offers after `line` once the script from `ctl completion bash` is sourced."""
    script = run_ctl("completion", "bash", cwd=tmp_path)
    assert script.returncode == 0, script.stderr
    (tmp_path / "ctl.bash").write_text(script.stdout)
    words = line.split(" ")
    program = (
        f"source {tmp_path / 'ctl.bash'}; COMP_WORDS=({' '.join(words)}); COMP_CWORD={len(words) - 1};"
        ' _ctl_completion ctl; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    env = os.environ | {"PATH": f"{BIN}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-c", program], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_bash_completes_commands_and_options(tmp_path: Path) -> None:
    assert bash_completions("ctl sub", tmp_path) == ["submit"]
    assert set(bash_completions("ctl s", tmp_path)) == {"submit", "status", "suspend"}
    assert bash_completions("ctl logs --ta", tmp_path) == ["--tail"]


@pytest.mark.parametrize(
    ("shell", "env", "expected"),
    [
        ("zsh", {"_TYPER_COMPLETE_ARGS": "ctl logs --ta"}, '"--tail"'),
        ("fish", {"_TYPER_COMPLETE_ARGS": "ctl sub", "_TYPER_COMPLETE_FISH_ACTION": "get-args"}, "submit\t"),
    ],
)
def test_zsh_and_fish_scripts_ask_ctl_and_get_candidates(
    tmp_path: Path, shell: str, env: dict[str, str], expected: str
) -> None:
    """zsh and fish need not be installed: what their script runs is replayed (the variables it sets, then ctl)."""
    script = run_ctl("completion", shell, cwd=tmp_path)
    assert script.returncode == 0, script.stderr
    assert f"_CTL_COMPLETE=complete_{shell}" in script.stdout
    assert all(name in script.stdout for name in env)
    answer = subprocess.run(
        [BIN / "ctl"], env=os.environ | env | {"_CTL_COMPLETE": f"complete_{shell}"}, capture_output=True, text=True
    )
    assert answer.returncode == 0, answer.stderr
    assert expected in answer.stdout


def test_an_unknown_shell_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run_ctl("completion", "tcsh", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "error: completion 'tcsh': expected bash, zsh or fish\n"

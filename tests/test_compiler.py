"""compile: true on a machine where torch.compile cannot build its kernels is bad input, found as a rank starts
(`ctl run`: tests/test_failures.py)."""

from __future__ import annotations

import os
import re
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from trainer.compiler import check_compiler
from trainer.loop import compiled
from trainer.spec import SpecError


def test_the_compiler_must_find_pythons_headers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A Python without its development headers (Debian's python3 without python3-dev): the compiler's own line."""
    check_compiler(torch.device("cpu"))  # this machine has both
    monkeypatch.setattr("trainer.compiler.sysconfig.get_path", lambda name: str(tmp_path))
    with pytest.raises(SpecError) as refused:
        check_compiler(torch.device("cpu"))
    assert str(refused.value).startswith(
        f"training.compile: {shutil.which('g++')} cannot build against Python's headers in {tmp_path} ("
    )
    assert "Python.h: No such file or directory" in str(refused.value)
    assert str(refused.value).endswith("): install them (Debian: python3-dev), or set training.compile: false")


def test_on_a_gpu_it_is_tritons_c_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Triton's order: $CC, else gcc, else clang on PATH. No CUDA needed: nothing touches the device."""
    none = (
        "training.compile: torch.compile needs a C compiler for Triton's launchers (CC, gcc, clang), and none"
        " was found: install gcc, or set training.compile: false"
    )
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(SpecError, match=f"^{re.escape(none)}$"):
        check_compiler(torch.device("cuda", 0))
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SpecError, match=f"^{re.escape(none)}$"):
        check_compiler(torch.device("cuda", 0))
    (tmp_path / "clang").symlink_to(shutil.which("gcc", path=os.defpath))
    check_compiler(torch.device("cuda", 0))


def test_a_compiler_that_does_not_run_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "g++"
    broken.write_bytes(b"\x7fELF not a program")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    with pytest.raises(
        SpecError,
        match=f"^training.compile: torch.compile's compiler {re.escape(str(broken))} does not run \\(.*Exec format",
    ):
        check_compiler(torch.device("cpu"))


def test_a_compiler_that_fails_without_an_error_line_is_still_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrapper's own failure (ccache, distcc) need not say "error": its first line, never its whole output."""
    failing = tmp_path / "g++"
    monkeypatch.setenv("CXX", str(failing))
    farm = "cannot reach the build farm"
    for stderr, why in ((f"{farm}\nretrying\ngave up", farm), ("", "exit 3")):
        failing.write_text(f"#!/bin/sh\nprintf '{stderr}' >&2\nexit 3\n")
        failing.chmod(0o755)
        with pytest.raises(SpecError) as refused:
            check_compiler(torch.device("cpu"))
        line = str(refused.value)
        assert "\n" not in line and f"against Python's headers in {sysconfig.get_path('include')} ({why}):" in line


def test_the_first_steps_line_names_torchs_default_cache_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside ctl and the chart (a plain torchrun) no cache folder is set: the line names torch's own."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert compiled(1.0).endswith(f" from the cache ({default_cache_dir()})")

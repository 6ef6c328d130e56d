"""Whether torch.compile can build its kernels here: found before any work, not at the first step.

torch.compile builds code at run time: C++ kernels on a CPU (inductor), and on a GPU the launchers of Triton's
kernels, in C. Both include Python's headers. Without a compiler, or without the headers, the run would end at the
first step with torch's error, after the data and the model were loaded; a retry would fail the same way. So it is
bad input, told in one line naming the key, while a rank starts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import torch

from trainer.spec import SpecError

ADVICE = "or set training.compile: false"


def c_compiler() -> str | None:
    """The C compiler Triton builds its launchers with: $CC, else gcc, else clang (triton.runtime.build)."""
    named = os.environ.get("CC")
    return shutil.which(named) if named else shutil.which("gcc") or shutil.which("clang")


def cpp_compiler() -> str | None:
    """The C++ compiler inductor builds CPU kernels with: $CXX, else g++ (torch._inductor.config.cpp.cxx on Linux).
    Not asked of inductor itself: importing it makes its cache directory, which may be in the run directory."""
    return shutil.which(os.environ.get("CXX", "g++"))


def check_compiler(device: torch.device) -> None:
    """A compiler for `device`'s kernels that can include Python's headers, or SpecError naming what is missing."""
    if device.type == "cuda":
        language, compiler, needed = "c", c_compiler(), "a C compiler for Triton's launchers (CC, gcc, clang)"
        install = "gcc"
    else:
        language, compiler, needed = "c++", cpp_compiler(), "a C++ compiler for its CPU kernels (CXX, g++)"
        install = "g++"
    if compiler is None:
        raise SpecError(
            f"training.compile: torch.compile needs {needed}, and none was found: install {install}, {ADVICE}"
        )
    headers = Path(sysconfig.get_path("include"))
    try:
        built = subprocess.run(
            [compiler, "-fsyntax-only", f"-I{headers}", "-x", language, "-"],
            input="#include <Python.h>\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SpecError(
            f"training.compile: torch.compile's compiler {compiler} does not run ({error}): install a working"
            f" one, {ADVICE}"
        ) from None
    if built.returncode != 0:
        lines = built.stderr.strip().splitlines() or [f"exit {built.returncode}"]
        why = next((line for line in lines if "error" in line), lines[0])
        raise SpecError(
            f"training.compile: {compiler} cannot build against Python's headers in {headers} ({why}): install them"
            f" (Debian: python3-dev), {ADVICE}"
        )

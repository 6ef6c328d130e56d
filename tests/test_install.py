"""Two installs: `pip install ddpjob` is the client (no torch), `ddpjob[train]` adds the trainer.

The client is installed for real, from a wheel built out of the project's files, into a fresh venv
(uv, offline: every package comes from the warm cache `make test` fills).
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
CLIENT = [Requirement(r) for r in PROJECT["dependencies"]]
TRAIN = [Requirement(r) for r in PROJECT["optional-dependencies"]["train"]]
# What a submitting laptop must not pay for (the issue: 6.1 GB with torch's CUDA libraries).
TRAINER_ONLY = {"torch", "transformers", "tokenizers", "safetensors", "tensorboard", "triton"}
# Trackers that training.reportTo may name besides TensorBoard: imported only then, installed by whoever names them.
OPTIONAL = {"mlflow", "wandb"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# What ctl imports only for `ctl prepare`, after `require_trainer` has checked that the train extra is there.
NEEDS_THE_TRAIN_EXTRA = {"trainer.prepare", "trainer.storage"}


def third_party_imports(start: list[Path], skip: set[str] = frozenset()) -> set[str]:
    """Top-level modules outside the standard library and the project that `start` imports, following
    the project's own imports (ctl -> trainer.spec) to the files they load, except the modules in `skip`."""
    seen: set[Path] = set()
    found: set[str] = set()
    pending = list(start)
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if name in skip:
                    continue
                if top in ("ctl", "trainer"):
                    module = REPO / Path(*name.split("."))
                    pending += [p for p in (module.with_suffix(".py"), module / "__init__.py") if p.exists()]
                elif top not in sys.stdlib_module_names and top != "__future__":
                    found.add(top)
    return found


def undeclared(modules: set[str], declared: set[str]) -> set[str]:
    """The modules no declared distribution provides (one module may come from several: typer, typer-slim)."""
    owners = importlib.metadata.packages_distributions()
    return {module for module in modules if not {normalized(owner) for owner in owners[module]} & declared}


def test_each_install_declares_what_its_code_imports_and_shared_bounds_agree() -> None:
    client = {normalized(r.name): r for r in CLIENT}
    train = {normalized(r.name): r for r in TRAIN}
    ctl_uses = third_party_imports(sorted((REPO / "ctl").glob("*.py")), skip=NEEDS_THE_TRAIN_EXTRA)
    trainer_uses = third_party_imports(sorted((REPO / "trainer").glob("*.py"))) - OPTIONAL
    assert undeclared(ctl_uses, client.keys()) == set(), "ctl imports what the client install lacks"
    assert undeclared(trainer_uses, train.keys()) == set(), "the trainer imports what its extra (the image) lacks"
    assert client.keys() & TRAINER_ONLY == set()
    # The image installs the extra alone: it needs none of the client's Kubernetes, Typer or Helm.
    assert {"kubernetes", "typer", "helm-python-sdk"} & train.keys() == set()
    shared = client.keys() & train.keys()
    assert {name: (str(client[name]), str(train[name])) for name in shared if client[name] != train[name]} == {}


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with `pip install ddpjob` and nothing else, built from the files a wheel is made of."""
    root = tmp_path_factory.mktemp("client")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("ctl", "trainer", "helm"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    uv = shutil.which("uv", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    assert uv, "uv is missing: `make test` installs it into .venv"
    venv = root / "venv"
    env = os.environ | {"UV_OFFLINE": "1", "VIRTUAL_ENV": str(venv)}
    for command in ([uv, "venv", "--quiet", "--python", sys.executable, venv], [uv, "pip", "install", source]):
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    return venv


def client_ctl(venv: Path, command: str, cwd: Path) -> subprocess.CompletedProcess:
    """The client venv's `ctl COMMAND examples/quickstart.yaml`, run outside the source tree."""
    quickstart = REPO / "examples" / "quickstart.yaml"
    return subprocess.run(
        [venv / "bin" / "ctl", command, quickstart], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_the_client_install_has_no_torch_and_renders_a_job(client_venv: Path, tmp_path: Path) -> None:
    python = client_venv / "bin" / "python"
    listing = "import importlib.metadata as m; print('\\n'.join(d.metadata['Name'] for d in m.distributions()))"
    installed = {normalized(n) for n in subprocess.check_output([python, "-c", listing], text=True).split()}
    assert "ddpjob" in installed and "kubernetes" in installed
    assert installed & TRAINER_ONLY == set()
    # The chart came with the wheel: rendering works outside the source tree.
    result = client_ctl(client_venv, "render", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "kind: PyTorchJob" in result.stdout


def test_ctl_version_names_the_installed_version_and_the_chart_it_renders_with(
    client_venv: Path, tmp_path: Path
) -> None:
    result = subprocess.run([client_venv / "bin" / "ctl", "--version"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    version = PROJECT["version"]
    chart = client_venv / "share" / "ddpjob" / "helm" / "ddpjob"  # the wheel's copy, not the source tree's
    assert result.stdout == f"ddpjob {version}\nchart ddpjob-{version} (appVersion {version}) at {chart}\n"


def test_ctl_run_without_the_trainer_says_what_to_install(client_venv: Path, tmp_path: Path) -> None:
    result = client_ctl(client_venv, "run", tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: ctl run needs the trainer: pip install 'ddpjob[train]' (missing: torch, ")
    assert not (tmp_path / "runs").exists()


def test_a_dependency_missing_from_the_install_is_one_line_naming_it(tmp_path: Path) -> None:
    """A broken install (here Helm's engine, which `ctl render` loads, made unimportable): its one line, exit 1, not
    Python's traceback."""
    quickstart = REPO / "examples" / "quickstart.yaml"
    code = f"import sys; sys.modules['helm_python'] = None; sys.argv = ['ctl', 'render', {str(quickstart)!r}]"
    code += "; from ctl.cli import main; main()"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (
        "error: the Python module 'helm_python' is missing: ddpjob's installation is incomplete (reinstall it: pip"
        " install ddpjob)\n"
    )

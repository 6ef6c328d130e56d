"""How fast `ctl` answers: `ctl --help` and `ctl render examples/classification.yaml`, wall time of
the whole process (interpreter start included), and whether rendering imported torch:

    python bench/cli.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMANDS = {
    "ctl --help": ["--help"],
    "ctl render examples/classification.yaml": ["render", str(REPO / "examples" / "classification.yaml")],
}


def wall_seconds(args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ctl", *args], cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - started


def imports_torch(args: list[str]) -> bool:
    """`-X importtime` lists every module imported; rendering must not need torch."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ctl", *args], cwd=REPO, check=True, capture_output=True, text=True
    )
    return any(line.rstrip().endswith("| torch") for line in result.stderr.splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    result = {}
    for name, command in COMMANDS.items():
        wall_seconds(command)  # warm the file cache and bytecode
        times = [wall_seconds(command) for _ in range(args.repeats)]
        result[name] = {"median_seconds": round(statistics.median(times), 3), "imports_torch": imports_torch(command)}
        print(
            f"{name}: {statistics.median(times):.3f} s (median of {args.repeats}), best {min(times):.3f} s,"
            f" imports torch: {'yes' if result[name]['imports_torch'] else 'no'}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()

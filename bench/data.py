"""Data at real size: ddpjob's first start, restart and per-rank memory, against a nanoGPT-style prepare.

Builds its corpora offline from the UTF-8 `.py` files under the Python standard library's
directory (one document each, JSONL rows; that directory also holds the interpreter's own
site-packages, whatever is installed there: the text differs between machines, its kind does
not): the small one as is, the large one as several passes over them with per-pass variation
(every `self` renamed per pass), until the size asked for; a machine with less text gets passes
in the small one too. An 8k byte-level BPE is trained on the first 5 MB (at most the small corpus' size) and
given as `training.tokenizer.path`.

Measured in one invocation, on the small corpus and then the large one:

- reference:      a nanoGPT-style prepare (the Rust tokenizer's batch encode, all cores, into a
                  uint16 file), in its own process: wall time and peak RSS;
- first start:    `ctl run` of a causal-lm spec (2 processes, 3 steps of a tiny GPT-2) with an
                  empty dataset cache: preparation + training; wall time, the whole process tree's
                  peak memory, and each rank's peak RSS;
- restart:        the same spec in a new run directory with the cache filled (what a restarted pod
                  does: fingerprint from file metadata, map the files): seconds to the first step,
                  and each rank's peak RSS while training;
- order:          µs a batch of one rank's sample indices (trainer.data.TrainBatches: the epoch's
                  shuffled order, world size 8, batch 32) at 10^4 to 10^10 samples, against
                  nanoGPT's random offsets (`torch.randint`), in this process.

    python bench/data.py                            # 130 MB and 1 GB
    python bench/data.py --small-mb 30 --large-mb 120   # a busy or small machine
    python bench/data.py --small-mb 1 --large-mb 2      # every code path, no figure worth reading (tests)

The process tree's memory is sampled two ways: the sum of RSS, which counts pages that processes
share (torch's libraries, mapped token files) once per process, and the sum of PSS
(`/proc/PID/smaps_rollup`), which splits each shared page among its sharers: the memory the
tree takes from the machine.

The tokenizing processes use jemalloc where it is installed (trainer/prepare.py `fast_malloc`;
`apt install libjemalloc2`), which the output names.

Prints a table and one JSON line (ratios: first start / reference wall, restart large / small,
rank RSS large / small, order largest / smallest and largest / reference).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainer.prepare import fast_malloc  # noqa: E402
from trainer.text import train_tokenizer  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
SAMPLE_S = 0.2
# smaps_rollup walks a process's page tables: ~10 ms of CPU for a process that imported torch, so sampling a first
# start's 6 processes every 0.2 s would take a fifth of a core from what is measured (a single-process reference
# far less). PSS plateaus for seconds at its peak (tokenizing, training), so a sample a second finds it.
PSS_SAMPLE_S = 1.0
TOKENIZER_SAMPLE_BYTES = 5 * 2**20
ORDER_SIZES = (10**4, 10**6, 10**8, 10**10)  # samples in the corpus
ORDER_WORLD, ORDER_BATCH, ORDER_BATCHES = 8, 32, 3000


def stdlib_documents() -> list[Path]:
    """The `.py` files under the standard library's directory (site-packages included) that hold UTF-8 text
    (a few test files deliberately are not UTF-8)."""
    files = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            if path.read_text(encoding="utf-8").strip():  # a row without text is a bad row
                files.append(path)
        except (UnicodeDecodeError, OSError):
            continue
    return files


def build_corpus(path: Path, megabytes: float, sources: list[Path]) -> int:
    """JSONL of stdlib sources until `megabytes`: pass 0 as is, pass k with `self` renamed `self_k`."""
    limit, written, passes = megabytes * 2**20, 0, 0
    with path.open("w", encoding="utf-8") as out:
        while written < limit:
            for source in sources:
                text = source.read_text(encoding="utf-8")
                if passes:
                    text = text.replace("self", f"self_{passes}")
                line = json.dumps({"text": text}) + "\n"
                out.write(line)
                written += len(line.encode())
                if written >= limit:
                    break
            passes += 1
    return written


@dataclass
class Usage:
    """Peak memory of a process tree, sampled: the whole tree's sum, and each trainer rank's own."""

    tree_peak: int = 0  # sum of RSS
    tree_pss_peak: int = 0  # sum of PSS
    rank_peak: dict[int, int] = field(default_factory=dict)
    first_step_s: float | None = None
    wall_s: float = 0.0
    sampler_cpu_s: float = 0.0  # what the sampling itself took from the machine meanwhile


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack += children.get(pid, [])
    return found


def rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError):
        return 0


def pss(pid: int) -> int:
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("Pss:")), 0)


def rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    values = dict(item.split(b"=", 1) for item in environ if b"=" in item)
    # Trainer ranks have RANK and LOCAL_RANK from torchrun; its agent has neither.
    return int(values[b"RANK"]) if b"RANK" in values and b"LOCAL_RANK" in values else None


def measure(command: list[str], cwd: Path, env: dict[str, str]) -> Usage:
    """Run `command`, sampling its process tree's memory; note when rank 0 logs its first step."""
    usage = Usage()
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = threading.Event()
    ranks: dict[int, int | None] = {}

    def sample() -> None:
        next_pss = 0.0
        while not done.is_set():
            pids = descendants(process.pid)
            total = 0
            for pid in pids:
                size = rss(pid)
                total += size
                if pid not in ranks:
                    ranks[pid] = rank_of(pid)
                if ranks[pid] is not None:
                    usage.rank_peak[ranks[pid]] = max(usage.rank_peak.get(ranks[pid], 0), size)
            usage.tree_peak = max(usage.tree_peak, total)
            if time.monotonic() >= next_pss:
                next_pss = time.monotonic() + PSS_SAMPLE_S
                usage.tree_pss_peak = max(usage.tree_pss_peak, sum(map(pss, pids)))
            time.sleep(SAMPLE_S)
        usage.sampler_cpu_s = time.thread_time()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output = []
    for line in process.stdout:
        output.append(line)
        if usage.first_step_s is None and re.search(r"\bstep 1/\d+", line):
            usage.first_step_s = time.monotonic() - started
    process.wait()
    usage.wall_s = time.monotonic() - started
    done.set()
    sampler.join()
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}):\n" + "".join(output[-30:]))
    return usage


def reference_prepare(corpus: Path, tokenizer_dir: Path, out: Path) -> None:
    """nanoGPT's prepare.py, streamed: batch-encode documents with the Rust tokenizer, append uint16 ids."""
    import numpy as np
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    with corpus.open(encoding="utf-8") as lines, out.open("wb") as tokens:

        def flush(batch: list[str]) -> None:
            for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
                tokens.write(np.array([*encoding.ids, eos], dtype=np.uint16).tobytes())

        batch: list[str] = []
        for line in lines:
            batch.append(json.loads(line)["text"])
            if len(batch) == 1000:
                flush(batch)
                batch = []
        flush(batch)


def job_spec(name: str, corpus: Path, val: Path, tokenizer_dir: Path, cache: Path) -> dict:
    return {
        "name": name,
        "procsPerNode": 2,
        "training": {
            "task": "causal-lm",
            "model": {"nLayer": 2, "nHead": 2, "nEmbd": 64, "blockSize": 128},
            "tokenizer": {"path": str(tokenizer_dir)},
            # A small validation file (1 MB at most): the final evaluation stays a small cost beside the corpus'.
            "data": {"train": str(corpus), "val": str(val), "cacheDir": str(cache)},
            "maxSteps": 3,
            "batchSize": 4,
            "logEvery": 1,
            "checkpoint": {"every": 0, "keepBest": False},
            "sample": {"maxNewTokens": 0},
        },
    }


def run_case(label: str, corpus: Path, val: Path, tokenizer_dir: Path, workdir: Path, with_reference: bool) -> dict:
    env = os.environ | {"PYTHONPATH": str(REPO)}
    cache = workdir / f"cache-{label}"
    result: dict = {"corpus_mb": round(corpus.stat().st_size / 2**20, 1)}
    if with_reference:
        usage = measure(
            [sys.executable, __file__, "--reference", str(corpus), str(tokenizer_dir), str(workdir / f"{label}.bin")],
            workdir,
            env,
        )
        result["reference"] = {
            "wall_s": round(usage.wall_s, 1),
            "peak_rss_gib": round(usage.tree_peak / 2**30, 2),
            "peak_pss_gib": round(usage.tree_pss_peak / 2**30, 2),
            "sampler_cpu_s": round(usage.sampler_cpu_s, 1),
        }
    for run in ("first_start", "restart"):
        spec = workdir / f"{label}-{run}.yaml"
        spec.write_text(yaml.safe_dump(job_spec(f"{label}-{run.replace('_', '-')}", corpus, val, tokenizer_dir, cache)))
        usage = measure([sys.executable, "-m", "ctl", "run", str(spec)], workdir, env)
        result[run] = {
            "wall_s": round(usage.wall_s, 1),
            "first_step_s": round(usage.first_step_s or 0.0, 1),
            "peak_rss_gib": round(usage.tree_peak / 2**30, 2),
            "peak_pss_gib": round(usage.tree_pss_peak / 2**30, 2),
            "rank_peak_rss_mib": {rank: round(size / 2**20) for rank, size in sorted(usage.rank_peak.items())},
            "sampler_cpu_s": round(usage.sampler_cpu_s, 1),
        }
    return result


def per_batch_us(batches: Iterator[object]) -> float:
    next(batches)
    started = time.perf_counter()
    for _ in range(ORDER_BATCHES):
        next(batches)
    return round((time.perf_counter() - started) / ORDER_BATCHES * 1e6, 1)


def order_costs() -> dict:
    """µs a batch of the last rank's indices, and of nanoGPT's random offsets into the largest corpus. A corpus is a
    range (each sample its own index): the order's cost alone. Imported here: the reference's process, this script
    too, must not carry torch in its memory."""
    import torch

    from trainer.data import TrainBatches
    from trainer.dist import Dist

    def offsets() -> Iterator[object]:
        while True:
            yield torch.randint(ORDER_SIZES[-1], (ORDER_BATCH,))

    rank = Dist(ORDER_WORLD - 1, ORDER_WORLD - 1, ORDER_WORLD, torch.device("cpu"))
    costs = {
        f"{size:.0e}": per_batch_us(iter(TrainBatches(range(size), rank, ORDER_BATCH, 1337, lambda rows: rows)))
        for size in ORDER_SIZES
    }
    return {"us_per_batch": costs, "reference_us_per_batch": per_batch_us(offsets())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small-mb", type=int, default=130, help="size of the small corpus (MB)")
    parser.add_argument("--large-mb", type=int, default=1024, help="size of the large corpus (MB)")
    parser.add_argument("--reference", nargs=3, metavar=("CORPUS", "TOKENIZER", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reference:
        reference_prepare(*map(Path, args.reference))
        return

    with tempfile.TemporaryDirectory(prefix="ddpjob-bench-data-") as tmp:
        workdir = Path(tmp)
        sources = stdlib_documents()
        corpora = {"small": workdir / "small.jsonl", "large": workdir / "large.jsonl"}
        build_corpus(corpora["small"], args.small_mb, sources)
        build_corpus(corpora["large"], args.large_mb, sources)
        # The final evaluation's share of a run is kept small: at most 1 MB, a tenth of the small corpus at toy sizes.
        build_corpus(workdir / "val.jsonl", min(1, args.small_mb / 10), sources[::-1])
        sample, size = [], 0
        for source in sources:
            sample.append(source.read_text(encoding="utf-8"))
            size += len(sample[-1])
            if size >= min(TOKENIZER_SAMPLE_BYTES, args.small_mb * 2**20):
                break
        train_tokenizer(sample, 8192).save_pretrained(workdir / "tokenizer")
        results = {
            label: run_case(
                label, corpus, workdir / "val.jsonl", workdir / "tokenizer", workdir, with_reference=label == "small"
            )
            for label, corpus in corpora.items()
        }
    order = order_costs()

    allocator = fast_malloc() or "glibc's malloc (no jemalloc installed)"
    print(f"tokenizing processes' allocator: {allocator}")
    print(f"{'':28}{'small':>14}{'large':>14}")
    small, large = results["small"], results["large"]
    rows = [
        ("corpus MB", small["corpus_mb"], large["corpus_mb"]),
        ("reference prepare wall s", small["reference"]["wall_s"], "-"),
        ("reference peak RSS GiB", small["reference"]["peak_rss_gib"], "-"),
        ("reference peak PSS GiB", small["reference"]["peak_pss_gib"], "-"),
        ("first start wall s", small["first_start"]["wall_s"], large["first_start"]["wall_s"]),
        ("first start peak RSS GiB", small["first_start"]["peak_rss_gib"], large["first_start"]["peak_rss_gib"]),
        ("first start peak PSS GiB", small["first_start"]["peak_pss_gib"], large["first_start"]["peak_pss_gib"]),
        ("restart: first step s", small["restart"]["first_step_s"], large["restart"]["first_step_s"]),
        ("restart peak RSS GiB", small["restart"]["peak_rss_gib"], large["restart"]["peak_rss_gib"]),
        ("restart peak PSS GiB", small["restart"]["peak_pss_gib"], large["restart"]["peak_pss_gib"]),
    ]
    for rank in small["restart"]["rank_peak_rss_mib"]:
        rows.append(
            (
                f"rank {rank} peak RSS MiB",
                small["restart"]["rank_peak_rss_mib"][rank],
                large["restart"]["rank_peak_rss_mib"].get(rank, "-"),
            )
        )
    for name, a, b in rows:
        print(f"{name:28}{a!s:>14}{b!s:>14}")
    costs = order["us_per_batch"]
    print(f"order, µs a batch (world size {ORDER_WORLD}, batch {ORDER_BATCH}), by samples in the corpus:")
    print("  " + "  ".join(f"{size}: {us}" for size, us in costs.items()))
    print(f"  reference (random offsets): {order['reference_us_per_batch']}")
    ratios = {
        "first_start_vs_reference_wall": round(small["first_start"]["wall_s"] / small["reference"]["wall_s"], 2),
        "restart_first_step_large_vs_small": round(
            large["restart"]["first_step_s"] / small["restart"]["first_step_s"], 2
        ),
        "rank_rss_large_vs_small": round(
            max(large["restart"]["rank_peak_rss_mib"].values()) / max(small["restart"]["rank_peak_rss_mib"].values()),
            2,
        ),
    }
    largest, smallest = costs[f"{ORDER_SIZES[-1]:.0e}"], costs[f"{ORDER_SIZES[0]:.0e}"]
    ratios["order_largest_vs_smallest"] = round(largest / smallest, 2)
    ratios["order_largest_vs_reference"] = round(largest / order["reference_us_per_batch"], 2)
    print(json.dumps(results | {"order": order, "allocator": allocator, "ratios": ratios}))


if __name__ == "__main__":
    main()

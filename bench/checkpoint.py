"""What a checkpoint costs training: the time to save one, and the stall per checkpoint, synchronous vs async.

A synchronous save stalls training for the whole write (every file fsynced, marker, rename).
An asynchronous one stalls it only while the state is copied to CPU memory; a background
thread writes the copy while training goes on (which it slows down meanwhile, by sharing the
CPU: reported too). Both through the trainer's own Checkpointer,
on the GPT-2 124M shape with AdamW state (about 1.5 GB on disk), in one process; then the same saves to an S3
bucket (checkpoint.dir: s3://...), as ratios to the local disk's stalls measured in the same run. Last, what a
checkpoint to the bucket spends uploading TensorBoard's events late in a long run against early in a short one: each
checkpoint there closes an event file (trainer.tracking.Tracker.seal_events), so a run has as many as checkpoints.
And what the CRC-32s that each commit records cost: their share of a save, and a resume (every rank's load of the
newest checkpoint) with their check against the same resume without it (the marker as a save before them wrote it).

    python bench/checkpoint.py [--layers 12 --embd 768 --repeats 2 --dir /path/on/the/target/disk --uri s3://b/p]
                               [--event-files 10 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the S3 server the tests run (tests/s3server.py)

from s3server import s3_server  # noqa: E402

from bench.peers import gpt2  # noqa: E402
from trainer.checkpoint import MARKER, Checkpointer, TrainerState, file_crc32  # noqa: E402
from trainer.dist import Dist  # noqa: E402
from trainer.names import TENSORBOARD_DIR  # noqa: E402
from trainer.rundir import event_files, publish  # noqa: E402
from trainer.spec import CheckpointSpec  # noqa: E402
from trainer.storage import open_store  # noqa: E402

State = tuple[torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]


def trained_state(layers: int, embd: int) -> State:
    """The model after one AdamW step, so the optimizer holds its moments as in any real save."""
    model = gpt2({"vocab": 50257, "block": 1024, "layers": layers, "heads": max(1, embd // 64), "embd": embd})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(input_ids=torch.zeros(1, 8, dtype=torch.long), labels=torch.zeros(1, 8, dtype=torch.long)).loss.backward()
    optimizer.step()
    return model, optimizer, torch.amp.GradScaler("cpu", enabled=False)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A small stand-in for training: forward, backward and AdamW on a short batch."""
    ids = torch.randint(0, 1000, (1, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def seconds(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


@dataclass
class Measured:
    """One target's saves: each one's training stall and write time by mode, and async's slowdown of training."""

    stalls: dict[str, list[float]] = field(default_factory=lambda: {"sync": [], "async": []})
    writes: dict[str, list[float]] = field(default_factory=lambda: {"sync": [], "async": []})
    slowdowns: list[float] = field(default_factory=list)
    size: int = 0


def measure(run_dir: Path, uri: str | None, state: State, repeats: int) -> Measured:
    """Sync then async saves into `run_dir` (or the bucket `uri`, `run_dir` its local side)."""
    model, optimizer, scaler = state
    dist = Dist(0, 0, 1, torch.device("cpu"))
    step_seconds = statistics.median(seconds(lambda: train_step(model, optimizer)) for _ in range(5))
    measured = Measured()
    for mode in ("sync", "async"):
        spec = CheckpointSpec(dir=uri, keepLast=1, keepBest=False, asyncSave=mode == "async")
        checkpoints = Checkpointer(run_dir / mode, spec, dist, {})
        checkpoints.run_dir.mkdir(parents=True)
        trainer_state = TrainerState()
        checkpoints.attach(model, optimizer, scaler, trainer_state)
        # The first save of each kind is a warm-up (for async: it allocates the CPU staging buffers).
        for step in range(repeats + 1):
            trainer_state.step = step
            stall = seconds(checkpoints.save)
            if mode == "async":
                # Training goes on while the copy is written: how much slower is it meanwhile?
                steps = max(3, math.ceil(3 * statistics.median(measured.writes["sync"]) / step_seconds))
                slowdown = seconds(lambda n=steps: [train_step(model, optimizer) for _ in range(n)])
                slowdown -= steps * step_seconds
            checkpoints.wait()
            assert checkpoints.last_save is not None
            if step:
                measured.stalls[mode].append(stall)
                measured.writes[mode].append(checkpoints.last_save.seconds)
                if mode == "async":
                    measured.slowdowns.append(max(0.0, slowdown))
        measured.size = checkpoints.last_save.size_bytes
    return measured


@dataclass
class Resumed:
    """The CRC-32s' cost: computing them for one save, and resuming with and without their check (median seconds)."""

    crc32: float
    resume: float
    resume_unchecked: float


def resume_cost(run_dir: Path, state: State, repeats: int) -> Resumed:
    """`load_latest` of the newest checkpoint in `run_dir` (measure's sync saves), with the CRC-32 check and without,
    interleaved, the first of each a warm-up. The files are in the page cache, as right after a save: a start that
    reads them from the disk reads them once for the check, and the load finds them cached."""
    model, optimizer, scaler = state
    checkpoints = Checkpointer(
        run_dir, CheckpointSpec(keepLast=1, keepBest=False), Dist(0, 0, 1, torch.device("cpu")), {}
    )
    checkpoints.attach(model, optimizer, scaler, TrainerState())
    folder = run_dir / checkpoints.committed()[-1][1]
    checked = (folder / MARKER).read_text()
    unchecked = json.dumps({k: v for k, v in json.loads(checked).items() if k != "crc32"}) + "\n"
    times: dict[str, list[float]] = {checked: [], unchecked: []}
    try:
        for _ in range(repeats + 1):
            for marker, measured in times.items():
                (folder / MARKER).write_text(marker)
                measured.append(seconds(checkpoints.load_latest))
    finally:
        (folder / MARKER).write_text(checked)
    files = [path for path in folder.iterdir() if path.name != MARKER]
    crc32 = statistics.median(seconds(lambda: [file_crc32(path) for path in files]) for _ in range(repeats + 1))
    return Resumed(crc32, statistics.median(times[checked][1:]), statistics.median(times[unchecked][1:]))


def event_upload_seconds(run_dir: Path, uri: str, earlier: int) -> float:
    """A checkpoint's upload of the TensorBoard events after `earlier` checkpoints, each of which closed an event file:
    what `Checkpointer` does before each marker (trainer.rundir.publish), timed over the last few of one store's."""
    store = open_store(uri, run_dir)
    folder = run_dir / TENSORBOARD_DIR
    folder.mkdir(parents=True)

    def checkpoint(index: int) -> None:
        (folder / f"events.out.tfevents.{index:08d}.bench").write_bytes(bytes(512))  # the file the save closed
        publish(run_dir, store, (), event_files(run_dir))

    for index in range(earlier):
        checkpoint(index)
    return statistics.median(seconds(lambda i=i: checkpoint(i)) for i in range(earlier, earlier + 5))


@contextlib.contextmanager
def bucket(work_dir: Path, uri: str | None) -> Iterator[str]:
    """`uri` (a real bucket, credentials from the AWS variables), or a bucket of a local S3 server (versitygw, as the
    tests run it) over `work_dir`: the same disk as the local saves, so the ratio is what S3 itself adds."""
    if uri:
        yield uri
        return
    with s3_server(work_dir) as server:
        server.bucket("bench")
        os.environ.update(server.env())
        yield "s3://bench/run"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--embd", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--uri", default=None, help="s3://bucket/prefix to save to (default: a local S3 server's)")
    parser.add_argument(
        "--event-files",
        type=int,
        nargs=2,
        default=[10, 1000],
        metavar=("SHORT", "LONG"),
        help="checkpoints before the one whose event upload is timed, in a short run and a long one",
    )
    args = parser.parse_args()
    state = trained_state(args.layers, args.embd)
    with tempfile.TemporaryDirectory(prefix="ddpjob-bench-", dir=args.dir) as tmp:
        local = measure(Path(tmp) / "local", None, state, args.repeats)
        resumed = resume_cost(Path(tmp) / "local" / "sync", state, args.repeats)
        with bucket(Path(tmp) / "s3", args.uri) as uri:
            remote = measure(Path(tmp) / "s3-cache", uri, state, args.repeats)
            events = {n: event_upload_seconds(Path(tmp) / f"events-{n}", f"{uri}-{n}", n) for n in args.event_files}
    median = statistics.median
    sync, background, slowdown = (median(v) for v in (local.stalls["sync"], local.stalls["async"], local.slowdowns))
    s3_sync, s3_background = (median(remote.stalls[mode]) for mode in ("sync", "async"))
    params = sum(p.numel() for p in state[0].parameters())
    print(f"model: {params / 1e6:.0f}M parameters; checkpoint: {local.size / 2**30:.2f} GiB")
    save, background_save = median(local.writes["sync"]), median(local.writes["async"])
    print(f"save (write + fsync + commit): {save:.2f} s; {background_save:.2f} s in the background, beside training")
    print(
        f"training stall per checkpoint: sync {sync:.2f} s, async {background:.3f} s ({background / sync:.1%} of sync)"
    )
    print(f"async: training meanwhile slower by {slowdown:.2f} s in all (the write shares the CPU cores)")
    print(
        f"to the bucket ({args.uri or 'a local versitygw'}): stall sync {s3_sync:.2f} s ({s3_sync / sync:.2f}x the"
        f" local disk's), async {s3_background:.3f} s ({s3_background / background:.2f}x)"
    )
    print(
        f"CRC-32s of a checkpoint's files: {resumed.crc32:.2f} s ({resumed.crc32 / save:.1%} of a save); a resume"
        f" checks them in {resumed.resume:.2f} s against {resumed.resume_unchecked:.2f} s without"
        f" ({resumed.resume / resumed.resume_unchecked:.2f}x)"
    )
    short, long = args.event_files
    print(
        f"event upload per checkpoint to the bucket: {events[short] * 1000:.1f} ms after {short} checkpoints,"
        f" {events[long] * 1000:.1f} ms after {long} ({events[long] / events[short]:.2f}x)"
    )
    result = {
        "parameters": params,
        "checkpoint_bytes": local.size,
        "save_seconds": round(save, 3),
        "background_save_seconds": round(background_save, 3),
        "stall_seconds": {"sync": round(sync, 3), "async": round(background, 3)},
        "async_stall_ratio": round(background / sync, 3),
        "async_slowdown_seconds": round(slowdown, 3),
        "s3_stall_seconds": {"sync": round(s3_sync, 3), "async": round(s3_background, 3)},
        "s3_save_seconds": round(median(remote.writes["sync"]), 3),
        "s3_vs_local_stall_ratio": {"sync": round(s3_sync / sync, 3), "async": round(s3_background / background, 3)},
        "event_upload_seconds": {str(n): round(v, 4) for n, v in events.items()},
        "event_upload_ratio": round(events[long] / events[short], 3),
        "crc32_seconds": round(resumed.crc32, 3),
        "crc32_save_share": round(resumed.crc32 / save, 3),
        "resume_seconds": {"checked": round(resumed.resume, 3), "unchecked": round(resumed.resume_unchecked, 3)},
        "resume_check_ratio": round(resumed.resume / resumed.resume_unchecked, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

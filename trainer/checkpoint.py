"""Checkpoints in the run directory: `step-<N>/` folders, committed atomically, resumed exactly.

A save (rank 0 writes, the other ranks wait or, with `asyncSave`, go on):

    .step-<N>.tmp/  model.safetensors, optimizer.pt (optimizer + grad scaler), rng.pt
                    (the RNG state of every rank), state.json (step, epoch, position in
                    the epoch, tokens, best metric, config and its hash, world size)
                    -> every file fsynced, then COMMITTED (names and sizes) written last
    step-<N>/       <- atomic rename of the temporary folder, the run directory fsynced
    latest          <- replaced atomically: names the newest committed checkpoint

Only a folder with its marker, and files of the sizes it lists, counts as a checkpoint:
a save killed at any point leaves the previous one in charge. Old checkpoints are
renamed away before they are deleted, so a half-deleted one is never mistaken for one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import pickle
import random
import shutil
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import safetensors
import safetensors.torch
import torch
import torch.distributed as torch_dist

from trainer.dist import Dist, barrier
from trainer.names import CHECKPOINT_NAME, LATEST_CHECKPOINT, NEW_RUN_DIR
from trainer.rundir import RUN_RECORDS, event_files, publish
from trainer.spec import CheckpointSpec, SpecError
from trainer.storage import StorageError, StorageUnreachable, open_store
from trainer.totals import Sums

MARKER = "COMMITTED"
MODEL = "model.safetensors"
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
STATE = "state.json"
# Settings that do not change what is trained: they may differ between a checkpoint and its resume.
NOT_COMPARED = ("checkpoint", "logEvery", "evalEvery", "evalBatches", "sample", "compile", "reportTo", "timeouts")
# The same for the keys of `data` that say only how and where the same tokens are prepared.
DATA_NOT_COMPARED = ("cacheDir", "fingerprint", "prepareWorkers", "prepareBufferMiB")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which and why."""


@dataclass
class TrainerState:
    """Where training stands after `step` steps: everything a resume needs besides tensors."""

    step: int = 0
    max_steps: int = 0
    epoch: int = 0
    position: int = 0  # global samples of `epoch` already trained on (all ranks together)
    samples: int = 0
    tokens: int = 0
    world_size: int = 1
    samples_per_step: int = 0  # world size x batchSize x gradAccum
    val_loss: float | None = None  # at this step, when evaluated for the save
    best_val_loss: float | None = None
    best_step: int | None = None
    # The mean training loss of the last log interval: the report's, when a start has no step left to take.
    train_loss: float | None = None
    # Training's wall time over every start, each up to its last checkpoint (work redone after a restart counts once).
    train_seconds: float = 0.0
    # Sums since the last log line and since the epoch began, over all ranks.
    interval_totals: Sums = field(default_factory=Sums)
    epoch_totals: Sums = field(default_factory=Sums)

    def __post_init__(self) -> None:
        self.interval_totals = Sums.saved(self.interval_totals)
        self.epoch_totals = Sums.saved(self.epoch_totals)

    def load(self, saved: TrainerState) -> None:
        """Take every value of `saved`, in place: the Checkpointer and the loop share this object."""
        for name in (f.name for f in fields(self)):
            setattr(self, name, getattr(saved, name))


@dataclass
class Stateful:
    """What a checkpoint saves and a resume loads in place, given to the Checkpointer once (besides the RNGs)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    state: TrainerState


T = TypeVar("T")


# What torch.load raises for a file that is no zip archive or pickle it can read.
UNREADABLE = (pickle.UnpicklingError, RuntimeError, EOFError)


def read(name: str, file: str, load: Callable[[], T], unreadable: tuple[type[Exception], ...] = UNREADABLE) -> T:
    """`load()` of a committed checkpoint's file, whose size is right: one it cannot read (`unreadable`) was changed
    since (a disk's error, a hand's edit), which the libraries' errors neither name nor tell what to do about."""
    try:
        return load()
    except unreadable as exc:
        # torch's weights-only unpickler begins with advice to load the file unsafely; its cause comes after this.
        text = str(exc).rpartition("WeightsUnpickler error:")[2]
        cause = next((line.strip() for line in text.splitlines() if line.strip()), "")
        raise CheckpointError(
            f"training.checkpoint.dir: {name}/{file} is damaged ({type(exc).__name__}: {cause}); move {name} away to"
            " resume from the checkpoint before it"
        ) from None
    except StorageError:  # the bucket's own errors name what they read
        raise
    except OSError as exc:  # an I/O error, or torch's zip reader on some damage (EINVAL): either way, name the file
        raise CheckpointError(
            f"training.checkpoint.dir: cannot read {name}/{file} ({type(exc).__name__}: {exc}); if it is damaged, move"
            f" {name} away to resume from the checkpoint before it"
        ) from None


def file_crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as file:
        while chunk := file.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def config_values(values: dict[str, Any]) -> dict[str, Any]:
    """The settings a resume must keep (a checkpoint's saved `config` holds them all, as this run's spec does)."""
    kept = {key: value for key, value in values.items() if key not in NOT_COMPARED}
    if isinstance(data := kept.get("data"), dict):
        kept["data"] = {key: value for key, value in data.items() if key not in DATA_NOT_COMPARED}
    return kept


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two spec value trees."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            key
            for name in sorted(old.keys() | new.keys())
            for key in changed_keys(old.get(name), new.get(name), f"{prefix}{name}.")
        ]
    return [] if old == new else [prefix.rstrip(".")]


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random generators, in types `torch.load(weights_only=True)` accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def to_cpu(value: Any, staging: dict[str, torch.Tensor] | None, key: str = "") -> Any:
    """`value` with every tensor on the CPU.

    With `staging` (a background save), tensors are copied into CPU buffers kept there from one
    save to the next: the training may change the originals while the copy is written, and
    copying into memory already touched is several times faster than allocating it anew.
    """
    if isinstance(value, torch.Tensor):
        if staging is None:
            return value.detach().to("cpu")
        buffer = staging.get(key)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = staging[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
        return buffer.copy_(value.detach())
    if isinstance(value, dict):
        return {name: to_cpu(item, staging, f"{key}/{name}") for name, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_cpu(item, staging, f"{key}/{index}") for index, item in enumerate(value))
    return value


def model_tensors(model: torch.nn.Module, staging: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The state dict with tied tensors stored once (safetensors refuses shared storage)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            tensors[name] = to_cpu(tensor.contiguous(), staging, f"model/{name}")
    return tensors


@dataclass(frozen=True)
class SaveStats:
    step: int
    seconds: float  # writing and committing, not the copy to CPU memory
    size_bytes: int
    finished_at: float  # Unix time


@dataclass
class Snapshot:
    """One checkpoint's content, in CPU memory, ready to be written without touching the model."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: list[dict[str, Any]]
    state: dict[str, Any]
    # The TensorBoard event files to upload, listed as the save starts: on object storage the trainer has just closed
    # the current one (Tracker.seal_events), so none of these is still written to while a background save uploads it.
    events: list[Path]


class Checkpointer:
    """Save, prune and resume `step-<N>/` checkpoints of one run directory."""

    def __init__(self, run_dir: Path, spec: CheckpointSpec, dist: Dist, config: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.store = open_store(spec.dir, run_dir)  # the run directory itself, or the bucket
        self.spec = spec
        self.dist = dist
        self.config = config
        self.pending: threading.Thread | None = None
        self.pending_error: BaseException | None = None
        self.staging: dict[str, torch.Tensor] = {}  # CPU copies for background saves, reused save after save
        self.last_save: SaveStats | None = None  # of the newest save this process wrote
        self.stateful: Stateful | None = None  # what save and load_latest work on: see attach

    def attach(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        state: TrainerState,
    ) -> None:
        """The objects every save writes and load_latest fills, from now on."""
        self.stateful = Stateful(model, optimizer, scaler, state)

    def attached(self) -> Stateful:
        assert self.stateful is not None, "Checkpointer.attach comes before save and load_latest"
        return self.stateful

    # -- finding checkpoints ------------------------------------------------------------------

    def committed(self) -> list[tuple[int, str]]:
        """(step, folder name) of every complete checkpoint, oldest first."""
        return self.survey()[0]

    def survey(self) -> tuple[list[tuple[int, str]], list[str]]:
        """The complete checkpoints, as `committed`, and the names of the store's other checkpoint folders (a save
        or a prune cut short) and temporary ones."""
        complete, other = [], []
        for name in self.store.names():
            match = CHECKPOINT_NAME.fullmatch(name)
            if match and self.is_complete(name):
                complete.append((int(match.group(1)), name))
            elif match or name.startswith((".step-", ".trash-")):
                other.append(name)
        return sorted(complete), other

    def is_complete(self, name: str) -> bool:
        """Whether `name` is a checkpoint: its marker, and every file it lists at its size. One that is not is
        deleted (`clean`), so a failure to read it (a volume's I/O error, a bucket's 503 or timeout) is raised, not
        taken for an incomplete checkpoint."""
        try:
            files = json.loads(self.store.read_bytes(f"{name}/{MARKER}"))["files"]
        except (FileNotFoundError, NotADirectoryError, ValueError, KeyError, TypeError):  # no marker, or a torn one
            return False
        sizes = self.store.sizes(name)
        return all(sizes.get(file) == size for file, size in files.items())

    def clean(self) -> list[str]:
        """Rank 0 removes what interrupted saves and prunes left behind (in the bucket too: an upload cut before its
        marker); every rank waits for it. The checkpoint folders it removed, by name (rank 0's), for the log: one on a
        volume was complete once (a save renames a finished folder into place), and its loss is worth a line."""
        removed: list[str] = []
        if self.dist.is_main:
            complete, other = self.survey()
            for name in other:
                self.store.delete(name, MARKER)
            removed = [name for name in other if CHECKPOINT_NAME.fullmatch(name)]
            if complete:
                self.name_latest(complete[-1][1])
        barrier(self.dist)
        return removed

    def name_latest(self, newest: str) -> None:
        """`latest` names the newest committed checkpoint again where it does not (gone by hand, or naming one just
        removed); resume itself goes by the folders."""
        with contextlib.suppress(FileNotFoundError):
            if self.store.read_bytes(LATEST_CHECKPOINT).decode(errors="replace") == f"{newest}\n":
                return
        self.store.write_text(LATEST_CHECKPOINT, f"{newest}\n")

    # -- resuming -----------------------------------------------------------------------------

    def check_settings(self) -> None:
        """Refuse (SpecError) to resume from the newest checkpoint when its training settings differ from this run's."""
        checkpoints = self.committed()
        if checkpoints:
            self.saved_state(checkpoints[-1][1])

    def saved_state(self, name: str) -> dict[str, Any]:
        """Checkpoint `name`'s state.json, once it is clear that this run may resume from it."""
        saved = read(name, STATE, lambda: json.loads(self.store.read_bytes(f"{name}/{STATE}")), (ValueError,))
        keys = changed_keys(config_values(saved["config"]), config_values(self.config), "training.")
        if keys and not self.spec.allow_config_change:
            raise SpecError(
                f"training.checkpoint: {name} was written with different settings (changed: {', '.join(keys)});"
                " set training.checkpoint.allowConfigChange: true to resume anyway, or use a new run directory"
                f" ({NEW_RUN_DIR})"
            )
        return saved

    def load_latest(self) -> tuple[TrainerState, dict[str, Any] | None] | None:
        """Load the newest complete checkpoint into the attached objects; None when there is none.

        Returns its trainer state (as saved: the attached one holds it too, for the loop to adjust) and this
        rank's RNG state (None when the world size changed and this rank did not exist); restore that just
        before the first step.
        """
        checkpoints = self.committed()
        if not checkpoints:
            return None
        name = checkpoints[-1][1]
        saved = self.saved_state(name)
        path = self.store.local(name)
        self.check_crc32(name, path)
        objects = self.attached()
        device = self.dist.device
        model = functools.partial(safetensors.torch.load_model, objects.model, path / MODEL, device=str(device))
        try:
            read(name, MODEL, lambda: model(strict=True), (safetensors.SafetensorError,))  # not a shape's RuntimeError
        except CheckpointError:
            raise
        except RuntimeError as exc:  # load_state_dict: missing keys or other shapes, each on a line after its title
            detail = next((line.strip() for line in str(exc).splitlines()[1:] if line.strip()), str(exc))
            raise SpecError(
                f"training.checkpoint: {name}/{MODEL} does not fit this run's model ({detail}): the model's shape"
                " (training.model, the vocabulary) cannot change on a resume, allowConfigChange or not; start a new"
                f" run directory ({NEW_RUN_DIR})"
            ) from None
        trainer = read(name, OPTIMIZER, lambda: torch.load(path / OPTIMIZER, map_location=device, weights_only=True))
        objects.optimizer.load_state_dict(trainer["optimizer"])
        objects.scaler.load_state_dict(trainer["scaler"])
        rng = read(name, RNG, lambda: torch.load(path / RNG, weights_only=True))
        state = TrainerState(**saved["trainer"])
        objects.state.load(state)
        return state, rng[self.dist.rank] if self.dist.rank < len(rng) else None

    def check_crc32(self, name: str, path: Path) -> None:
        """Each file of checkpoint `name` (its local copy at `path`) as its commit recorded it (a checkpoint saved
        before the marker held CRC-32s is taken as it reads): a flipped bit in a weight reads, and trains on."""
        recorded = json.loads(self.store.read_bytes(f"{name}/{MARKER}")).get("crc32", {})
        for file, crc in recorded.items():
            if file_crc32(path / file) != crc:
                raise CheckpointError(
                    f"training.checkpoint.dir: {name}/{file} is damaged (its CRC-32 is not the one its commit"
                    f" recorded); move {name} away to resume from the checkpoint before it"
                )

    # -- saving -------------------------------------------------------------------------------

    def save(self, wait: bool = False) -> None:
        """Every rank calls this at a step boundary; rank 0 writes the attached objects (now, or in the background)."""
        self.raise_pending_error()
        objects = self.attached()
        model, optimizer, scaler, state = objects.model, objects.optimizer, objects.scaler, objects.state
        background = self.spec.async_save and not wait
        rngs: list[Any] = [None] * self.dist.world_size
        if self.dist.is_distributed:
            torch_dist.gather_object(
                rng_state(self.dist.device), rngs if self.dist.is_main else None, dst=0, group=self.dist.control_group
            )
        else:
            rngs = [rng_state(self.dist.device)]
        if self.dist.is_main:
            self.wait()  # the previous background write is done with the staging buffers
            staging = self.staging if background else None
            snapshot = Snapshot(
                step=state.step,
                model=model_tensors(model, staging),
                optimizer=to_cpu({"optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}, staging),
                rng=rngs,
                state={"config": self.config, "trainer": asdict(state)},
                events=event_files(self.run_dir) if self.store.uploads else [],  # on a volume they are in place
            )
            if background:
                self.pending = threading.Thread(target=self.write_in_background, args=(snapshot,), daemon=True)
                self.pending.start()
            else:
                self.write(snapshot)
        if not background:
            barrier(self.dist)

    def write_in_background(self, snapshot: Snapshot) -> None:
        try:
            self.write(snapshot)
        except BaseException as exc:  # surfaced by the training thread at its next save or the end
            self.pending_error = exc

    def wait(self) -> None:
        """Block until a background save has finished; re-raise its failure here."""
        if self.pending is not None:
            self.pending.join()
            self.pending = None
        self.raise_pending_error()

    def raise_pending_error(self) -> None:
        if self.pending_error is not None:
            error, self.pending_error = self.pending_error, None
            raise error

    def write(self, snapshot: Snapshot) -> str:
        """Write, commit and publish one checkpoint, then prune; the run directory is never left invalid."""
        started = time.perf_counter()
        name = step_name(snapshot.step)
        staging = self.store.staging(name)
        try:
            if self.is_complete(name):  # e.g. preempted again right after resuming from it
                return name
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            safetensors.torch.save_file(snapshot.model, staging / MODEL, metadata={"step": str(snapshot.step)})
            torch.save(snapshot.optimizer, staging / OPTIMIZER)
            torch.save(snapshot.rng, staging / RNG)
            (staging / STATE).write_text(json.dumps(snapshot.state, indent=2) + "\n")
            written = sorted(staging.iterdir())
            files = {path.name: path.stat().st_size for path in written}
            crc32 = {path.name: file_crc32(path) for path in written}  # what a same-size change cannot keep
            (staging / MARKER).write_text(json.dumps({"step": snapshot.step, "files": files, "crc32": crc32}) + "\n")
            publish(self.run_dir, self.store, RUN_RECORDS, snapshot.events)  # first: its marker implies them
            self.store.commit(staging, name, MARKER)
            shutil.rmtree(staging, ignore_errors=True)  # what an upload leaves (a local commit renamed it away)
            self.store.write_text(LATEST_CHECKPOINT, name + "\n")
        except (OSError, safetensors.SafetensorError) as exc:  # disk full, quota, permissions, I/O errors
            shutil.rmtree(staging, ignore_errors=True)
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise CheckpointError(
                f"training.checkpoint.dir: cannot save {name} in {self.store.describe()}: {reason}; {self.kept(exc)}"
            ) from None
        self.prune()
        size = sum(self.store.sizes(name).values())
        self.last_save = SaveStats(snapshot.step, time.perf_counter() - started, size, time.time())
        return name

    def kept(self, failure: BaseException) -> str:
        """Which checkpoint stays the latest after a save that failed; not asked of a store that did not answer, which
        would wait out its retries again (minutes) to tell."""
        unknown = "the checkpoints saved before it stay as they were"
        if isinstance(failure, StorageUnreachable):
            return unknown
        try:
            previous = [name for _, name in self.committed()]
        except OSError:
            return unknown
        return f"{previous[-1]} stays the latest checkpoint" if previous else "no earlier checkpoint exists"

    def prune(self) -> None:
        """Keep the newest `keepLast` and, with `keepBest`, the lowest validation loss; remove the rest."""
        checkpoints = self.committed()
        keep = {name for _, name in checkpoints[-self.spec.keep_last :]}
        if self.spec.keep_best:
            scored = [(loss, step, name) for step, name in checkpoints if math.isfinite(loss := self.val_loss(name))]
            if scored:
                keep.add(min(scored)[2])
        for _, name in checkpoints:
            if name not in keep:
                self.store.delete(name, MARKER)

    def val_loss(self, name: str) -> float:
        """The validation loss saved with a checkpoint; NaN when it was not evaluated. A failure to read it is raised:
        taken for NaN, it would prune the best checkpoint."""
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
            loss = json.loads(self.store.read_bytes(f"{name}/{STATE}"))["trainer"]["val_loss"]
            return math.nan if loss is None else float(loss)
        return math.nan

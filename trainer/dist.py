"""Process group and rank helpers: torchrun env in, a small `Dist` handle out.

One process (plain `python -m trainer`, or torchrun's with one worker) has no process group
(it has no peer); every collective here is then a no-op. Under torchrun it has the store.

Timeouts (`training.timeouts`, docs/hangs.md): the process group starts with the long
bound, which covers the first step (compile, warm-up); `step_timeouts()` shortens it to
the collective bound once a step has completed. Barriers around one-off work (data
preparation, checkpoint saves, the end of the run) go through the rendezvous store with
the long bound, so they never share the short one.
"""

from __future__ import annotations

import itertools
import os
import signal
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.distributed.distributed_c10d import _get_default_store, _set_pg_timeout

from trainer.names import SHUTDOWN_TIMEOUT_ENV
from trainer.spec import SpecError, TimeoutsSpec

# Public (and _set_pg_timeout deprecated) in newer torch releases than the oldest one supported.
set_timeout = getattr(torch_dist, "set_timeout", _set_pg_timeout)


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    timeouts: TimeoutsSpec = field(default_factory=TimeoutsSpec, repr=False)
    # Small CPU-side collectives (stop flag, RNG states): gloo, so they never wait on the GPU stream.
    control_group: Any = field(default=None, repr=False)
    # torchrun's rendezvous store (a TCPStore served by the agent of node 0), under a prefix of ours:
    # the watchdog and the barriers use it, and it answers while a rank is stuck in a collective.
    store: Any = field(default=None, repr=False)
    barriers: itertools.count = field(default_factory=itertools.count, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return torch_dist.is_available() and torch_dist.is_initialized()


def cuda_device(local_rank: int, visible: int) -> torch.device:
    """This process's GPU. NCCL needs one per process: a node's processes must not outnumber its GPUs."""
    if local_rank >= visible:
        processes = os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1))
        raise SpecError(
            f"procsPerNode: {processes} processes on this node, but {visible} GPU(s) visible to it (the pod's"
            " nvidia.com/gpu, CUDA_VISIBLE_DEVICES): each process needs a GPU of its own"
        )
    return torch.device("cuda", local_rank)


def init_distributed(timeouts: TimeoutsSpec) -> Dist:
    """Join the process group torchrun describes (NCCL on CUDA, gloo on CPU), and its store; one process only
    the store."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        device = cuda_device(local_rank, torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if "TORCHELASTIC_RUN_ID" not in os.environ and world_size == 1:
        return Dist(rank=rank, local_rank=local_rank, world_size=world_size, device=device, timeouts=timeouts)
    timeout = timedelta(seconds=timeouts.long_work_seconds)
    control_group = None
    if world_size == 1:
        # No peer: no process group, whose gloo event loop alone wakes every 10 ms, preempting a compute thread
        # each time (about 1% of a CPU step, docs/performance.md). torchrun's store still serves the watchdog.
        store, _, _ = next(torch_dist.rendezvous("env://", timeout=timeout))
    else:
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch_dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
        control_group = torch_dist.new_group(backend="gloo") if backend == "nccl" else None
        store = _get_default_store()
    # torchrun gives every attempt a fresh store (the chart makes elastic rendezvous do so too): no stale keys.
    # Not keyed by TORCHELASTIC_RESTART_COUNT, which differs between nodes after an elastic restart.
    return Dist(rank, local_rank, world_size, device, timeouts, control_group, torch_dist.PrefixStore("ddpjob/", store))


def step_timeouts(dist: Dist) -> None:
    """From now on a collective that waits longer than `collectiveSeconds` fails (after the first step)."""
    if dist.is_distributed:
        timeout = timedelta(seconds=dist.timeouts.collective_seconds)
        for group in {None, dist.control_group}:
            set_timeout(timeout, group)


def all_reduce_sum(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum `tensor` over all ranks (of `group`), in place; returns it for chaining."""
    if torch_dist.is_initialized():
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM, group=group)
    return tensor


def barrier(dist: Dist) -> None:
    """Wait for every rank, up to `longWorkSeconds`: two store round trips, no collective.

    Every rank passes the same barriers in the same order, so the n-th call names the same key everywhere.
    """
    if dist.store is None:
        return
    key = f"barrier/{next(dist.barriers)}"
    if dist.store.add(key, 1) == dist.world_size:
        dist.store.set(f"{key}/done", "1")
    try:
        dist.store.wait([f"{key}/done"], timedelta(seconds=dist.timeouts.long_work_seconds))
    except torch_dist.DistStoreError as exc:
        arrived = dist.store.add(key, 0)
        raise TimeoutError(
            f"rank {dist.rank}: {arrived} of {dist.world_size} ranks reached barrier {key} within"
            f" training.timeouts.longWorkSeconds ({dist.timeouts.long_work_seconds} s)"
        ) from exc


def shutdown() -> None:
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()


class StopRequest:
    """SIGTERM (eviction, preemption, `ctl run` interrupted) asks training to stop at a step boundary.

    Ranks receive the signal at slightly different times, or only one pod gets it (an eviction),
    so the ranks sum their flags before acting on them, at the same steps: at every log step,
    inside the reduction the log line makes anyway, and in between only where the steps since
    the last check would take more than a quarter of the time torchrun gives its workers to save
    and exit (TORCH_ELASTIC_SHUTDOWN_TIMEOUT), with a reduction of its own. The spacing comes from
    the ranks' mean step time, summed with the flags, so every rank checks at the same steps.
    """

    def __init__(self, dist: Dist) -> None:
        self.dist = dist
        self.requested = False
        self.previous_handler: Any = None
        self.budget = float(os.environ.get(SHUTDOWN_TIMEOUT_ENV, "30")) / 4
        self.next_check = 0  # the first step after a start or resume is checked

    def __enter__(self) -> StopRequest:
        self.previous_handler = signal.signal(signal.SIGTERM, self.request)
        return self

    def __exit__(self, *exc_info: object) -> None:
        signal.signal(signal.SIGTERM, self.previous_handler)

    def request(self, signum: int, frame: object) -> None:
        self.requested = True

    def vote(self, step_seconds: float, device: torch.device | None = None) -> torch.Tensor:
        """(flag, step time), to be summed over ranks."""
        return torch.tensor([float(self.requested), step_seconds], dtype=torch.float64, device=device)

    def agreed(self, step: int, step_seconds: float, votes: list[float] | None) -> bool:
        """Whether every rank stops after `step`. `votes`: `vote()` summed over ranks by the log step's
        reduction; without it, the ranks reduce their votes here when a check is due."""
        if votes is None:
            if step < self.next_check:
                return False
            votes = all_reduce_sum(self.vote(step_seconds), self.dist.control_group).tolist()
        requested, seconds = votes
        self.next_check = step + max(1, int(self.budget / max(seconds / self.dist.world_size, 1e-6)))
        return requested > 0

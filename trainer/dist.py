"""Process group and rank helpers: torchrun env in, a small `Dist` handle out.

Without torchrun (plain `python -m trainer`) the trainer runs as a single process
with no process group; every collective here is then a no-op.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    # Small CPU-side collectives (stop flag, RNG states): gloo, so they never wait on the GPU stream.
    control_group: Any = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return torch_dist.is_available() and torch_dist.is_initialized()


def init_distributed() -> Dist:
    """Join the process group torchrun describes: NCCL on CUDA, gloo on CPU."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if "TORCHELASTIC_RUN_ID" in os.environ or world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch_dist.init_process_group(
            backend,
            timeout=timedelta(minutes=10),
            device_id=device if device.type == "cuda" else None,
        )
        control_group = torch_dist.new_group(backend="gloo") if backend == "nccl" else None
        return Dist(rank, local_rank, world_size, device, control_group)
    return Dist(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks, in place; returns it for chaining."""
    if torch_dist.is_initialized():
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM)
    return tensor


def barrier() -> None:
    if torch_dist.is_initialized():
        torch_dist.barrier()


def shutdown() -> None:
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()


class StopRequest:
    """SIGTERM (eviction, preemption, `ctl run` interrupted) asks training to stop at a step boundary.

    Ranks receive the signal at slightly different times; `agreed()` all-reduces the
    flag so that every rank stops after the same step.
    """

    def __init__(self, dist: Dist) -> None:
        self.dist = dist
        self.requested = False
        self.previous_handler: Any = None

    def __enter__(self) -> StopRequest:
        self.previous_handler = signal.signal(signal.SIGTERM, self.request)
        return self

    def __exit__(self, *exc_info: object) -> None:
        signal.signal(signal.SIGTERM, self.previous_handler)

    def request(self, signum: int, frame: object) -> None:
        self.requested = True

    def agreed(self) -> bool:
        flag = torch.tensor([float(self.requested)])
        if torch_dist.is_initialized():
            torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MAX, group=self.dist.control_group)
        return bool(flag.item())

"""Process group and rank helpers: torchrun env in, a small `Dist` handle out.

Without torchrun (plain `python -m trainer`) the trainer runs as a single process
with no process group; every collective here is then a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as torch_dist


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

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

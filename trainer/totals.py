"""Named sums over a span of training steps or an evaluation: per rank on the device, over every rank on the host."""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

import torch

from trainer.dist import all_reduce_sum


@dataclass(frozen=True)
class Sums:
    """A span's sums over every rank, on the host (and in a checkpoint's state.json)."""

    loss_sum: float = 0.0
    correct: float = 0.0
    targets: float = 0.0  # scored targets: tokens (language modelling) or examples (classification)
    tokens: float = 0.0  # input tokens

    @classmethod
    def saved(cls, value: Sums | dict[str, float] | list[float]) -> Sums:
        """From a checkpoint's state.json; those written before the sums had names hold them in field order."""
        if isinstance(value, Sums):
            return value
        return cls(**value) if isinstance(value, dict) else cls(*value)

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.targets, 1)

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.targets, 1)


FIELDS = len(fields(Sums))


class Totals:
    """Running sums over a span of steps (a log interval, an epoch, an evaluation), on this rank's device.

    The fields of `Sums` live in one float64 vector, in their order: adding a batch never waits for the
    device (the count is filled in there: `torch.tensor(count, device=cuda)` would be a blocking copy), and
    summing over ranks is one all-reduce.
    """

    def __init__(self, device: torch.device, saved: Sums | None = None) -> None:
        self.vector = torch.tensor(astuple(saved or Sums()), dtype=torch.float64, device=device)

    def add(self, loss_sum: torch.Tensor, correct: torch.Tensor, targets: int, tokens: int = 0) -> None:
        self.vector[:3] += torch.stack(
            [loss_sum.detach().double(), correct.double(), correct.new_full((), targets, dtype=torch.float64)]
        )
        self.vector[3] += tokens

    def summed(self, rider: torch.Tensor | None = None) -> tuple[Sums, list[float]]:
        """These totals over every rank, and `rider` summed in the same all-reduce (the stop votes at a log step)."""
        extra = [] if rider is None else [rider]
        values = all_reduce_sum(torch.cat([self.vector, *extra])).tolist()
        return Sums(*values[:FIELDS]), values[FIELDS:]

    def saved(self) -> Sums:
        """Summed over every rank, for a checkpoint: on resume rank 0 carries them and the other ranks start at 0."""
        return Sums(*all_reduce_sum(self.vector.clone()).tolist())

    def zero(self) -> None:
        self.vector.zero_()

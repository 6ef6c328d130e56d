"""The training order: a permutation of the samples per epoch, computed per position in constant memory."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from trainer.data import ORDER_BLOCK, EpochOrder, TrainBatches
from trainer.dist import Dist

SMALL = [*range(1, 130), 251, 256, 257, 1009, 4096, 65521, 65537, 999_983]


def streams(length: int, world_size: int, batch_size: int, seed: int = 5) -> list[TrainBatches]:
    """Each rank's batches over `length` samples, each its own index (a range: no memory per sample)."""
    cpu = torch.device("cpu")
    return [
        TrainBatches(range(length), Dist(rank, rank, world_size, cpu), batch_size, seed, collate=None)
        for rank in range(world_size)
    ]


@pytest.mark.parametrize("seed", [0, 1337])
def test_every_sample_comes_exactly_once_per_epoch_for_any_length(seed: int) -> None:
    for length in SMALL:
        for epoch in (0, 1):
            order = EpochOrder(length, seed, epoch)[:]
            assert np.array_equal(np.sort(order), np.arange(length)), (length, epoch)


@pytest.mark.parametrize("length", [2**31 + 11, 3 * 2**33 + 1, 2**40 + 3])
def test_lengths_past_int32_give_distinct_samples_in_range_without_building_the_order(length: int) -> None:
    """300,000 positions spread over the epoch and at both ends. At 2^31 a map that were not one-to-one
    would repeat about 20 of them (birthday bound); beyond, distinct values in range is what can be seen."""
    order = EpochOrder(length, seed=1337, epoch=3)
    taken = np.concatenate([order[:50_000], order[50_000 : length - 50_000 : length // 210_000], order[-50_000:]])
    assert len(taken) >= 300_000
    assert taken.min() >= 0 and taken.max() < length
    assert len(np.unique(taken)) == len(taken)
    assert order[length - 1] == taken[-1] and order[0] == taken[0]


def test_the_order_depends_on_seed_and_epoch_only() -> None:
    first = EpochOrder(1000, seed=7, epoch=1)[:]
    assert np.array_equal(first, EpochOrder(1000, seed=7, epoch=1)[:])
    assert not np.array_equal(first, EpochOrder(1000, seed=7, epoch=2)[:])
    assert not np.array_equal(first, EpochOrder(1000, seed=8, epoch=1)[:])
    # Seed 8's first epoch is not seed 7's second (as seed + epoch would make it).
    assert not np.array_equal(first, EpochOrder(1000, seed=8, epoch=0)[:])
    # Pinned: a checkpoint resumes at a position of this order, so changing it changes resumed runs.
    assert EpochOrder(10, seed=0, epoch=0)[:].tolist() == [7, 5, 2, 3, 1, 6, 9, 8, 0, 4]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6])
def test_ranks_take_their_share_of_one_global_order_whatever_the_world_size(world_size: int) -> None:
    """Global batch 12 over 50 samples: 4 batches an epoch (2 samples dropped), then the next epoch's order."""
    iterators = [iter(stream) for stream in streams(50, world_size, 12 // world_size)]
    steps = [[next(it).tolist() for it in iterators] for _ in range(6)]
    global_batches = [[per_rank[j % world_size][j // world_size] for j in range(12)] for per_rank in steps]
    want = np.concatenate([EpochOrder(50, 5, 0)[:48], EpochOrder(50, 5, 1)[:24]]).reshape(6, 12)
    assert global_batches == want.tolist()


def test_batches_are_the_orders_global_batches_in_turn_across_blocks_and_epochs() -> None:
    """A rank's indices are computed ORDER_BLOCK at a time; from a position a resume under another world size can
    leave (not a multiple of the global batch), its batches still follow the epoch's order, then the next one's."""
    length, world_size, batch_size, position = 2 * ORDER_BLOCK + 1001, 3, 7, 5
    global_batch = world_size * batch_size
    full = (length - position) // global_batch  # this epoch's batches left; the rest of it is dropped
    iterators = []
    for stream in streams(length, world_size, batch_size):
        stream.position = position
        iterators.append(iter(stream))
    steps = [np.stack([next(it).numpy() for it in iterators], axis=1).reshape(-1) for _ in range(full + 3)]
    first, second = EpochOrder(length, 5, 0), EpochOrder(length, 5, 1)
    want = np.concatenate([first[position : position + full * global_batch], second[: 3 * global_batch]])
    assert np.array_equal(np.concatenate(steps), want)


def test_memory_of_a_step_does_not_grow_with_the_dataset() -> None:
    """A billion times more samples: the same memory for the order (a permutation of 10^15 samples would
    take petabytes)."""

    def peak_bytes(length: int) -> int:
        next(iter(streams(10, world_size=1, batch_size=2)[0]))  # first-use allocations, outside the count
        tracemalloc.start()
        batches = iter(streams(length, world_size=2, batch_size=64)[1])
        for _ in range(3):
            next(batches)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    small, huge = peak_bytes(10**6), peak_bytes(10**15)
    assert huge < small + 4096, (small, huge)
    # A block of positions (numpy's temporaries over ORDER_BLOCK uint64 values), not the 8 MB of an order of 10^6.
    assert small < 8 * ORDER_BLOCK * 8, small

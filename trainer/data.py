"""Prepared token files in, batches out: memory-mapped datasets, the char-gpt vocabulary and the samplers.

Every dataset reads its split through `numpy.memmap` (trainer/preparation/build.py writes the files): a
rank's memory does not grow with the corpus, and the ranks of a node share the pages.

Training walks one global shuffled order per epoch (`EpochOrder`, computed per position,
so it costs no memory per sample), `world size x batchSize` samples at a time, rank r
taking every W-th of them (what `DistributedSampler` does). Its position is a count of
global samples, so a resumed run continues at the exact batch, on any world size.
Evaluation shards with `ShardSampler`, which never pads, so no sample is counted twice.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset, default_collate

from trainer.dist import Dist
from trainer.spec import SpecError

SPECIAL_TOKEN = "<|endoftext|>"
SPECIAL_ROLES = ("bos_token", "eos_token", "unk_token")  # the char vocabulary's one special token plays all three
# A rank's next samples of the order are computed this many at once: EpochOrder's numpy calls cost about the same
# at any length, 100-760 µs a batch at a time, 5-29 µs a batch a block at a time (bench/data.py, docs/data.md).
ORDER_BLOCK = 4096
Collate = Callable[[list[Any]], dict[str, torch.Tensor]]


class CharVocab:
    """Characters sorted by code point, then one special token (unknown / end of text)."""

    def __init__(self, chars: list[str]) -> None:
        self.chars = sorted(chars)
        self.codepoints = torch.tensor([ord(c) for c in self.chars], dtype=torch.int64)
        self.special_id = len(self.chars)
        self.model_max_length: int | None = None  # written to the config when set, as transformers' tokenizers do

    @property
    def size(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> torch.Tensor:
        points = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).to(torch.int64)
        ids = torch.searchsorted(self.codepoints, points).clamp_(max=len(self.chars) - 1)
        return torch.where(self.codepoints[ids] == points, ids, self.special_id)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] if i < len(self.chars) else SPECIAL_TOKEN for i in ids)

    def __len__(self) -> int:
        return self.size

    def save_pretrained(self, directory: Path) -> None:
        """The same mapping as a transformers tokenizer (tokenizer.json and its config), so `final/` loads with
        AutoTokenizer; written with `tokenizers` alone, since importing transformers costs seconds a process."""
        from tokenizers import AddedToken, Tokenizer, decoders, models

        vocab = {c: i for i, c in enumerate(self.chars)} | {SPECIAL_TOKEN: self.special_id}
        # BPE without merges splits text into single characters; Fuse joins them back.
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKEN))
        backend.decoder = decoders.Fuse()
        backend.add_special_tokens([AddedToken(SPECIAL_TOKEN, special=True, normalized=False)])
        directory.mkdir(parents=True, exist_ok=True)
        backend.save(str(directory / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast"} | dict.fromkeys(SPECIAL_ROLES, SPECIAL_TOKEN)
        if self.model_max_length is not None:
            config["model_max_length"] = self.model_max_length
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


class DamagedDataset(RuntimeError):
    """A prepared dataset's file is not the size its manifest says (cut short on a full disk, or changed by hand)."""


def mapped(path: Path, dtype: Any, count: int) -> np.ndarray:
    """`count` items of `dtype` from `path`, memory-mapped read-only; a file of another size is named, with what to
    do (numpy's "mmap length is greater than file size" named neither the file nor the dataset)."""
    expected, size = count * np.dtype(dtype).itemsize, path.stat().st_size
    if size != expected:
        raise DamagedDataset(
            f"{path} holds {size:,} bytes where its manifest says {expected:,}: the prepared dataset is damaged;"
            f" delete {path.parent} to prepare it again"
        )
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def open_tokens(entry: Path, split: str, manifest: dict[str, Any]) -> np.ndarray:
    """A split's token ids, memory-mapped read-only."""
    count = manifest["splits"][split]["tokens"]
    if not count:  # mmap cannot map an empty file
        return np.zeros(0, dtype=manifest["dtype"])
    return mapped(entry / f"{split}.bin", manifest["dtype"], count)


class TokenBlocks(Dataset):
    """Consecutive non-overlapping windows: input `block_size` tokens, target shifted by one."""

    def __init__(self, tokens: np.ndarray, block_size: int) -> None:
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_size)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.block_size
        window = torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}


class LabelledExamples(Dataset):
    """Documents of a prepared classification split (`rows` of it, when given) with their label ids;
    batches are padded by `PadCollator`."""

    def __init__(self, entry: Path, split: str, manifest: dict[str, Any], rows: np.ndarray | None = None) -> None:
        documents = manifest["splits"][split]["documents"]
        self.tokens = open_tokens(entry, split, manifest)
        self.ends = mapped(entry / f"{split}.idx", np.int64, documents)
        self.label_ids = mapped(entry / f"{split}.labels", np.int32, documents)
        self.rows = np.arange(documents) if rows is None else rows

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def labels(self) -> list[int]:
        return self.label_ids[self.rows].tolist()

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = int(self.rows[index])
        start = int(self.ends[row - 1]) if row else 0
        ids = torch.from_numpy(self.tokens[start : int(self.ends[row])].astype(np.int64))
        return {"input_ids": ids, "labels": int(self.label_ids[row]), "index": index}


class PadCollator:
    """Dynamic padding: right-pad each batch to its longest example (pad = eos), with an attention mask."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(item["input_ids"]) for item in items)
        input_ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(items), width), dtype=torch.long)
        for row, item in enumerate(items):
            input_ids[row, : len(item["input_ids"])] = item["input_ids"]
            attention_mask[row, : len(item["input_ids"])] = 1
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": torch.tensor([item["labels"] for item in items]),
            "index": torch.tensor([item["index"] for item in items]),
        }


def raise_block_too_long(block_size: int, count: int, unit: str, split: str) -> None:
    """A split's text holds no block: blockSize is what to change (or the data)."""
    raise SpecError(
        f"training.model.blockSize: {block_size} is too long for the {split} text ({count} {unit}; a block"
        " takes blockSize + 1)"
    )


def check_enough_samples(count: int, dist: Dist, batch_size: int, key: str) -> None:
    """Every rank needs at least one full batch, or training would take no step."""
    if count < dist.world_size * batch_size:
        raise SpecError(f"{key}: {count} samples, fewer than world size x batchSize = {dist.world_size} x {batch_size}")


class ShardSampler(Sampler[int]):
    """Rank r takes indices r, r+W, r+2W, ...: shards may differ by one, nothing is duplicated."""

    def __init__(self, length: int, dist: Dist) -> None:
        self.indices = range(dist.rank, length, dist.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a bijection of uint64 whose every output bit depends on every input bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class EpochOrder:
    """One epoch's shuffled order of range(length): `order[i]` is the sample at position i.

    A materialized permutation (randperm) costs 4-8 bytes per sample on every rank, growing
    with the corpus; this computes only the positions asked for. A keyed Feistel network
    permutes [0, 4^half_bits), the smallest such domain that holds `length` values, and
    cycle-walking (applying it again until the value is below `length`, fewer than 4 times per
    position on average) makes that a permutation of range(length). Keys come from (seed,
    epoch) alone: the order is the same on every rank and world size.
    """

    ROUNDS = 6

    def __init__(self, length: int, seed: int, epoch: int) -> None:
        self.length = length
        self.half_bits = max(1, (max(length - 1, 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half_bits) - 1)
        words = np.array([seed % 2**64, epoch % 2**64], dtype=np.uint64)
        key = _mix(_mix(words[:1]) ^ words[1:])
        self.keys = _mix(key + np.arange(1, self.ROUNDS + 1, dtype=np.uint64))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: int | slice) -> Any:
        """An int for an int, an int64 array for a slice; a slice costs memory for its own length only."""
        positions = range(self.length)[key]
        if isinstance(positions, int):
            return int(self._permute(np.array([positions], dtype=np.uint64))[0])
        return self._permute(np.arange(positions.start, positions.stop, positions.step, dtype=np.uint64))

    def _permute(self, values: np.ndarray) -> np.ndarray:
        values = self._feistel(values)
        outside = values >= self.length
        while outside.any():
            values[outside] = self._feistel(values[outside])
            outside = values >= self.length
        return values.astype(np.int64)

    def _feistel(self, values: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half_bits)
        left, right = values >> shift, values & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << shift) | right


class TrainBatches:
    """Endless stream of this rank's training batches; `epoch` and `position` say where it stands.

    `position` counts the global samples of the current epoch already handed out (all
    ranks together), so it means the same thing whatever the world size.
    """

    def __init__(self, dataset: Dataset, dist: Dist, batch_size: int, seed: int, collate: Collate | None) -> None:
        self.dataset = dataset
        self.rank, self.world_size = dist.rank, dist.world_size
        self.batch_size, self.global_batch = batch_size, dist.world_size * batch_size
        self.seed = seed
        self.collate = collate or default_collate
        self.pin_memory = dist.device.type == "cuda"
        self.epoch = 0
        self.position = 0

    @property
    def batches_per_epoch(self) -> int:
        """Full global batches per epoch; the remainder of the shuffled order is dropped."""
        return len(self.dataset) // self.global_batch

    @property
    def completed_epochs(self) -> int:
        """Epochs whose batches have all been handed out."""
        return self.epoch + (self.position + self.global_batch > len(self.dataset))

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.position / max(1, self.batches_per_epoch * self.global_batch)

    def epoch_order(self, epoch: int) -> EpochOrder:
        return EpochOrder(len(self.dataset), self.seed, epoch)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """`epoch` and `position` are read where it starts, and then kept up to date."""
        while True:
            order = self.epoch_order(self.epoch)
            while self.position + self.global_batch <= len(order):
                # This rank's share of the next global batches (of the epoch's full ones): a slice every
                # world_size-th position from its rank, batch_size of them per batch.
                batches = min((len(order) - self.position) // self.global_batch, max(1, ORDER_BLOCK // self.batch_size))
                ahead = order[self.position + self.rank : self.position + batches * self.global_batch : self.world_size]
                for indices in ahead.reshape(batches, self.batch_size).tolist():
                    self.position += self.global_batch
                    batch = self.collate([self.dataset[i] for i in indices])
                    yield {k: v.pin_memory() for k, v in batch.items()} if self.pin_memory else batch
            self.epoch, self.position = self.epoch + 1, 0


def evenly_spaced(dataset: Dataset, count: int) -> Dataset:
    """`count` examples spread evenly over `dataset`, or all of it when it holds no more."""
    if count >= len(dataset):
        return dataset
    return Subset(dataset, [i * len(dataset) // count for i in range(count)])


def eval_loader(dataset: Dataset, dist: Dist, batch_size: int, collate: Collate | None) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=ShardSampler(len(dataset), dist),
        collate_fn=collate,
        # Its own generator: evaluating must not draw from the global RNG that training uses.
        generator=torch.Generator(),
        pin_memory=dist.device.type == "cuda",
    )
